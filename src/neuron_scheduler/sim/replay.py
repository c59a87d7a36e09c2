"""A level replayed on the server through vLLM's own benchmark client
(``vllm.benchmarks.serve.benchmark``, self-timed: every request at its
workload arrival time, its prompt as token ids of the workload's length,
``max_tokens`` its output length, EOS ignored)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from neuron_scheduler.sim.workload import RequestSpec


def prompt_ids(index: int, length: int, vocab: int) -> list[int]:
    """Deterministic token ids for request ``index`` (ids 0-3 are special)."""
    return [(index * 7919 + 13 * j) % (vocab - 4) + 4 for j in range(length)]


async def replay(
    base_url: str,
    specs: list[RequestSpec],
    request_rate: float,
    max_concurrency: int | None,
    vocab: int,
    *,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The benchmark client's per-request results for ``specs`` sent at
    ``request_rate`` (inf: at once), at most ``max_concurrency`` at a time;
    ``extra_body``: sampling fields added to every request (e.g.
    ``{"temperature": 0}`` for greedy outputs)."""
    from vllm.benchmarks.datasets.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType, benchmark

    requests = [
        SampleRequest(
            prompt=prompt_ids(i, spec.input_len, vocab),
            prompt_len=spec.input_len,
            expected_output_len=spec.output_len,
            timestamp=spec.arrival_s,
            request_id=f"validate-{i}",
        )
        for i, spec in enumerate(specs)
    ]
    # vLLM's client prints its own table: keep our output ours.
    with contextlib.redirect_stdout(io.StringIO()):
        return await benchmark(
            task_type=TaskType.GENERATION,
            endpoint_type="vllm",
            api_url=f"{base_url}/v1/completions",
            base_url=base_url,
            model_id="validate",
            model_name="validate",
            tokenizer=None,
            input_requests=requests,
            logprobs=None,
            request_rate=request_rate,
            burstiness=1.0,
            disable_tqdm=True,
            num_warmups=0,
            profile=False,
            selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"],
            selected_percentiles=[50.0, 99.0],
            ignore_eos=True,
            goodput_config_dict={},
            max_concurrency=max_concurrency,
            lora_modules=None,
            extra_headers=None,
            extra_body=extra_body,
            ready_check_timeout_sec=0,
            self_timed=True,
        )


def vocab_size(model: str) -> int:
    """The vocabulary size in the model directory's ``config.json``."""
    config = json.loads((Path(model) / "config.json").read_text())
    return int(config["vocab_size"])
