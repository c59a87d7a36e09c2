"""The same step shapes, level by level: does the shape or the minute move?

``validate`` charges a served step what its shape costs in the profile
(refitted to the other levels). Where a level's steps run slower or faster
than that, either the profile has the shape wrong (then the same shape is
off by the same factor at every level and in every config) or the machine
ran at another speed that minute (then every shape of the level moves
together). This reads a saved run, splits its busy steps (the next step
holds one of their requests) by shape: prefill steps by token bucket,
decode steps by rows bucket, real rows and the real rows' mean context
(bins of ``--context-bin`` positions), and prints for each shape and each
level the median of served / profiled and the steps it is over (shapes
with fewer than ``--min-steps`` at a level are left blank there). Last,
each level's whole: its served seconds over its profiled seconds, a kind,
and how far the median served / profiled of its decode steps moved between
its ``--window``-second windows (largest / smallest, over the windows with
20 decode steps or more; shapes mixed).

RUN_DIR is either a ``validate`` run (profile.json from
``--save-profile``, report.json from ``--json``, logs/steps-server.jsonl
from ``--log-dir``: a column a level) or a config comparison's
(``--config``, ``--rounds``: profile.json and logs/steps-server-LABEL-
roundN.jsonl, a column a config and round).

Usage: .venv/bin/python scripts/shape-drift.py RUN_DIR [--min-steps 8]
       [--context-bin 512] [--window 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.calibration import (
    busy_lines,
    busy_steps,
    level_spans,
    read_step_log,
)
from neuron_scheduler.sim.cost_model import StepShape
from neuron_scheduler.sim.profile_cost import ProfileCostModel

Lines = list[dict[str, Any]]


def _columns(run: Path) -> dict[str, Lines]:
    """The run's step log lines by column: a level, or a config's round."""
    single = run / "logs" / "steps-server.jsonl"
    if single.exists():
        report = json.loads((run / "report.json").read_text())
        lines = read_step_log(single)
        levels = report["levels"]
        spans = level_spans(lines, [level["measured"]["completed"] for level in levels])
        return {
            level["level"].split(" (")[-1].rstrip(")"): lines[first : last + 1]
            for level, (first, last) in zip(levels, spans, strict=True)
        }
    logs = sorted((run / "logs").glob("steps-server-*.jsonl"))
    if not logs:
        raise SystemExit(f"{run}/logs holds no steps-server*.jsonl")
    return {
        path.stem.removeprefix("steps-server-"): read_step_log(path) for path in logs
    }


def _shape_key(shape: StepShape, context_bin: int) -> tuple[Any, ...]:
    """A prefill's token bucket; a decode's rows, real rows and context bin."""
    if shape.prefill_chunks:
        return ("prefill", sum(t for t, _ in shape.prefill_chunks))
    real = shape.decode_rows_actual or shape.decode_rows
    low = int(shape.decode_context_actual // context_bin * context_bin)
    return ("decode", shape.decode_rows, real, f"{low}-{low + context_bin - 1}")


def _window_spread(lines: Lines, cost: ProfileCostModel, window_s: float) -> str:
    """Largest / smallest median served / profiled of the busy decode
    steps of ``lines`` over ``window_s``-second windows ("" under two
    windows)."""
    if not lines:
        return ""
    start = lines[0]["t"]
    windows: dict[int, list[float]] = defaultdict(list)
    for index, shape, served in busy_lines(lines):
        line = lines[index]
        if line["kind"] == "decode":
            ratio = served / cost.estimate(shape)
            windows[int((line["t"] - start) // window_s)].append(ratio)
    medians = [statistics.median(r) for r in windows.values() if len(r) >= 20]
    if len(medians) < 2:
        return ""
    return f"{max(medians) / min(medians):.3f} ({len(medians)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--min-steps", type=int, default=8)
    parser.add_argument("--context-bin", type=int, default=512)
    parser.add_argument("--window", type=float, default=10.0)
    args = parser.parse_args()
    profile = Profile.load(args.run_dir / "profile.json")
    cost = ProfileCostModel(profile, interpolate=True)
    columns = _columns(args.run_dir)
    ratios: dict[tuple[Any, ...], dict[str, list[float]]] = defaultdict(dict)
    whole: dict[str, dict[str, list[float]]] = {}
    for name, lines in columns.items():
        sums = {"prefill": [0.0, 0.0], "decode": [0.0, 0.0]}
        for shape, served in busy_steps(lines):
            profiled = cost.estimate(shape)
            key = _shape_key(shape, args.context_bin)
            ratios[key].setdefault(name, []).append(served / profiled)
            sums[key[0]][0] += served
            sums[key[0]][1] += profiled
        whole[name] = sums
    width = max(16, *(len(name) + 2 for name in columns))
    print(f"{'shape':<34}" + "".join(f"{name:>{width}}" for name in columns))
    for key in sorted(ratios, key=str):
        cells = []
        for name in columns:
            found = ratios[key].get(name, [])
            cell = (
                f"{statistics.median(found):.3f} ({len(found)})"
                if len(found) >= args.min_steps
                else ""
            )
            cells.append(f"{cell:>{width}}")
        print(f"{' '.join(map(str, key)):<34}" + "".join(cells))
    for kind in ("prefill", "decode"):
        cells = [
            f"{served / profiled:.3f}" if profiled else ""
            for served, profiled in (whole[name][kind] for name in columns)
        ]
        print(f"{kind + ' steps, whole':<34}" + "".join(f"{c:>{width}}" for c in cells))
    spreads = [_window_spread(lines, cost, args.window) for lines in columns.values()]
    label = f"decode, {args.window:g}-s windows"
    print(f"{label:<34}" + "".join(f"{c:>{width}}" for c in spreads))


if __name__ == "__main__":
    main()
