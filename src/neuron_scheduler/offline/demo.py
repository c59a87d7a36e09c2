"""``make demo``: vLLM offline generation with ``NeuronScheduler`` on a tiny
random-weight Llama, printing every step and a padding summary."""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

from neuron_scheduler.offline.ipc_directory import use_process_ipc_directory
from neuron_scheduler.step import StepKind, StepRecord

#: Prompt lengths (tokens) of the demo's dozen requests; with
#: max_num_batched_tokens=512 the ones above 512 are chunked.
DEMO_PROMPT_LENGTHS = (12, 200, 700, 45, 1300, 90, 300, 5, 520, 130, 64, 1000)


def run_demo(model_dir: str | None = None, max_tokens: int = 8) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    use_process_ipc_directory()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from neuron_scheduler.offline.tinymodel import TINY_ENGINE_ARGS, make_tiny_llama
    from neuron_scheduler.scheduler import NeuronScheduler

    path = make_tiny_llama(
        model_dir or Path(tempfile.gettempdir()) / "neuron-scheduler-tiny-llama"
    )
    llm = LLM(
        model=str(path),
        scheduler_cls="neuron_scheduler.NeuronScheduler",
        additional_config={"neuron_config": {}},
        **TINY_ENGINE_ARGS,  # type: ignore[arg-type]
    )
    # In-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0).
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
    assert isinstance(scheduler, NeuronScheduler)
    config = scheduler.neuron_config
    print(
        f"\nNeuronScheduler: token buckets {list(config.num_batched_tokens_buckets)}, "
        f"batch buckets {list(config.num_seqs_buckets)}, "
        f"KV holds {scheduler.admission_limits.max_kv_concurrent} requests "
        f"at max_model_len={scheduler.max_model_len}\n"
    )
    ids: dict[str, str] = {}
    step_numbers = itertools.count(1)

    def log_step(record: StepRecord) -> None:
        if record.kind is StepKind.EMPTY:
            return
        names = [ids.setdefault(r, f"#{len(ids)}") for r in record.request_ids]
        if record.kind is StepKind.PREFILL:
            shape = f"tokens {record.total_actual:>5} -> {record.total_padded:>5}"
        else:
            shape = f"batch  {record.num_seqs:>5} -> {record.num_seqs_padded:>5}"
        print(
            f"step {next(step_numbers):>3}  {record.state.name:<14} "
            f"{record.kind.value:<7} {shape}  requests {' '.join(names)}"
        )

    scheduler.step_listeners.append(log_step)
    prompts = [
        TokensPrompt(prompt_token_ids=[(i * 31 + j) % 150 + 4 for j in range(n)])
        for i, n in enumerate(DEMO_PROMPT_LENGTHS)
    ]
    outputs = llm.generate(
        prompts,
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    totals = scheduler.metrics
    print("\nPadding summary")
    print(
        f"  prefill: {totals.prefill_tokens} real tokens in "
        f"{totals.prefill_tokens_padded} padded ({totals.prefill_padding_ratio:.1%} "
        f"padding) over {totals.steps[StepKind.PREFILL]} steps"
    )
    print(
        f"  decode:  {totals.decode_slots} real slots in {totals.decode_slots_padded} "
        f"padded ({totals.decode_padding_ratio:.1%} padding) over "
        f"{totals.steps[StepKind.DECODE]} steps"
    )
    done = sum(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    print(f"  {done}/{len(outputs)} requests generated {max_tokens} tokens each")
