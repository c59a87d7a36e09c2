"""What ``neuron-scheduler profile`` plans to run, before any engine: the
prefill scenarios by bucket, fill and context, the shared contexts, and the
decode rows finishing down the batch buckets."""

from collections import Counter

import pytest

from neuron_scheduler.cli import main
from neuron_scheduler.config import EngineLimits, NeuronConfig
from neuron_scheduler.offline.profiler import (
    FEWEST_REPETITIONS,
    ProfileModes,
    decode_scenario,
    fitted_repetitions,
    least_fills,
    scenarios_for,
)

LIMITS = EngineLimits(max_num_batched_tokens=512, max_model_len=2048, max_num_seqs=4)
CONFIG = NeuronConfig.from_dict({"num_batched_tokens_buckets": [128, 512]}, LIMITS)


def _prefill_prompts(prefill_fill: str) -> set[tuple[int, ...]]:
    modes = ProfileModes(decode_context="actual", prefill_fill=prefill_fill)
    scenarios, _ = scenarios_for(CONFIG, LIMITS, modes, 2, 1 << 20, block_size=16)
    return {s.prompt_lens for s in scenarios if s.label.startswith("prefill")}


def test_each_bucket_is_also_timed_with_the_fewest_real_tokens_it_holds():
    assert least_fills(CONFIG) == {128: 2, 512: 129}
    bucket, actual = _prefill_prompts("bucket"), _prefill_prompts("actual")
    assert actual - bucket == {(2,), (129,)}
    # Full buckets at context 0 and chunks after it, in both modes.
    assert {(128,), (512,)} <= bucket
    assert any(p[0] > 512 for p in bucket)


def _steps_of(times: int) -> int:
    modes = ProfileModes(decode_context="actual", prefill_fill="actual")
    scenarios, _ = scenarios_for(CONFIG, LIMITS, modes, times, 1 << 20, block_size=16)
    return sum(s.steps(LIMITS.max_prefill_tokens) for s in scenarios)


def test_a_profile_fitted_to_a_time_times_each_shape_fewer_times():
    step_s = 0.5
    assert _steps_of(3) < _steps_of(4) < _steps_of(5)
    # Room for the whole plan: every repetition asked for.
    assert fitted_repetitions(5, _steps_of(5) * step_s, step_s, _steps_of) == 5
    # Room for four a shape, not five.
    assert fitted_repetitions(5, _steps_of(4) * step_s, step_s, _steps_of) == 4
    # No room even for three: three, the fewest, and never fewer.
    assert FEWEST_REPETITIONS == 3
    assert fitted_repetitions(5, 1.0, step_s, _steps_of) == 3
    # Asked for fewer than three: what was asked.
    assert fitted_repetitions(2, 1.0, step_s, _steps_of) == 2


@pytest.mark.parametrize("bad", ["0", "-1", "inf", "soon"])
def test_fit_seconds_must_be_a_positive_number(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--fit-seconds", bad])
    assert exit_info.value.code == 2
    assert f"must be a number of seconds > 0, got {bad!r}" in capsys.readouterr().err


def _prefills(block_size: int) -> list:
    modes = ProfileModes(decode_context="actual", prefill_fill="actual")
    scenarios, _ = scenarios_for(CONFIG, LIMITS, modes, 2, 1 << 20, block_size)
    return [s for s in scenarios if not s.label.startswith("decode")]


def test_prefill_contexts_are_one_shared_sequence_computed_once():
    chunk = LIMITS.max_prefill_tokens  # 512: contexts 0, 512, 1024, 1536
    first, *rest = _prefills(block_size=16)
    # The widest context first, computed (nothing cached yet).
    assert first.shared_tokens == 1536 and first.cached_tokens == 0
    assert first.prompt_lens == (1537,)
    after = [s for s in rest if s.shared_tokens]
    assert {s.shared_tokens for s in after} == {512, 1024, 1536}
    for s in after:
        # Found in the cache: only the bucket's own chunk runs.
        assert s.cached_tokens == s.shared_tokens
        assert s.steps(chunk) == 1
    assert all(s.cached_tokens == 0 for s in rest if s not in after)
    # Every context sample costs a step; unshared it would cost more.
    unshared = _prefills(block_size=100)  # no context is whole blocks
    assert not any(s.shared_tokens for s in unshared)
    steps = sum(s.steps(chunk) for s in rest) + first.steps(chunk)
    assert steps < sum(s.steps(chunk) for s in unshared)


def test_one_set_of_decode_rows_serves_every_batch_bucket():
    scenario = decode_scenario(1024, [1, 2, 4, 8], repetitions=5)
    assert scenario.prompt_lens == (1024 - 5 * 4 - 2,) * 8
    # Rows decode together after their prefills; count the rows alive at
    # each decode step: every bucket full for five steps, largest first.
    decodes = [tokens - 1 for tokens in scenario.max_tokens]
    alive = [
        sum(1 for d in decodes if d >= step) for step in range(1, max(decodes) + 1)
    ]
    assert alive == [8] * 5 + [4] * 5 + [2] * 5 + [1] * 5
    assert Counter(alive) == {8: 5, 4: 5, 2: 5, 1: 5}
    # The context never passes the one sampled.
    assert scenario.prompt_lens[0] + max(decodes) < 1024
    assert scenario.steps(512) == 8 * 2 + 20  # prefills, then decodes


def test_a_decode_batch_that_does_not_fit_the_cache_is_left_out():
    modes = ProfileModes(decode_context="bucket", prefill_fill="bucket")
    config = NeuronConfig.from_dict(
        {"num_seqs_buckets": [1, 4], "decode_context_length_buckets": [2048]}, LIMITS
    )
    scenarios, unreachable = scenarios_for(config, LIMITS, modes, 3, 4096, 16)
    assert unreachable == ["decode 4 rows at 2048"]
    (decode,) = [s for s in scenarios if s.label.startswith("decode")]
    assert decode.prompt_lens == (2048 - 3 - 2,)
    assert decode.max_tokens == (4,)
