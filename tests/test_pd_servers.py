"""A real disaggregated 1P1D on this machine: two vLLM CPU servers (the
static-shape worker and NeuronScheduler on both, each with its own buckets)
joined by vLLM's ExampleConnector, behind the read-mode proxy, driven by
vLLM's own benchmark client. Greedy outputs must equal a colocated
server's, every loaded prompt must come from the prefill side, and nothing
started may outlive the run."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

#: The prefill engine packs prompts; the decode engine has its own batch
#: buckets. Both use vLLM's CPU block size (32, AWS's too).
PREFILL_CONFIG = {"num_batched_tokens_buckets": [128, 512], "max_prefills_per_batch": 2}
DECODE_CONFIG = {"num_seqs_buckets": [2, 4], "num_batched_tokens_buckets": [64, 512]}
#: (prompt, output) lengths: loads of 0, 1 and several blocks.
LENGTHS = [
    (40, 8),
    (17, 5),
    (100, 12),
    (33, 3),
    (300, 6),
    (65, 9),
    (128, 7),
    (2, 4),
    (97, 5),
]
#: Direct requests (prompt index, length): the last shares its first 65
#: tokens with the 65-token one, and 97 - 1 is a multiple of 32: on that
#: pair vLLM's own ExampleConnector kills the decode engine (``pd_connector``).
DIRECT = [(100 + i, n) for i, (n, _) in enumerate(LENGTHS)] + [(105, 97)]


def _post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _alive(pid: int, grace_s: float = 15.0) -> bool:
    """Whether process group ``pid`` still has a member after ``grace_s``
    (members SIGKILLed a moment ago may not be reaped yet)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.5)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from neuron_scheduler.offline.engine_spec import CPU_STATIC_WORKER, EngineSpec
    from neuron_scheduler.offline.tinymodel import make_tiny_llama

    model = str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
    base = EngineSpec(
        model=model,
        max_model_len=512,
        max_num_batched_tokens=512,
        max_num_seqs=4,
        kv_cache_memory_bytes=16 << 20,
        block_size=32,
        worker_cls=CPU_STATIC_WORKER,
    )
    return (
        replace(base, neuron_config=PREFILL_CONFIG),
        replace(base, neuron_config=DECODE_CONFIG),
        base,
    )


@pytest.fixture(scope="module")
def runs(engines, tmp_path_factory):
    """The same requests through the 1P1D and through one colocated server."""
    from neuron_scheduler.offline.engine_spec import server_args
    from neuron_scheduler.offline.pd_servers import DisaggregatedServers, PairSpec
    from neuron_scheduler.offline.server import ServerProcess
    from neuron_scheduler.sim.replay import prompt_ids, replay, vocab_size
    from neuron_scheduler.sim.workload import RequestSpec

    prefill, decode, colocated = engines
    specs = [
        RequestSpec(arrival_s=0.15 * i, input_len=n, output_len=m)
        for i, (n, m) in enumerate(LENGTHS)
    ]
    vocab = vocab_size(prefill.model)
    greedy = {"temperature": 0}
    logs = tmp_path_factory.mktemp("pd-logs")
    pair = DisaggregatedServers(PairSpec(prefill, decode), logs)
    with pair:
        pids = [p.process.pid for p in pair.processes]
        cores = _where_each_runs(pair)
        split = asyncio.run(
            replay(pair.base_url, specs, 6.0, None, vocab, extra_body=greedy)
        )
        # Direct requests: the usage says how many prompt tokens were loaded.
        usage = [
            _post(
                f"{pair.base_url}/v1/completions",
                {
                    "model": "validate",
                    "prompt": prompt_ids(index, n, vocab),
                    "max_tokens": 2,
                    "temperature": 0,
                },
            )["usage"]
            for index, n in DIRECT
        ]
        stored = sorted(p.name for p in pair.storage.iterdir())
    with ServerProcess(
        colocated.model, server_args(colocated), logs / "colocated.log"
    ) as one:
        together = asyncio.run(
            replay(one.base_url, specs, 6.0, None, vocab, extra_body=greedy)
        )
    return {"split": split, "together": together, "usage": usage, "pids": pids,
            "stored": stored, "logs": logs, "cores": cores}  # fmt: skip


def _where_each_runs(pair) -> dict:
    """Each process tree's worker cores and the cores its threads may use."""
    from neuron_scheduler.offline.cpu_binding import process_tree, worker_cores

    def thread_cores(root: int) -> set[frozenset[int]]:
        masks = set()
        for pid in process_tree(root):
            for task in Path(f"/proc/{pid}/task").iterdir():
                masks.add(frozenset(os.sched_getaffinity(int(task.name))))
        return masks

    named = {"prefill": pair.prefill[0], "decode": pair.decode[0], "proxy": pair.proxy}
    return {
        "client": pair.client_cores,
        **{
            role: (worker_cores(p.process.pid), thread_cores(p.process.pid))
            for role, p in named.items()
        },
    }


def test_the_pair_loses_no_request_and_equals_the_colocated_outputs(runs):
    split, together = runs["split"], runs["together"]
    assert split["completed"] == len(LENGTHS), split["errors"]
    assert not any(split["errors"])
    assert [len(t) for t in split["generated_texts"]] == [
        len(t) for t in together["generated_texts"]
    ]
    assert split["generated_texts"] == together["generated_texts"]
    assert all(split["generated_texts"])


def test_the_decode_engine_loads_every_whole_block_of_the_prompt(runs):
    from neuron_scheduler.offline.pd_connector import stored_prompt_tokens

    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in runs["usage"]]
    assert cached == [stored_prompt_tokens(n, 32) for _, n in DIRECT]
    assert any(c >= 96 for c in cached)
    assert runs["stored"], "the prefill server stored nothing"


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to keep apart"
)
def test_no_engines_serving_threads_run_on_the_other_engines_worker_core(runs):
    cores = runs["cores"]
    (prefill_worker, prefill_threads) = cores["prefill"]
    (decode_worker, decode_threads) = cores["decode"]
    assert prefill_worker and decode_worker and not prefill_worker & decode_worker
    everything = frozenset(os.sched_getaffinity(0))
    for threads in (prefill_threads, decode_threads, cores["proxy"][1]):
        assert everything not in threads  # nothing left to the kernel
    assert all(not mask & decode_worker for mask in prefill_threads)
    assert all(not mask & prefill_worker for mask in decode_threads)
    # The proxy and the client go where the decode side's serving runs.
    assert cores["client"] and not cores["client"] & prefill_worker
    assert cores["proxy"][1] == {cores["client"]}


def test_everything_the_pair_started_is_stopped(runs):
    assert len(runs["pids"]) == 3
    assert not [pid for pid in runs["pids"] if _alive(pid)]


def test_a_decode_server_that_fails_to_start_stops_the_prefill_server(
    engines, tmp_path
):
    from neuron_scheduler.offline.pd_servers import DisaggregatedServers, PairSpec
    from neuron_scheduler.offline.server import ServerStartError

    prefill, decode, _ = engines
    broken = replace(decode, neuron_config={"num_seqs_buckets": [3, 99]})
    pair = DisaggregatedServers(PairSpec(prefill, broken), tmp_path)
    with pytest.raises(ServerStartError, match="num_seqs_buckets"):
        pair.start()
    started = [p.process.pid for p in pair.processes if p.process is not None]
    assert len(started) == 2  # both servers launched; the proxy never was
    assert not [pid for pid in started if _alive(pid)]
