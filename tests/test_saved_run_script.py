"""scripts/saved_run.py: a saved run's step log cut into its levels."""

from __future__ import annotations

from typing import Any

from helpers import load_script


def _run(levels: int) -> Any:
    """A saved run of ``levels`` levels, two step lines each, line ``i``
    marked ``{"n": i}``; nothing but the lines and spans is read."""
    saved_run = load_script("saved_run.py")
    lines = [{"n": n} for n in range(2 * levels)]
    spans = [(2 * level, 2 * level + 1) for level in range(levels)]
    return saved_run.SavedRun(None, {}, None, lines, spans)


def _numbers(lines: list[dict[str, Any]]) -> list[int]:
    return [line["n"] for line in lines]


def test_adjacent_levels_are_the_ones_served_just_before_and_after():
    run = _run(4)
    assert _numbers(run.adjacent(0)) == [2, 3]
    assert _numbers(run.adjacent(1)) == [0, 1, 4, 5]
    assert _numbers(run.adjacent(2)) == [2, 3, 6, 7]
    assert _numbers(run.adjacent(3)) == [4, 5]


def test_others_and_own_split_the_log_whole():
    run = _run(3)
    for index in range(3):
        together = sorted(_numbers(run.others(index)) + _numbers(run.own(index)))
        assert together == list(range(6))
    assert _numbers(run.own(1)) == [2, 3]


def test_an_ensemble_averages_each_compared_metric_and_keeps_the_rest():
    saved_run = load_script("saved_run.py")
    from neuron_scheduler.sim.validation_metrics import COMPARED

    runs = [
        {**{key: float(i) for key in COMPARED}, "completed": 10 + i} for i in (1, 2, 6)
    ]
    merged = saved_run.averaged(runs)
    assert all(merged[key] == 3.0 for key in COMPARED)
    assert merged["completed"] == 11  # not compared: the first run's
