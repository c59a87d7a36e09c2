"""scripts/server-probe.py: a probe's decode median, the probes' trend, the
summaries, the neighbour process and bad arguments (no server started)."""

from __future__ import annotations

import os
import time

import pytest

from helpers import load_script
from neuron_scheduler.offline.cpu_binding import process_tree


def _script():
    return load_script("server-probe.py")


def _step(t, kind="decode", rows=5, ids=("a",)):
    """A step-log line as the server writes it."""
    line = {"t": t, "kind": kind, "ids": list(ids)}
    if kind == "decode":
        line.update(rows=8, context=1024, context_actual=700, rows_actual=rows)
    else:
        line.update(chunks=[[640, 0]], scheduled=[600])
    return line


def test_the_probe_median_counts_full_decode_steps_only():
    lines = [
        _step(0.0, "prefill"),
        _step(0.4),  # 20 ms
        _step(0.42),  # 30 ms
        _step(0.45, rows=3),  # 500 ms, but not a full step
        _step(0.95),  # its requests end: the next step is the next probe's
        _step(5.95, ids=("b",)),  # the last line has no end
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


def test_the_aging_summary_compares_the_ends_and_the_restart():
    first = [(0.0, 20.0), (1.0, 20.0), (2.0, 22.0), (3.0, 22.0)]
    line = _script().aging_summary(first, [20.0, 20.0])
    assert "4 probes over 3.0 min" in line
    assert "first two 20.00 ms, last two 22.00 ms (+10.0%)" in line
    assert "restarted 20.00 ms (-9.1% of the last two)" in line


def test_the_neighbour_summary_is_against_idle():
    line = _script().neighbour_summary(
        {"idle": [20.0, 22.0], "python": [21.0, 21.0], "memory": [23.1, 23.1]}
    )
    assert (
        line
        == "idle 21.00 ms (+0.0%); python 21.00 ms (+0.0%); memory 23.10 ms (+10.0%)"
    )


def _children() -> set[int]:
    """The processes under this one (``cpu_binding.process_tree``)."""
    return set(process_tree(os.getpid())) - {os.getpid()}


def test_a_neighbour_runs_on_the_cores_given_and_is_gone_after():
    script = _script()
    cores = frozenset(os.sched_getaffinity(0))
    before = _children()
    with script.neighbour_running("python", cores):
        started = _children() - before
        assert len(started) == 1
        (pid,) = started
        assert os.sched_getaffinity(pid) == cores
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19
    time.sleep(0.1)
    assert not (_children() - before)


def test_an_idle_neighbour_starts_nothing():
    before = _children()
    with _script().neighbour_running("idle", frozenset({0})):
        assert not (_children() - before)


@pytest.mark.parametrize(
    "argv",
    [
        ["aging", "--minutes", "0"],
        ["aging", "--restart-probes", "0"],
        ["neighbour", "--rounds", "0"],
        ["neighbour", "--probe-requests", "0"],
    ],
)
def test_a_count_below_one_is_refused_by_name(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        _script().main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert argv[1] in err and "got 0" in err


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as stopped:
        _script().main([])
    assert stopped.value.code == 2
