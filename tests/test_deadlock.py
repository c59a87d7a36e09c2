"""The design's deadlock: max_num_seqs above what the KV cache holds at
max_model_len. Without the KV admission rule an admitted prefill cannot get
blocks and hides the decodes forever; with it every request completes and
nothing is ever preempted."""

import pytest

from helpers import neuron_engine, prompt
from neuron_scheduler import NeuronScheduler

# 2 requests at max_model_len=1024 fit: 129 blocks of 16 (block 0 is null).
SETTINGS = dict(
    max_num_seqs=8,
    max_num_batched_tokens=1024,
    max_model_len=1024,
    block_size=16,
    num_kv_blocks=129,
)


class WithoutKvRule(NeuronScheduler):
    """The naive design: admission ignores KV capacity."""

    def _max_kv_concurrent(self) -> int:
        return self.scheduler_config.max_num_seqs


def _load(engine):
    for i in range(8):
        engine.add(f"r{i}", prompt(600, i), max_tokens=400)


def _steps_without_progress(engine, steps):
    """Step ``steps`` times; return how many of the last steps scheduled
    nothing while requests were unfinished."""
    stalled = 0
    for _ in range(steps):
        if not engine.has_work():
            return 0
        output, _ = engine.step()
        unfinished = engine.scheduler.get_num_unfinished_requests()
        if output is not None and output.total_num_scheduled_tokens == 0 and unfinished:
            stalled += 1
        else:
            stalled = 0
    return stalled


def test_without_kv_rule_the_scheduler_stops_making_progress():
    engine = neuron_engine(WithoutKvRule, **SETTINGS)
    _load(engine)
    assert _steps_without_progress(engine, 3000) > 1000
    assert engine.scheduler.get_num_unfinished_requests() == 8
    assert engine.num_preemptions == 0  # stuck, not thrashing


@pytest.mark.parametrize("kv_admission", ["max_model_len", "reserve"])
def test_with_kv_rule_every_request_completes_without_preemption(kv_admission):
    engine = neuron_engine(**SETTINGS, neuron_config={"kv_admission": kv_admission})
    assert engine.scheduler.admission_limits.max_kv_concurrent == 2
    _load(engine)
    engine.run(max_steps=10_000)
    assert all(len(engine.tokens[f"r{i}"]) == 400 for i in range(8))
    assert engine.num_preemptions == 0
    free = engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free == 128


def test_async_twin_also_completes_the_deadlock_workload():
    from neuron_scheduler import NeuronAsyncScheduler

    engine = neuron_engine(NeuronAsyncScheduler, pipelined=True, **SETTINGS)
    _load(engine)
    engine.run(max_steps=10_000)
    assert all(len(engine.tokens[f"r{i}"]) == 400 for i in range(8))
    assert engine.num_preemptions == 0
