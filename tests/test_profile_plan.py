"""What ``neuron-scheduler profile`` plans to run, before any engine: the
prefill scenarios by bucket, fill and context, in rounds, the shared
contexts, the decode rows finishing down the batch buckets, and the drift
reference between blocks."""

from collections import Counter

import pytest

from neuron_scheduler.cli import main
from neuron_scheduler.config import EngineLimits, NeuronConfig
from neuron_scheduler.offline.profiler import (
    FEWEST_REPETITIONS,
    REFERENCE_DECODES,
    ProfileModes,
    decode_scenario,
    fitted_repetitions,
    least_fills,
    plan_profile,
)

LIMITS = EngineLimits(max_num_batched_tokens=512, max_model_len=2048, max_num_seqs=4)
CONFIG = NeuronConfig.from_dict({"num_batched_tokens_buckets": [128, 512]}, LIMITS)


def _prefill_prompts(prefill_fill: str) -> set[tuple[int, ...]]:
    modes = ProfileModes(decode_context="actual", prefill_fill=prefill_fill)
    plan = plan_profile(CONFIG, LIMITS, modes, 2, 1 << 20, block_size=16)
    return {s.prompt_lens for s in plan.prefill}


def test_each_bucket_is_also_timed_with_the_fewest_real_tokens_it_holds():
    assert least_fills(CONFIG) == {128: 2, 512: 129}
    bucket, actual = _prefill_prompts("bucket"), _prefill_prompts("actual")
    assert actual - bucket == {(2,), (129,)}
    # Full buckets at context 0 and chunks after it, in both modes.
    assert {(128,), (512,)} <= bucket
    assert any(p[0] > 512 for p in bucket)


def _steps_of(times: int) -> int:
    modes = ProfileModes(decode_context="actual", prefill_fill="actual")
    plan = plan_profile(CONFIG, LIMITS, modes, times, 1 << 20, block_size=16)
    return plan.steps(LIMITS.max_prefill_tokens)


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
    plan = plan_profile(CONFIG, LIMITS, modes, 2, 1 << 20, block_size)
    return [plan.shared, *plan.prefill] if plan.shared else list(plan.prefill)


def test_prefill_contexts_are_one_shared_sequence_computed_once():
    chunk = LIMITS.max_prefill_tokens  # 512: contexts 0, 512, 1024, 1536
    first, *rest = _prefills(block_size=16)
    # The widest context first, computed (nothing cached yet).
    assert first.label.startswith("shared context")
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
    plan = plan_profile(config, LIMITS, modes, 3, 4096, 16)
    assert plan.unreachable == ("decode 4 rows at 2048",)
    (decode,) = plan.decode
    assert decode.prompt_lens == (2048 - 3 - 2,)
    assert decode.max_tokens == (4,)


def test_prefill_shapes_run_in_rounds_and_the_reference_after_every_block():
    modes = ProfileModes(decode_context="actual", prefill_fill="actual")
    plan = plan_profile(CONFIG, LIMITS, modes, 3, 1 << 20, block_size=16)
    order = plan.scenarios()
    reference = plan.reference
    # Three rounds of prefill shapes, then a block per decode context
    # (128, 256, 512, 1024, 2048 for max_model_len 2048): each followed by
    # the reference, which is the only scenario that repeats back to back.
    blocks = plan.blocks()
    assert len(blocks) == 3 + 5
    assert [s for s in order if s is not reference] == [
        s for block in blocks for s in block
    ]
    ends = [i for i, s in enumerate(order) if s is reference]
    assert len(ends) == len(blocks) and ends[-1] == len(order) - 1
    starts = [0] + [i + 1 for i in ends[:-1]]
    assert [ends[k] - starts[k] for k in range(len(blocks))] == [len(b) for b in blocks]
    # Each prefill shape once a round: its three samples lie a round apart,
    # so that a slow moment cannot fall on all of them.
    labels = [s.label for s in order]
    for shape in plan.prefill:
        at = [i for i, label in enumerate(labels) if label == shape.label]
        assert len(at) == 3
        gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
        assert min(gaps) >= len(plan.prefill)
    # The shared context is computed once, before its first use.
    assert labels.count(plan.shared.label) == 1 and labels[0] == plan.shared.label
    # The reference: one short prompt, then its decode steps (the first
    # is left out of its time); it counts in the plan's steps.
    assert reference.max_tokens == (1 + REFERENCE_DECODES,)
    assert reference.steps(LIMITS.max_prefill_tokens) == 1 + REFERENCE_DECODES
    without = sum(s.steps(LIMITS.max_prefill_tokens) for block in blocks for s in block)
    assert plan.steps(LIMITS.max_prefill_tokens) == without + len(blocks) * (
        1 + REFERENCE_DECODES
    )
