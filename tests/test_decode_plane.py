"""A profile's decode shapes fitted as one plane (``sim.decode_plane``)."""

import re
from dataclasses import replace

import numpy as np
import pytest

from neuron_scheduler.offline.step_profile import Profile, StepTiming
from neuron_scheduler.sim.cost_model import StepShape
from neuron_scheduler.sim.decode_plane import (
    DecodePlane,
    DecodePlaneError,
    fit_plane,
    on_plane,
)
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.validation_metrics import format_report
from neuron_scheduler.step import StepKind

#: The engine's true decode costs: 11 ms, 0.2 ms a row, 3 us a row a token.
TRUE = DecodePlane(0.011, 0.0002, 3e-6, shapes=0, largest_move=0.0)
ROWS = (1, 2, 4, 8)
CONTEXTS = (512, 1024, 2048, 4096)
#: Each shape's burst landed at its own moment: its samples agree, but sit
#: this much off the true cost (a cycle of -20% .. +25%).
MOMENTS = (0.80, 1.25, 0.95, 1.10, 0.85, 1.20, 1.00, 0.90)
PREFILL = StepTiming(StepKind.PREFILL, 512, 0, (0.25, 0.26, 0.30))


def _profile(moments=(1.0,), decode_context="actual", rows=ROWS, contexts=CONTEXTS):
    timings = [PREFILL]
    for i, (r, c) in enumerate((r, c) for r in rows for c in contexts):
        true = TRUE.seconds(r, c)
        moment = moments[i % len(moments)]
        samples = (true * moment * 0.98, true * moment, true * moment * 1.03)
        timings.append(StepTiming(StepKind.DECODE, r, c, samples, rows=r))
    return Profile(
        platform={"name": "test"}, model={"name": "synthetic"}, engine={},
        neuron_config={}, kv_cache={"num_blocks": 512, "block_size": 16},
        timings=tuple(timings), meta={"decode_context": decode_context},
    )  # fmt: skip


def _decodes(profile):
    return [t for t in profile.timings if t.kind is StepKind.DECODE]


def test_a_profile_on_a_plane_is_found_exactly_and_kept():
    profile = _profile()
    plane = fit_plane(profile)
    assert plane.intercept_s == pytest.approx(TRUE.intercept_s)
    assert plane.per_row_s == pytest.approx(TRUE.per_row_s)
    assert plane.per_row_token_s == pytest.approx(TRUE.per_row_token_s)
    assert plane.shapes == len(ROWS) * len(CONTEXTS)
    assert plane.largest_move == pytest.approx(0.0, abs=1e-9)
    moved = on_plane(profile, plane)
    for before, after in zip(profile.timings, moved.timings, strict=True):
        assert after.samples_s == pytest.approx(before.samples_s)


def test_the_moments_of_the_bursts_are_spread_over_all_shapes():
    profile = _profile(MOMENTS)
    plane = fit_plane(profile)
    moved = on_plane(profile, plane)

    def error(timing):
        return abs(timing.median_s / TRUE.seconds(timing.rows, timing.context) - 1)

    raw = [error(t) for t in _decodes(profile)]
    fitted = [error(t) for t in _decodes(moved)]
    assert max(raw) == pytest.approx(0.25)
    assert sum(fitted) / len(fitted) < 0.5 * sum(raw) / len(raw)
    assert max(fitted) < max(raw)
    assert plane.largest_move > 0.1
    # Each shape keeps its spread (samples scaled together), the prefill
    # steps and everything else stay as measured, and the plane is recorded.
    for before, after in zip(_decodes(profile), _decodes(moved), strict=True):
        ratios = [a / b for a, b in zip(after.samples_s, before.samples_s, strict=True)]
        assert ratios == pytest.approx([ratios[0]] * 3)
        assert after.median_s == pytest.approx(plane.seconds(after.rows, after.context))
    assert moved.timings[0] == PREFILL
    assert moved.meta["decode_plane"] == plane.report()
    assert moved.meta["decode_context"] == "actual"


def test_the_cost_model_charges_dummy_rows_nothing_on_the_plane():
    # 3 real rows in a bucket of 4, at a mean context of 1500: the fixed
    # part, the bucket's rows, and the real rows' attention.
    plane = fit_plane(_profile(MOMENTS))
    cost = ProfileCostModel(on_plane(_profile(MOMENTS), plane))
    shape = StepShape(
        decode_rows=4, decode_context=2048, decode_rows_actual=3,
        decode_context_actual=1500.0,
    )  # fmt: skip
    expected = (
        plane.intercept_s + plane.per_row_s * 4 + plane.per_row_token_s * 3 * 1500
    )
    assert cost.step_time(shape) == pytest.approx(expected)


@pytest.mark.parametrize(
    "profile, named",
    [(_profile(decode_context="bucket"), "decode_context 'bucket'"),
     (_profile(rows=(4,)), "rows [4]"),
     (_profile(contexts=(1024,)), "contexts [1024]"),
     (_profile(rows=(1,), contexts=(512, 1024, 2048)), "3 decode shapes")],
)  # fmt: skip
def test_a_profile_that_is_not_a_plane_is_refused_saying_why(profile, named):
    with pytest.raises(DecodePlaneError, match=re.escape(named)):
        fit_plane(profile)


def test_a_plane_below_zero_somewhere_is_refused():
    # Longer contexts cheaper than short ones: no positive plane fits.
    profile = _profile()
    timings = [PREFILL] + [
        replace(t, samples_s=(0.05 - 1e-5 * t.context * t.rows,) * 3)
        for t in _decodes(profile)
    ]
    with pytest.raises(DecodePlaneError, match="not positive"):
        fit_plane(replace(profile, timings=tuple(timings)))


def test_no_part_of_the_plane_is_below_zero():
    # A per-row cost of 0 (a tiny model) measured a little low at 8 rows:
    # the plain fit's per-row part is negative; the plane's is 0.
    true = DecodePlane(0.011, 0.0, 3e-6, shapes=0, largest_move=0.0)
    timings = [PREFILL]
    for r in ROWS:
        for c in CONTEXTS:
            cost = true.seconds(r, c) * (0.97 if r == 8 else 1.0)
            timings.append(StepTiming(StepKind.DECODE, r, c, (cost,) * 3, rows=r))
    profile = replace(_profile(), timings=tuple(timings))
    decodes = _decodes(profile)
    design = np.array([[1.0, t.rows, t.rows * t.context] for t in decodes])
    medians = np.array([t.median_s for t in decodes])
    plain = np.linalg.lstsq(
        design / medians[:, None], np.ones(len(decodes)), rcond=None
    )
    assert plain[0][1] < 0
    plane = fit_plane(profile)
    assert plane.per_row_s == 0.0
    assert plane.intercept_s > 0 and plane.per_row_token_s > 0
    assert plane.intercept_s == pytest.approx(true.intercept_s, rel=0.05)
    assert plane.per_row_token_s == pytest.approx(true.per_row_token_s, rel=0.05)
    assert plane.largest_move < 0.05


def test_the_report_says_the_plane_or_why_the_shapes_were_kept():
    plane = fit_plane(_profile(MOMENTS))
    lines = format_report({"levels": [], "decode_plane": plane.report()})
    assert lines.startswith(
        f"decode shapes on one plane: {plane.intercept_s * 1e3:.2f} ms + "
        f"{plane.per_row_s * 1e3:.3f} ms a row + "
        f"{plane.per_row_token_s * 1e6:.3f} us a row per token of context "
        f"(16 shapes; the largest move {100 * plane.largest_move:.0f}%)"
    )
    kept = {"kept_as_measured": "3 decode shapes (rows [1], contexts [...])"}
    assert format_report({"levels": [], "decode_plane": kept}) == (
        "decode shapes kept as measured: 3 decode shapes (rows [1], contexts [...])"
    )
