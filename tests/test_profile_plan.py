"""What ``neuron-scheduler profile`` plans to run, before any engine: the
prefill scenarios by bucket, fill and context."""

import pytest

from neuron_scheduler.cli import main
from neuron_scheduler.config import EngineLimits, NeuronConfig
from neuron_scheduler.offline.profiler import (
    FEWEST_REPETITIONS,
    ProfileModes,
    fitted_repetitions,
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


def _steps_of(times: int) -> int:
    modes = ProfileModes(decode_context="actual", prefill_fill="actual")
    scenarios, _ = scenarios_for(CONFIG, LIMITS, modes, times, kv_tokens=1 << 20)
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
