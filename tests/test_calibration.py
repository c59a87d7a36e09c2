"""The scheduler's step log and a profile refitted to it."""

import numpy as np
import pytest

from helpers import neuron_engine, prompt
from neuron_scheduler.sim.calibration import (
    MIN_STEPS,
    CalibrationError,
    FitMethod,
    busy_steps,
    calibrated,
    fit,
    line_shape,
    read_step_log,
)
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.step_log import STEP_LOG_ENV
from test_cost_profile import synthetic_profile


@pytest.mark.matrix
def test_the_scheduler_logs_each_steps_start_and_padded_shape(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(STEP_LOG_ENV, str(path))
    engine = neuron_engine(
        max_model_len=512, max_num_batched_tokens=256, max_num_seqs=4
    )
    engine.add("a", prompt(100, 1), max_tokens=4)
    engine.add("b", prompt(30, 2), max_tokens=4)
    records = []
    while engine.has_work():
        output, _ = engine.step()
        if output is not None:
            records.append(engine.scheduler.last_step)
    engine.scheduler.shutdown()
    lines = read_step_log(path)
    assert [line["kind"] for line in lines] == [r.kind.value for r in records]
    assert all(b["t"] >= a["t"] for a, b in zip(lines, lines[1:], strict=False))
    first = lines[0]
    assert first["kind"] == "prefill" and first["ids"] == ["a"]
    assert (first["running"], first["waiting"]) == (0, 2)
    assert first["chunks"] == [[128, 0]]  # 100 tokens padded to 128, from 0
    decode = next(line for line in lines if line["kind"] == "decode")
    record = next(r for r in records if r.kind.value == "decode")
    assert decode["rows"] == record.num_seqs_padded
    assert decode["context"] == record.context_len_padded
    assert decode["rows_actual"] == record.num_seqs == len(decode["ids"])
    # a's and b's contexts after the step, averaged.
    assert decode["context_actual"] == pytest.approx((101 + 31) / 2)


def _log(profile, scale, overhead, n=40):
    """A log of alternating prefill and decode steps of one request, each
    lasting ``scale`` x its profiled time + ``overhead``."""
    cost = ProfileCostModel(profile, interpolate=True)
    lines, t = [], 0.0
    for i in range(n):
        if i % 2:
            line = {"kind": "decode", "ids": ["r"], "rows": 2, "context": 512,
                    "rows_actual": 1, "context_actual": 300.0}  # fmt: skip
        else:
            line = {"kind": "prefill", "ids": ["r"], "chunks": [[128, 64 * i]]}
        lines.append({"t": t, **line})
        t += scale * cost.estimate(line_shape(lines[-1])) + overhead
    lines.append({"t": t, "kind": "empty", "ids": ["r"]})
    return lines


def test_the_fit_recovers_scale_and_overhead_and_refits_every_timing():
    profile = synthetic_profile()
    calibration = fit(profile, _log(profile, 1.3, 0.002))
    assert calibration.scale == pytest.approx(1.3, rel=1e-6)
    assert calibration.overhead_s == pytest.approx(0.002, abs=1e-9)
    assert calibration.steps == 40
    refitted = calibrated(profile, calibration)
    for before, after in zip(profile.timings, refitted.timings, strict=True):
        assert after.median_s == pytest.approx(1.3 * before.median_s + 0.002)
    assert refitted.meta["calibration"]["scale"] == pytest.approx(1.3)
    # The refitted profile serves its own log with no error left.
    again = fit(refitted, _log(profile, 1.3, 0.002))
    assert again.scale == pytest.approx(1.0, rel=1e-6)
    assert again.overhead_s == pytest.approx(0.0, abs=1e-9)


def test_steps_after_an_idle_gap_are_not_counted():
    lines = [
        {"t": 0.0, "kind": "decode", "ids": ["a"], "rows": 1, "context": 512,
         "rows_actual": 1, "context_actual": 10.0},
        {"t": 0.01, "kind": "decode", "ids": ["a"], "rows": 1, "context": 512,
         "rows_actual": 1, "context_actual": 11.0},
        # a finished; b arrived 5 s later: the gap is idle, not a step.
        {"t": 5.0, "kind": "prefill", "ids": ["b"], "chunks": [[128, 0]]},
    ]  # fmt: skip
    steps = busy_steps(lines)
    assert [seconds for _, seconds in steps] == [pytest.approx(0.01)]


def test_too_few_steps_are_refused(tmp_path):
    profile = synthetic_profile()
    short = _log(profile, 1.0, 0.0, n=MIN_STEPS - 2)
    with pytest.raises(CalibrationError, match=f"a fit needs {MIN_STEPS}"):
        fit(profile, short)
    assert read_step_log(tmp_path / "missing.jsonl") == []


def test_times_that_show_no_slope_are_fitted_by_their_median_ratio():
    """Served times that do not grow with the profiled ones (here prefills,
    the profile's dearer steps, served in 1 ms and decodes in 10 ms; on a
    CI machine, noise over near-equal shapes) give no line to trust: the
    fit is the median ratio, and says so."""
    profile = synthetic_profile()
    cost = ProfileCostModel(profile, interpolate=True)
    inverted = _log(profile, 1.0, 0.0)
    t, ratios = 0.0, []
    for line, following in zip(inverted, inverted[1:], strict=False):
        line["t"] = t
        seconds = 0.001 if line["kind"] == "prefill" else 0.010
        ratios.append(seconds / cost.estimate(line_shape(line)))
        t += seconds
        following["t"] = t
    calibration = fit(profile, inverted)
    assert calibration.method is FitMethod.RATIO and calibration.line_slope < 0
    assert calibration.scale == pytest.approx(np.median(ratios))
    assert calibration.overhead_s == 0.0
    # The line's slope, where it stands clear of the noise, is the fit.
    clean = fit(profile, _log(profile, 1.3, 0.002))
    assert clean.method is FitMethod.LINE and clean.scale == clean.line_slope


def test_noise_over_a_narrow_spread_of_shapes_falls_back_to_the_ratio():
    profile = synthetic_profile()
    rng = np.random.default_rng(0)
    lines = _log(profile, 1.0, 0.0, n=60)
    # Served times 2x the profile's mean, +-30% noise: the profile's spread
    # is buried, so a line's slope is no better than chance.
    cost = ProfileCostModel(profile, interpolate=True)
    mean = np.mean([cost.estimate(line_shape(x)) for x in lines[:-1]])
    t = 0.0
    for line in lines:
        line["t"] = t
        t += 2 * mean * (1 + 0.3 * rng.uniform(-1, 1))
    calibration = fit(profile, lines)
    assert calibration.method is FitMethod.RATIO
    assert calibration.steps == 60 and calibration.scale > 0


def test_a_prefill_engine_step_is_timed_to_the_empty_step_after_it():
    """A disaggregated prefill engine's requests end in their one step; the
    engine core schedules again (nothing) once the step's output is in."""
    from neuron_scheduler.sim.calibration import busy_steps

    lines = [
        {"t": 10.0, "kind": "prefill", "ids": ["a"], "chunks": [[256, 0]]},
        {"t": 10.2, "kind": "empty", "ids": []},
        {"t": 15.0, "kind": "prefill", "ids": ["b"], "chunks": [[512, 0]]},
        {"t": 15.5, "kind": "prefill", "ids": ["c"], "chunks": [[256, 0]]},
        {"t": 15.7, "kind": "empty", "ids": []},
    ]
    assert busy_steps(lines) == []
    timed = busy_steps(lines, until_empty=True)
    assert [round(seconds, 6) for _, seconds in timed] == [0.2, 0.2]
    assert [shape.prefill_chunks for shape, _ in timed] == [((256, 0),), ((256, 0),)]


def test_the_report_names_each_fit_its_method_and_a_fit_that_failed():
    from neuron_scheduler.sim.validation_metrics import format_report

    line = {"scale": 1.25, "overhead_s": -0.004, "steps": 40, "median_ratio": 1.1,
            "method": "line", "line_slope": 1.25}  # fmt: skip
    ratio = {**line, "scale": 1.1, "overhead_s": 0.0, "method": "ratio",
             "line_slope": -0.9}  # fmt: skip
    level = "capacity (all at once)"

    def text(calibration):
        return format_report({"levels": [], "calibration": calibration})

    assert f"calibrated on {level}: served = 1.250 x profiled + -4.00 ms" in text(
        {"level": level, **line}
    )
    shown = text({"level": level, **ratio})
    assert "served = 1.100 x profiled + 0.00 ms (40 steps)" in shown
    assert "the median ratio" in shown and "slope -0.900" in shown
    assert text({"level": level, "error": "the step log has 3 busy steps"}) == (
        "not calibrated: the step log has 3 busy steps"
    )
    pair = text({"level": level, "prefill": {"error": "too few"}, "decode": line})
    assert pair.splitlines() == [
        "prefill not calibrated: too few",
        f"calibrated decode on {level}: served = 1.250 x profiled + -4.00 ms (40 steps)",
    ]
