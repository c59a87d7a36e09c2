"""How the refit on the other levels charges each level's steps, by rows.

``validate`` simulates each level with the profile refitted to the served
steps of every other level (``sim.calibration``: a line, served = scale x
profiled + overhead, a kind). This reads a saved run (the profile
``--save-profile`` kept, the server's step log from ``--log-dir``, the
``--json`` report), refits as ``validate`` does for each level, and prints,
for the level's own busy steps grouped by kind and real rows, the median of
served / charged: as profiled, by that line, and by the other levels'
median ratio alone (no overhead). 1.000 is a step charged what it took;
it also prints the profiled times the line was fitted over.

Usage: .venv/bin/python scripts/refit-check.py RUN_DIR
       (RUN_DIR holding profile.json, report.json and logs/steps-server.jsonl)
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.calibration import (
    CalibrationError,
    busy_steps,
    fit,
    level_spans,
    read_step_log,
)
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.step import StepKind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    run = parser.parse_args().run_dir
    profile = Profile.load(run / "profile.json")
    report = json.loads((run / "report.json").read_text())
    lines = read_step_log(run / "logs" / "steps-server.jsonl")
    lines = [line for line in lines if line["kind"] != "empty" or line["ids"]]
    levels = report["levels"]
    try:
        spans = level_spans(lines, [level["measured"]["completed"] for level in levels])
    except CalibrationError as error:
        raise SystemExit(f"{run}: {error}") from None
    cost = ProfileCostModel(profile, interpolate=True)
    for level, (first, last) in zip(levels, spans, strict=True):
        others = lines[:first] + lines[last + 1 :]
        calibration = fit(profile, others)
        fitted = [
            cost.estimate(shape)
            for shape, _ in busy_steps(others)
            if not shape.prefill_chunks
        ]
        groups: dict[tuple[str, int], list[tuple[float, ...]]] = defaultdict(list)
        for shape, served in busy_steps(lines[first : last + 1]):
            kind = StepKind.PREFILL if shape.prefill_chunks else StepKind.DECODE
            step_fit = calibration.of(kind)
            profiled = cost.estimate(shape)
            charged = (
                profiled,
                step_fit.scale * profiled + step_fit.overhead_s,
                step_fit.median_ratio * profiled,
            )
            # Prefills by kind alone (their decode_rows_actual is 0).
            groups[(kind.value, shape.decode_rows_actual)].append(
                tuple(served / c for c in charged)
            )
        decode = calibration.decode_steps
        print(
            f"{level['level']}: decode refit {decode.scale:.3f} x profiled + "
            f"{1e3 * decode.overhead_s:.1f} ms, median ratio "
            f"{decode.median_ratio:.3f}; fitted over decode steps profiled "
            f"{1e3 * min(fitted):.1f}-{1e3 * max(fitted):.1f} ms"
        )
        print("  kind     rows  steps  served/profiled  /line  /ratio")
        for (kind_name, rows), ratios in sorted(groups.items()):
            medians = [statistics.median(r[i] for r in ratios) for i in range(3)]
            print(
                f"  {kind_name:<8} {rows:>4} {len(ratios):>6}  {medians[0]:>15.3f}  "
                f"{medians[1]:>5.3f}  {medians[2]:>6.3f}"
            )


if __name__ == "__main__":
    main()
