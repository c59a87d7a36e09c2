"""scripts/arrival-cost.py counts the arrivals during each logged step."""

from __future__ import annotations

from helpers import load_script


def _script():
    return load_script("arrival-cost.py")


def _line(t, ids, running, waiting, kind="decode"):
    return {"t": t, "ids": ids, "running": running, "waiting": waiting, "kind": kind}


def test_an_arrival_is_counted_in_the_step_it_lands_in():
    lines = [
        _line(0.0, ["a", "b"], 2, 0),
        # "c" arrived during the first step, "b" finished in it: 2 -> 2.
        _line(0.1, ["a"], 1, 1),
        _line(0.2, ["c"], 2, 0, kind="prefill"),
        _line(0.3, ["a", "c"], 2, 0),
    ]
    assert _script()._arrivals(lines) == [1, 0, 0, 0]


def test_two_arrivals_and_no_finish():
    lines = [_line(0.0, ["a"], 1, 0), _line(0.1, ["a"], 1, 2), _line(0.2, ["a"], 1, 2)]
    assert _script()._arrivals(lines) == [2, 0, 0]
