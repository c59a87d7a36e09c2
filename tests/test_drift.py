"""The profile's drift correction: the reference's speed interpolated between
the moments it was timed, samples scaled to its median speed, the times as
measured kept through the profile's JSON, and references that cannot
describe a run refused."""

import json

import pytest

from neuron_scheduler.offline.drift import DriftError, DriftReference
from neuron_scheduler.offline.profiler import StepSamples
from neuron_scheduler.offline.step_profile import Profile, ProfileFormatError
from neuron_scheduler.step import StepKind

# The machine ran the reference at 10 ms, then 12 ms (slow), then 10 ms
# (one step each: no jitter of its own to discount).
DRIFT = DriftReference(
    "ref", at=(10.0, 20.0, 30.0), samples=((0.010,), (0.012,), (0.010,))
)


def test_the_reference_is_interpolated_between_the_moments_it_was_timed():
    assert DRIFT.typical_s == pytest.approx(0.010)
    assert DRIFT.speed_at(15.0) == pytest.approx(0.011)
    assert DRIFT.speed_at(20.0) == pytest.approx(0.012)
    # Before the first and after the last: the nearest.
    assert DRIFT.speed_at(0.0) == pytest.approx(0.010)
    assert DRIFT.speed_at(99.0) == pytest.approx(0.010)
    # A sample taken in the slow moment is scaled down, by as much.
    assert DRIFT.factor(20.0) == pytest.approx(10 / 12)
    assert DRIFT.factor(25.0) == pytest.approx(10 / 11)
    assert DRIFT.spread() == pytest.approx((1.2, 1.0))
    assert DRIFT.weight == 1.0


def test_only_the_movement_the_references_jitter_does_not_explain_is_applied():
    # Each moment's steps jitter by +-10%; their medians move by far less
    # than a median of three such steps jitters: nothing is the machine's.
    jittery = ((0.009, 0.010, 0.011), (0.011, 0.0101, 0.009), (0.010, 0.011, 0.009))
    still = DriftReference("ref", (1.0, 2.0, 3.0), jittery)
    assert still.weight == 0.0
    assert still.factor(2.0) == 1.0
    # The same jitter at moments 30% apart: most of the movement is the
    # machine's, and most of it is corrected.
    moved = DriftReference(
        "ref", (1.0, 2.0, 3.0), (jittery[0], tuple(1.3 * s for s in jittery[1]),
                                 jittery[2])
    )  # fmt: skip
    assert 0.7 < moved.weight < 1.0
    slow = moved.factor(2.0)
    assert 1 / 1.3 < slow < 1 / 1.2
    assert moved.to_json()["weight"] == pytest.approx(moved.weight, abs=1e-4)


def _profile(timings, meta=None) -> Profile:
    """A profile of ``timings`` and nothing else said."""
    kv_cache = {"num_blocks": 4, "block_size": 16}
    return Profile({}, {}, {}, {}, kv_cache, timings, meta=meta or {})


def test_samples_are_scaled_to_the_typical_speed_and_kept_as_measured(tmp_path):
    samples = StepSamples()
    decode = (StepKind.DECODE, 4, 1024, 0)
    prefill = (StepKind.PREFILL, 512, 0, 300)
    # The same step, 24 ms in the slow moment and 20 ms in the fast ones.
    samples.add(decode, 0.024, 20.0)
    samples.add(decode, 0.020, 30.0)
    samples.add(prefill, 0.110, 15.0)
    timings = {(t.kind, t.tokens): t for t in samples.timings(DRIFT)}
    corrected = timings[(StepKind.DECODE, 4)]
    assert corrected.samples_s == pytest.approx((0.020, 0.020))
    assert corrected.measured_s == (0.024, 0.020)
    assert timings[(StepKind.PREFILL, 512)].samples_s == pytest.approx((0.100,))
    # Without a reference: as measured, and nothing kept twice.
    (plain, _) = samples.timings()
    assert plain.samples_s == (0.024, 0.020) and plain.measured_s == ()

    profile = _profile(samples.timings(DRIFT), meta={"drift": DRIFT.to_json()})
    path = tmp_path / "profile.json"
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded.timings == profile.timings
    assert loaded.meta["drift"]["slowest_x"] == pytest.approx(1.2)


def test_a_profile_whose_measured_times_do_not_match_its_samples_is_refused(
    tmp_path,
):
    profile = _profile(StepSamples().timings())
    document = profile.to_json()
    document["timings"] = [
        {"kind": "decode", "tokens": 2, "rows": 2, "context": 128,
         "samples_s": [0.01, 0.02], "measured_s": [0.01]}
    ]  # fmt: skip
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ProfileFormatError, match="2 samples and 1 measured"):
        Profile.load(path)


@pytest.mark.parametrize(
    ("at", "samples", "message"),
    [
        ((), (), "0 moments and 0 timings"),
        ((1.0, 2.0), ((0.01,),), "2 moments and 1 timings"),
        ((2.0, 1.0), ((0.01,), (0.01,)), "not increasing"),
        ((1.0,), ((0.01, 0.0),), "a time <= 0"),
        ((1.0,), ((),), "a moment with no step"),
    ],
)
def test_references_that_cannot_describe_a_run_are_refused(at, samples, message):
    with pytest.raises(DriftError, match=message):
        DriftReference("ref", at, samples)
