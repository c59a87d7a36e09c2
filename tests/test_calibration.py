"""The scheduler's step log and a profile refitted to it."""

import pytest

from helpers import neuron_engine, prompt
from neuron_scheduler.sim.calibration import (
    MIN_STEPS,
    CalibrationError,
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


def test_too_few_steps_or_times_that_do_not_grow_are_refused(tmp_path):
    profile = synthetic_profile()
    short = _log(profile, 1.0, 0.0, n=MIN_STEPS - 2)
    with pytest.raises(CalibrationError, match=f"a fit needs {MIN_STEPS}"):
        fit(profile, short)
    # Prefills (the profile's dearer steps) served in 1 ms, decodes in 10 ms.
    inverted = _log(profile, 1.0, 0.0)
    t = 0.0
    for line in inverted:
        line["t"] = t
        t += 0.001 if line["kind"] == "prefill" else 0.010
    with pytest.raises(CalibrationError, match="do not grow"):
        fit(profile, inverted)
    assert read_step_log(tmp_path / "missing.jsonl") == []


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
