"""What a disaggregated pair's decode steps cost, level by level, and
whether the prefill engine was computing meanwhile.

``validate --disaggregated`` refits each role's profile on its calibration
run and prints, per level, each engine's median served / profiled and the
level simulated at its own steps' costs. This goes one step further on a
saved run: for each level, the decode engine's busy decode steps against
the refitted decode profile (the mean of served / charged, and the median
per rows bucket), apart for the steps during which the prefill engine ran a
step for more than half the decode step (``busy``) and those it did not
(``idle``): the two engines run on cores of their own but share the
machine's caches and memory, which the simulator does not charge. Last,
over the whole run, the median of served / charged by the profile as
measured for each bucket and real rows, with the dummy rows' attention
taken off as the cost model does and without (all rows charged as real).

Usage: .venv/bin/python scripts/pd-step-costs.py RUN_DIR [RUN_DIR ...]
  each RUN_DIR what ``--save-profile RUN_DIR/pd.json --json
  RUN_DIR/report.json --log-dir RUN_DIR/logs`` kept; a colocated run's
  (``--save-profile RUN_DIR/profile.json``) gives the last part alone
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.calibration import busy_lines, level_lines, read_step_log
from neuron_scheduler.sim.profile_cost import ProfileCostModel

Lines = Sequence[dict[str, Any]]

#: A decode step is ``busy`` when the prefill engine computed for more than
#: this share of it.
BUSY_SHARE = 0.5


def prefill_intervals(prefill_lines: Lines) -> list[tuple[float, float]]:
    """The prefill engine's steps as (start, end): each prefill step to the
    next line's start."""
    return [
        (line["t"], following["t"])
        for line, following in zip(prefill_lines, prefill_lines[1:], strict=False)
        if line["kind"] == "prefill"
    ]


def computed_share(
    intervals: Sequence[tuple[float, float]], start: float, end: float
) -> float:
    """The share of [start, end) covered by ``intervals`` (sorted, apart)."""
    if end <= start:
        return 0.0
    first = max(0, bisect.bisect_right(intervals, start, key=lambda iv: iv[0]) - 1)
    covered = 0.0
    for low, high in intervals[first:]:
        if low >= end:
            break
        covered += max(0.0, min(high, end) - max(low, start))
    return covered / (end - start)


def _level_rows(
    lines: Lines, intervals: Sequence[tuple[float, float]], cost: ProfileCostModel
) -> dict[str, Any]:
    """One level's busy decode steps: served / charged, overall, per rows
    bucket (median), and with the prefill engine busy or idle (mean)."""
    ratios: list[float] = []
    by_rows: dict[int, list[float]] = defaultdict(list)
    by_prefill: dict[str, list[float]] = defaultdict(list)
    for index, shape, served in busy_lines(lines):
        if shape.prefill_chunks:
            continue
        ratio = served / cost.estimate(shape)
        ratios.append(ratio)
        by_rows[shape.decode_rows].append(ratio)
        start = lines[index]["t"]
        share = computed_share(intervals, start, start + served)
        by_prefill["busy" if share > BUSY_SHARE else "idle"].append(ratio)
    return {
        "steps": len(ratios),
        "mean": statistics.fmean(ratios) if ratios else None,
        "by_rows": {
            rows: (len(v), statistics.median(v)) for rows, v in sorted(by_rows.items())
        },
        "by_prefill": {
            state: (len(v), statistics.fmean(v))
            for state, v in sorted(by_prefill.items())
        },
    }


def run_rows(run: Path) -> list[tuple[str, dict[str, Any]]]:
    """Each level of the saved run at ``run`` and its ``_level_rows``."""
    report = json.loads((run / "report.json").read_text())
    served = [level["measured"]["completed"] for level in report["levels"]]
    decode = read_step_log(run / "logs" / "steps-decode-0.jsonl")
    intervals = prefill_intervals(read_step_log(run / "logs" / "steps-prefill-0.jsonl"))
    cost = ProfileCostModel(
        Profile.load(run / "pd-decode-calibrated.json"), interpolate=True
    )
    return [
        (level["level"], _level_rows(lines, intervals, cost))
        for level, lines in zip(
            report["levels"], level_lines(decode, served), strict=True
        )
    ]


def dummy_rows(run: Path) -> dict[tuple[int, int], tuple[int, float, float]]:
    """Per (rows bucket, real rows) of the run's busy decode steps: how many,
    and the median of served / charged by the measured profile, with the
    dummy rows' discount and without. ``run``: a pair's (``pd-decode.json``)
    or a colocated ``validate``'s (``profile.json``, ``steps-server``)."""
    pair = (run / "pd-decode.json").exists()
    profile = run / ("pd-decode.json" if pair else "profile.json")
    log = run / "logs" / ("steps-decode-0.jsonl" if pair else "steps-server.jsonl")
    lines = read_step_log(log)
    cost = ProfileCostModel(Profile.load(profile), interpolate=True)
    ratios: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for _, shape, served in busy_lines(lines):
        if shape.prefill_chunks:
            continue
        all_real = replace(shape, decode_rows_actual=shape.decode_rows)
        ratios[(shape.decode_rows, shape.decode_rows_actual)].append(
            (served / cost.estimate(shape), served / cost.estimate(all_real))
        )
    return {
        key: (
            len(pairs),
            statistics.median(with_ for with_, _ in pairs),
            statistics.median(without for _, without in pairs),
        )
        for key, pairs in sorted(ratios.items())
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    for run in parser.parse_args(argv).runs:
        pair = (run / "pd-decode.json").exists()
        print(f"{run}: the decode engine's busy decode steps, served / charged")
        for label, rows in run_rows(run) if pair else ():
            bucket = ", ".join(
                f"{rows_} rows {ratio:.3f} ({count})"
                for rows_, (count, ratio) in rows["by_rows"].items()
            )
            prefill = ", ".join(
                f"prefill {state} {ratio:.3f} ({count})"
                for state, (count, ratio) in rows["by_prefill"].items()
            )
            print(f"  {label}: {rows['mean']:.3f} over {rows['steps']} steps; "
                  f"median by bucket: {bucket}; mean with the {prefill}")  # fmt: skip
        print("  against the profile as measured, by bucket and real rows:")
        for (bucket_rows, real), (count, with_, without) in dummy_rows(run).items():
            print(f"    {bucket_rows} rows, {real} real: {with_:.3f} ({count} steps); "
                  f"without the dummy rows' discount {without:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
