"""scripts/server-aging.py: a probe's decode median and the trend of probes."""

from __future__ import annotations

import pytest

from helpers import load_script


def _script():
    return load_script("server-aging.py")


def _step(t, kind="decode", rows=5):
    line = {"t": t, "kind": kind, "ids": ["a"]}
    if kind == "decode":
        line["rows_actual"] = rows
    return line


def test_the_probe_median_counts_full_decode_steps_only():
    lines = [
        _step(0.0, "prefill"),
        _step(0.4),  # 20 ms
        _step(0.42),  # 30 ms
        _step(0.45, rows=3),  # 500 ms, but not a full step
        _step(0.95),  # idle after: 5 s to the next line
        _step(5.95),  # the last line has no end
    ]
    assert _script().probe_decode_ms(lines, 5) == pytest.approx((25.0, 2))


def test_a_probe_without_full_steps_is_an_error_naming_the_rows():
    with pytest.raises(ValueError, match="5 real rows"):
        _script().probe_decode_ms([_step(0.0, rows=3), _step(0.02, rows=3)], 5)


def test_the_trend_is_the_slope_over_the_mean():
    trend = _script().trend_per_minute([(0.0, 20.0), (1.0, 21.0), (2.0, 22.0)])
    assert trend == pytest.approx(1.0 / 21.0)
    assert _script().trend_per_minute([(0.0, 20.0), (5.0, 20.0)]) == 0.0


def test_a_trend_needs_two_times():
    with pytest.raises(ValueError, match="two times"):
        _script().trend_per_minute([(1.0, 20.0), (1.0, 21.0)])


@pytest.mark.parametrize("flag", ["--minutes", "--restart-probes", "--probe-requests"])
def test_a_count_below_one_is_refused_by_name(flag, capsys):
    with pytest.raises(SystemExit) as stopped:
        _script().main([flag, "0"])
    assert stopped.value.code == 2
    assert flag in capsys.readouterr().err
