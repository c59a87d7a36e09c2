"""scripts/arrival-cost.py counts the arrivals during each logged step."""

from __future__ import annotations

import numpy as np
import pytest

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


class _FlatCost:
    """Every step profiled at 10 ms."""

    def estimate(self, shape):
        return 0.010


def _decode(t, ids):
    line = _line(t, ids, len(ids), 0)
    line.update(rows=2, context=64, rows_actual=len(ids), context_actual=32.0)
    return line


def _prefill(t, ids):
    line = _line(t, ids, len(ids), 0, kind="prefill")
    line.update(chunks=[[128, 0]], scheduled=[100])
    return line


def test_decode_steps_are_grouped_by_the_step_before_them():
    lines = [
        _prefill(0.0, ["a"]),
        _decode(0.1, ["a"]),  # after a prefill, 12 ms
        _decode(0.112, ["a"]),  # after a decode, 10 ms
        _decode(0.122, ["a"]),  # after a decode, 10 ms
        _decode(0.132, ["a"]),  # the last step: no end, left out
    ]
    after = _script()._decode_after(_FlatCost(), lines)
    assert after["prefill"][:, 1] == pytest.approx([0.012])
    assert after["decode"][:, 1] == pytest.approx([0.010, 0.010])


def test_the_after_prefill_line_prices_the_excess_over_the_decode_ratio():
    after = {
        "prefill": np.array([[0.010, 0.012]]),
        "decode": np.array([[0.010, 0.010], [0.010, 0.010], [0.010, 0.010]]),
    }
    line = _script().after_prefill_line(after)
    # 1.2 against 1.0: +20%; 2 ms beyond the ratio of 42 ms served.
    assert "1.200 against 1.000 after a decode (+20.0%)" in line
    assert f"{0.002 / 0.042:+.2%} of the decode steps' served time" in line
    assert "1 (25.0%)" in line


def test_no_after_prefill_line_without_both_kinds():
    empty = np.zeros((0, 2))
    assert _script().after_prefill_line({"prefill": empty, "decode": empty}) is None
