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
