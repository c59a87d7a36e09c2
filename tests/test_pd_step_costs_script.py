"""scripts/pd-step-costs.py: a pair's decode steps against their charge,
with the prefill engine computing or not."""

from __future__ import annotations

import json

import pytest

from helpers import load_script
from test_cost_profile import synthetic_profile


def _script():
    return load_script("pd-step-costs.py")


def test_the_share_of_a_step_the_prefill_engine_computed():
    script = _script()
    prefill = [
        {"t": 0.0, "kind": "prefill", "ids": ["a"]},
        {"t": 1.0, "kind": "empty", "ids": []},
        {"t": 3.0, "kind": "prefill", "ids": ["b"]},
        {"t": 4.0, "kind": "prefill", "ids": ["c"]},
        {"t": 4.5, "kind": "empty", "ids": []},
    ]
    intervals = script.prefill_intervals(prefill)
    assert intervals == [(0.0, 1.0), (3.0, 4.0), (4.0, 4.5)]
    assert script.computed_share(intervals, 0.5, 1.5) == pytest.approx(0.5)
    assert script.computed_share(intervals, 1.0, 3.0) == 0.0
    assert script.computed_share(intervals, 3.5, 4.5) == pytest.approx(1.0)
    assert script.computed_share(intervals, 4.4, 5.4) == pytest.approx(0.1)


def _decode(t, rows, ids):
    return {"t": t, "kind": "decode", "ids": ids, "rows": rows, "context": 512,
            "rows_actual": rows, "context_actual": 512.0}  # fmt: skip


def test_a_level_splits_its_decode_steps_by_the_prefill_engines_work(tmp_path):
    """Two levels of one request each: the first's steps at the profile's
    cost, the second's twice it while the prefill engine computes."""
    profile = synthetic_profile()
    profile.save(tmp_path / "pd-decode-calibrated.json")
    # DECODE_S (test_cost_profile): 1 row at context 512 costs 2 ms.
    first = [_decode(i * 0.002, 1, ["a"]) for i in range(5)]
    second = [_decode(10 + i * 0.004, 1, ["b"]) for i in range(5)]
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "steps-decode-0.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in first + second)
    )
    prefill = [{"t": 9.9, "kind": "prefill", "ids": ["b"]},
               {"t": 11.0, "kind": "empty", "ids": []}]  # fmt: skip
    (logs / "steps-prefill-0.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in prefill)
    )
    levels = [
        {"level": label, "measured": {"completed": 1}} for label in ("one", "two")
    ]
    (tmp_path / "report.json").write_text(json.dumps({"levels": levels}))
    (one, quiet), (two, loud) = _script().run_rows(tmp_path)
    assert (one, two) == ("one", "two")
    # Each level's last step has no next one: four busy steps a level.
    assert quiet["steps"] == loud["steps"] == 4
    assert quiet["mean"] == pytest.approx(1.0)
    assert quiet["by_prefill"] == {"idle": (4, pytest.approx(1.0))}
    assert loud["by_rows"] == {1: (4, pytest.approx(2.0))}
    assert loud["by_prefill"] == {"busy": (4, pytest.approx(2.0))}


def test_a_buckets_dummy_rows_are_charged_with_and_without_their_discount(
    tmp_path,
):
    """A 4-row step with 2 real rows, served at the full bucket's cost: 1.0
    without the dummy rows' discount; with it, the bucket less 2 rows'
    attention (the profile's slope over context, a row) at its context."""
    from neuron_scheduler.offline.step_profile import Profile, StepTiming
    from neuron_scheduler.step import StepKind

    base = synthetic_profile()
    timings = [t for t in base.timings if t.kind is StepKind.PREFILL] + [
        StepTiming(StepKind.DECODE, 4, context, (seconds,), rows=4)
        for context, seconds in ((128, 0.003), (512, 0.005))
    ]
    Profile(
        base.platform, base.model, base.engine, base.neuron_config, base.kv_cache,
        tuple(timings), meta={"decode_context": "actual"},
    ).save(tmp_path / "pd-decode.json")  # fmt: skip
    logs = tmp_path / "logs"
    logs.mkdir()
    steps = [
        {"t": i * 0.005, "kind": "decode", "ids": ["a", "b"], "rows": 4,
         "context": 512, "rows_actual": 2, "context_actual": 512.0}
        for i in range(3)
    ]  # fmt: skip
    (logs / "steps-decode-0.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in steps)
    )
    ((key, (count, with_discount, without)),) = _script().dummy_rows(tmp_path).items()
    assert key == (4, 2) and count == 2
    assert without == pytest.approx(1.0)
    # 2 dummy rows x (2 ms / 384 positions / 4 rows) x 512 positions.
    assert with_discount == pytest.approx(0.005 / (0.005 - 2 * 0.002 / 384 / 4 * 512))
    # A colocated run's files give the same.
    (tmp_path / "pd-decode.json").rename(tmp_path / "profile.json")
    (logs / "steps-decode-0.jsonl").rename(logs / "steps-server.jsonl")
    assert _script().dummy_rows(tmp_path) == {key: (count, with_discount, without)}
