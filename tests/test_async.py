"""NeuronAsyncScheduler driven like vLLM's async engine core: step N+1 is
scheduled before step N's output is applied."""

import random

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from helpers import neuron_engine, prompt, run_trace
from neuron_scheduler import NeuronAsyncScheduler, NeuronScheduler
from neuron_scheduler.step import StepKind

pytestmark = pytest.mark.matrix


def test_class_combines_neuron_and_async_scheduler():
    assert issubclass(NeuronAsyncScheduler, NeuronScheduler)
    assert issubclass(NeuronAsyncScheduler, AsyncScheduler)
    mro = NeuronAsyncScheduler.__mro__
    assert mro.index(NeuronScheduler) < mro.index(AsyncScheduler)


def test_async_golden_trace_for_chunked_prompt_and_decodes():
    engine = neuron_engine(
        NeuronAsyncScheduler, pipelined=True, max_num_batched_tokens=8192
    )
    engine.add("a", prompt(200, 1), max_tokens=3)
    engine.add("b", prompt(20000, 2), max_tokens=2)
    assert run_trace(engine) == [
        ("prefill", ("a",), 200, 256, "ACTIVE_PREFILL"),
        ("prefill", ("b",), 8192, 8192, "ACTIVE_PREFILL"),
        ("prefill", ("b",), 8192, 8192, "ACTIVE_PREFILL"),
        ("prefill", ("b",), 3616, 4096, "ACTIVE_PREFILL"),
        ("decode", ("a", "b"), 2, 2, "ACTIVE_DECODE"),
        ("decode", ("a",), 1, 1, "ACTIVE_DECODE"),
    ]
    assert engine.tokens["a"] and len(engine.tokens["a"]) == 3
    assert len(engine.tokens["b"]) == 2


def _random_workload(engine, rng, n):
    for i in range(n):
        engine.add(
            f"r{i}", prompt(rng.randint(1, 3000), i), max_tokens=rng.randint(1, 40)
        )


def _run_with_arrivals(engine, rng, n):
    """Add requests over time while stepping; return the step records."""
    records, added, pipelined_steps = [], 0, 0
    while added < n or engine.has_work():
        if added < n and rng.random() < 0.3:
            engine.add(
                f"r{added}",
                prompt(rng.randint(1, 3000), added),
                max_tokens=rng.randint(1, 40),
            )
            added += 1
            continue
        if not engine.has_work():
            continue
        scheduled, applied = engine.step()
        if scheduled is not None:
            records.append(engine.scheduler.last_step)
            if applied is None or applied.output is not scheduled:
                pipelined_steps += 1
    return records, pipelined_steps


def test_async_twin_keeps_the_guarantees_under_overlap():
    rng = random.Random(7)
    engine = neuron_engine(
        NeuronAsyncScheduler,
        pipelined=True,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        max_model_len=4096,
    )
    records, pipelined_steps = _run_with_arrivals(engine, rng, 60)
    assert pipelined_steps > 50  # the overlap really happened
    for request_id, request in engine.requests.items():
        assert len(engine.tokens[request_id]) == request.max_tokens
    assert engine.num_preemptions == 0
    kinds = {record.kind for record in records}
    assert {StepKind.PREFILL, StepKind.DECODE} <= kinds
    for record in records:
        if record.kind is StepKind.PREFILL:
            assert all(v <= 1024 for v in record.actual_tokens.values())
            assert len(record.request_ids) == 1
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_sync_and_async_produce_the_same_tokens():
    results = []
    for cls, pipelined in ((NeuronScheduler, False), (NeuronAsyncScheduler, True)):
        engine = neuron_engine(cls, pipelined=pipelined, max_num_batched_tokens=2048)
        _random_workload(engine, random.Random(3), 20)
        engine.run()
        results.append(engine.tokens)
    assert results[0] == results[1]
