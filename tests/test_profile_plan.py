"""What ``neuron-scheduler profile`` plans to run, before any engine: the
prefill scenarios by bucket, fill and context."""

from neuron_scheduler.config import EngineLimits, NeuronConfig
from neuron_scheduler.offline.profiler import (
    ProfileModes,
    least_fills,
    scenarios_for,
)

LIMITS = EngineLimits(max_num_batched_tokens=512, max_model_len=2048, max_num_seqs=4)
CONFIG = NeuronConfig.from_dict({"num_batched_tokens_buckets": [128, 512]}, LIMITS)


def _prefill_prompts(prefill_fill: str) -> set[tuple[int, ...]]:
    modes = ProfileModes(decode_context="actual", prefill_fill=prefill_fill)
    scenarios, _ = scenarios_for(CONFIG, LIMITS, modes, 2, kv_tokens=1 << 20)
    return {s.prompt_lens for s in scenarios if s.label.startswith("prefill")}


def test_each_bucket_is_also_timed_with_the_fewest_real_tokens_it_holds():
    assert least_fills(CONFIG) == {128: 2, 512: 129}
    bucket, actual = _prefill_prompts("bucket"), _prefill_prompts("actual")
    assert actual - bucket == {(2,), (129,)}
    # Full buckets at context 0 and chunks after it, in both modes.
    assert {(128,), (512,)} <= bucket
    assert any(p[0] > 512 for p in bucket)
