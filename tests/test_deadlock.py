"""The design's deadlock: max_num_seqs above what the KV cache holds at
max_model_len. Without the KV admission rule the cache is over-committed: an
admitted prefill cannot get blocks, and once the decodes grow into the
blocks left, vLLM must preempt (which static-shape hardware cannot do; before
the empty-pass fallback the admitted prefill hid the decodes forever instead).
With the rule every request completes and nothing is ever preempted."""

import pytest

from helpers import neuron_engine, prompt
from neuron_scheduler import NeuronScheduler

pytestmark = pytest.mark.matrix

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


def test_without_kv_rule_the_cache_is_overcommitted_and_vllm_preempts():
    engine = neuron_engine(WithoutKvRule, **SETTINGS)
    _load(engine)
    empty_steps = 0
    while engine.has_work() and engine.num_preemptions == 0:
        output, _ = engine.step()
        if output is not None and output.total_num_scheduled_tokens == 0:
            empty_steps += 1
    assert engine.num_preemptions > 0
    assert empty_steps == 0  # it never stalls: the decodes run meanwhile


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
