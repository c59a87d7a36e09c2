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
    level_lines,
    level_spans,
    line_shape,
    read_step_log,
)
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.step import StepKind
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
    assert first["scheduled"] == [100]  # the real tokens beside the padded
    shape = line_shape(first)
    assert (shape.prefill_tokens, shape.prefill_tokens_actual) == (128, 100)
    decode = next(line for line in lines if line["kind"] == "decode")
    record = next(r for r in records if r.kind.value == "decode")
    assert decode["rows"] == record.num_seqs_padded
    assert decode["context"] == record.context_len_padded
    assert decode["rows_actual"] == record.num_seqs == len(decode["ids"])
    # a's and b's contexts after the step, averaged.
    assert decode["context_actual"] == pytest.approx((101 + 31) / 2)
    # A byte range gives the lines within it (a level's steps).
    sizes = [0]
    for line in path.read_bytes().splitlines(keepends=True):
        sizes.append(sizes[-1] + len(line))
    assert read_step_log(path, sizes[1], sizes[3]) == lines[1:3]
    assert read_step_log(path, sizes[2]) == lines[2:]


def _log(profile, scale, overhead, n=80, decode_scale=None, decode_overhead=None):
    """A log of alternating prefill and decode steps of one request, each
    lasting its kind's ``scale`` x its profiled time + ``overhead`` (the
    decode steps' own where given)."""
    cost = ProfileCostModel(profile, interpolate=True)
    lines, t = [], 0.0
    for i in range(n):
        if i % 2:
            rows = (1, 2, 4)[i // 2 % 3]  # the profile's decode buckets
            line = {"kind": "decode", "ids": ["r"], "rows": rows, "context": 512,
                    "rows_actual": rows, "context_actual": 300.0}  # fmt: skip
            a = scale if decode_scale is None else decode_scale
            b = overhead if decode_overhead is None else decode_overhead
        else:
            line = {"kind": "prefill", "ids": ["r"], "chunks": [[128, 64 * i]]}
            a, b = scale, overhead
        lines.append({"t": t, **line})
        t += a * cost.estimate(line_shape(lines[-1])) + b
    lines.append({"t": t, "kind": "empty", "ids": ["r"]})
    return lines


def test_the_fit_recovers_each_kinds_scale_and_overhead_and_refits_its_timings():
    profile = synthetic_profile()
    calibration = fit(profile, _log(profile, 1.3, 0.002, 80, 1.1, 0.0005))
    prefill, decode = calibration.prefill_steps, calibration.decode_steps
    assert (prefill.scale, prefill.overhead_s) == pytest.approx((1.3, 0.002))
    assert (decode.scale, decode.overhead_s) == pytest.approx((1.1, 0.0005))
    assert prefill.method is decode.method is FitMethod.LINE
    assert prefill.steps == decode.steps == 40
    refitted = calibrated(profile, calibration)
    for before, after in zip(profile.timings, refitted.timings, strict=True):
        a, b = (1.3, 0.002) if before.kind is StepKind.PREFILL else (1.1, 0.0005)
        assert after.median_s == pytest.approx(a * before.median_s + b)
    assert refitted.meta["calibration"]["decode_steps"]["scale"] == pytest.approx(1.1)
    # The refitted profile serves its own log with no error left.
    again = fit(refitted, _log(profile, 1.3, 0.002, 80, 1.1, 0.0005))
    for kind in (again.prefill_steps, again.decode_steps):
        assert (kind.scale, kind.overhead_s) == pytest.approx((1.0, 0.0), abs=1e-9)


def test_what_the_simulator_charges_beside_the_profile_is_not_fitted_twice():
    profile = synthetic_profile()
    lines = _log(profile, 1.3, 0.002, 80, 1.1, 0.0005)
    # The same steps, each prefill longer by a write the simulator charges
    # on its own (a connector's): the fit less those seconds is unchanged.
    writes = [0.05 * (i % 3) if line["kind"] == "prefill" else 0.0
              for i, line in enumerate(lines)]  # fmt: skip
    slower, t = [], 0.0
    for line, following, write in zip(lines, lines[1:], writes, strict=False):
        slower.append({**line, "t": t})
        t += following["t"] - line["t"] + write
    slower.append({**lines[-1], "t": t})
    plain, less = fit(profile, lines), fit(profile, slower, besides_s=writes)
    for kind in ("prefill_steps", "decode_steps"):
        ours, theirs = getattr(less, kind), getattr(plain, kind)
        assert (ours.scale, ours.overhead_s) == pytest.approx(
            (theirs.scale, theirs.overhead_s)
        )
    assert fit(profile, slower).prefill_steps.scale != pytest.approx(1.3)


def test_a_kind_with_too_few_steps_keeps_its_profiled_times():
    profile = synthetic_profile()
    lines = _log(profile, 1.3, 0.002, n=2 * MIN_STEPS)
    # Every decode step but a few becomes a prefill step.
    decodes = [line for line in lines if line["kind"] == "decode"]
    for line in decodes[: len(decodes) - 3]:
        line.clear()
        line.update({"t": 0.0, "kind": "prefill", "ids": ["r"], "chunks": [[128, 0]]})
    t = 0.0
    cost = ProfileCostModel(profile, interpolate=True)
    for line in lines[:-1]:
        line["t"] = t
        t += 1.3 * cost.estimate(line_shape(line)) + 0.002
    lines[-1]["t"] = t
    calibration = fit(profile, lines)
    assert calibration.prefill_steps.method is FitMethod.LINE
    kept = calibration.decode_steps
    assert kept.method is FitMethod.KEPT and kept.steps == 3
    assert (kept.scale, kept.overhead_s) == (1.0, 0.0)
    refitted = calibrated(profile, calibration)
    for before, after in zip(profile.timings, refitted.timings, strict=True):
        if before.kind is StepKind.DECODE:
            assert after.samples_s == before.samples_s


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


def test_each_levels_lines_are_found_by_the_requests_it_served():
    lines = [
        {"t": 0.0, "kind": "prefill", "ids": ["a"]},
        {"t": 0.1, "kind": "decode", "ids": ["a", "b"]},
        {"t": 0.2, "kind": "empty", "ids": []},
        {"t": 9.0, "kind": "prefill", "ids": ["c"]},
        {"t": 9.1, "kind": "decode", "ids": ["c"]},
    ]  # fmt: skip
    # Level 1 sent three requests, one rejected: it never reached the log.
    assert level_spans(lines, [2, 1]) == [(0, 1), (3, 4)]
    # As validate reads them: the empty step after a level's last is its.
    assert level_lines(lines, [2, 1]) == [lines[:3], lines[3:]]
    with pytest.raises(
        CalibrationError, match=r"names 3 requests; the levels served 4 \(3, 1\)"
    ):
        level_spans(lines, [3, 1])


def test_too_few_steps_of_both_kinds_are_refused(tmp_path):
    profile = synthetic_profile()
    short = _log(profile, 1.0, 0.0, n=2 * MIN_STEPS - 2)  # MIN_STEPS - 1 a kind
    with pytest.raises(CalibrationError, match=f"a fit needs {MIN_STEPS} of a kind"):
        fit(profile, short)
    assert read_step_log(tmp_path / "missing.jsonl") == []


def test_times_that_show_no_slope_are_fitted_by_their_median_ratio():
    """Served times that do not grow with the profiled ones (here each kind
    served in one time whatever its shape; on a CI machine, noise over
    near-equal shapes) give no line to trust: each kind's fit is its median
    ratio, and says so."""
    profile = synthetic_profile()
    cost = ProfileCostModel(profile, interpolate=True)
    flat = _log(profile, 1.0, 0.0)
    t, ratios = 0.0, {"prefill": [], "decode": []}
    for line, following in zip(flat, flat[1:], strict=False):
        line["t"] = t
        seconds = 0.001 if line["kind"] == "prefill" else 0.010
        ratios[line["kind"]].append(seconds / cost.estimate(line_shape(line)))
        t += seconds
        following["t"] = t
    calibration = fit(profile, flat)
    for kind, step_fit in (("prefill", calibration.prefill_steps),
                           ("decode", calibration.decode_steps)):  # fmt: skip
        assert step_fit.method is FitMethod.RATIO
        assert step_fit.scale == pytest.approx(np.median(ratios[kind]))
        assert step_fit.overhead_s == 0.0
    # The line's slope, where it stands clear of the noise, is the fit.
    clean = fit(profile, _log(profile, 1.3, 0.002)).decode_steps
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
    for step_fit in (calibration.prefill_steps, calibration.decode_steps):
        assert step_fit.method is FitMethod.RATIO
        assert step_fit.steps == 30 and step_fit.scale > 0


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


def test_a_queued_prefill_engines_steps_are_timed_to_the_next_step():
    """Under a queue the prefill engine's steps follow each other with no
    empty step between: a step that began with requests it did not take
    ends where the next one starts; one that took every request it held
    may be followed by an arrival, an idle gap that is no step's cost."""
    lines = [
        # a and b waiting; a taken, b left: the next step follows a's.
        {"t": 0.0, "running": 0, "waiting": 2, "kind": "prefill", "ids": ["a"],
         "chunks": [[512, 0]]},
        # b alone: c arrived 4 s after b's step had ended.
        {"t": 0.5, "running": 0, "waiting": 1, "kind": "prefill", "ids": ["b"],
         "chunks": [[256, 0]]},
        {"t": 5.0, "running": 0, "waiting": 1, "kind": "prefill", "ids": ["c"],
         "chunks": [[256, 0]]},
        {"t": 5.3, "running": 0, "waiting": 0, "kind": "empty", "ids": []},
    ]  # fmt: skip
    timed = busy_steps(lines, until_empty=True)
    assert [round(seconds, 6) for _, seconds in timed] == [0.5, 0.3]
    assert [shape.prefill_chunks for shape, _ in timed] == [((512, 0),), ((256, 0),)]
    # A colocated engine's steps are timed by the requests they share only.
    assert busy_steps(lines) == []


def test_each_engine_of_a_pair_says_what_its_steps_cost_at_a_level():
    from neuron_scheduler.sim.validation_metrics import COMPARED, format_report

    fit = {"scale": 1.2, "overhead_s": 0.0, "steps": 40, "median_ratio": 1.05,
           "method": "line", "line_slope": 1.2}  # fmt: skip
    none = {**fit, "steps": 0, "median_ratio": 0.0, "method": "kept"}
    zeros = dict.fromkeys(COMPARED, 1.0)
    level = {"level": "rate 0.6", "mape": 17.0, "relative_error": zeros,
             "measured": {**zeros, "completed": 39, "failed": 1},
             "simulated": {**zeros, "completed": 39, "failed": 1},
             "own_steps": {"mape": 4.9}}  # fmt: skip

    def served_line(served):
        shown = format_report({"levels": [{**level, "served_vs_profiled": served}]})
        return next(line for line in shown.splitlines() if line.startswith("server"))

    pair = {"prefill": {"prefill_steps": fit, "decode_steps": none},
            "decode": {"prefill_steps": {**fit, "median_ratio": 0.97},
                       "decode_steps": {**fit, "steps": 2809}}}  # fmt: skip
    assert served_line(pair) == (
        "server steps, median of served / profiled: prefill engine's prefill "
        "1.050x (40 busy steps); decode engine's prefill 0.970x (40 busy steps), "
        "decode 1.050x (2809 busy steps); simulated at these steps' own costs: "
        "mape 4.9%"
    )
    pair["prefill"] = {"error": "the step log has 5 busy steps"}
    assert served_line(pair).startswith(
        "server steps, median of served / profiled: prefill engine's none fitted "
        "(the step log has 5 busy steps); decode engine's prefill 0.970x"
    )
    # One engine: both kinds, as before.
    assert served_line({"prefill_steps": none, "decode_steps": fit}) == (
        "server steps, median of served / profiled: prefill 0.000x (0 busy "
        "steps), decode 1.050x (40 busy steps); simulated at these steps' own "
        "costs: mape 4.9%"
    )


def test_the_report_names_each_fit_its_method_and_a_fit_that_failed():
    from neuron_scheduler.sim.validation_metrics import format_report

    line = {"scale": 1.25, "overhead_s": -0.004, "steps": 40, "median_ratio": 1.1,
            "method": "line", "line_slope": 1.25}  # fmt: skip
    ratio = {**line, "scale": 1.1, "overhead_s": 0.0, "method": "ratio",
             "line_slope": -0.9}  # fmt: skip
    kept = {**line, "scale": 1.0, "overhead_s": 0.0, "steps": 3, "method": "kept"}
    level = "capacity (all at once)"

    def text(calibration):
        return format_report({"levels": [], "calibration": calibration})

    shown = text({"level": level, "prefill_steps": line, "decode_steps": ratio})
    assert shown == (
        f"calibrated on {level}: prefill steps served = 1.250 x profiled + -4.00 ms "
        "(40 steps); decode steps served = 1.100 x profiled + 0.00 ms (40 steps), "
        "the median ratio: their line (slope -0.900) is lost in their noise"
    )
    assert "decode steps as profiled (3 busy steps)" in text(
        {"level": level, "prefill_steps": line, "decode_steps": kept}
    )
    # How the decode steps varied about their window's speed.
    varied = {**line, "jitter": list(np.linspace(0.5, 1.5, 101))}
    assert text({"level": level, "prefill_steps": line, "decode_steps": varied}) == (
        f"calibrated on {level}: prefill steps served = 1.250 x profiled + -4.00 ms "
        "(40 steps); decode steps served = 1.250 x profiled + -4.00 ms (40 steps), "
        "each step x 0.60-1.40 (p10-p90; p99 1.49) of its 10-s window's speed"
    )
    assert text({"level": level, "error": "the step log has 3 busy steps"}) == (
        "not calibrated: the step log has 3 busy steps"
    )
    both = {"prefill_steps": kept, "decode_steps": line}
    pair = text({"level": level, "prefill": {"error": "too few"}, "decode": both})
    assert pair.splitlines() == [
        "prefill not calibrated: too few",
        f"calibrated decode on {level}: prefill steps as profiled (3 busy steps); "
        "decode steps served = 1.250 x profiled + -4.00 ms (40 steps)",
    ]
