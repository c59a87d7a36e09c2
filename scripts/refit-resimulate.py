"""A saved ``validate`` run's levels re-simulated whole with other refits.

``validate`` simulates each level with the profile refitted to the served
steps of every other level: a line per kind, ``served = scale x profiled +
overhead`` (``sim.calibration``). Step ratios alone (``refit-check.py``)
cannot say which refit predicts a level's latencies best, since queueing
turns a step's error into a request's. This rebuilds each level's requests
as ``validate`` built them, refits on the other levels' steps by each
candidate below, simulates the level whole and prints its errors against
what the server measured; the first candidate is ``validate``'s own, and
its errors must equal the report's (else the run was not rebuilt as it ran,
and the script stops).

Candidates: ``line`` (validate's: the line, each decode step charged a
factor drawn from how the served decode steps varied about their window's
speed, ``sim.step_jitter``), ``steady`` (the line alone: validate's before
commit d39f0c9), ``queued`` (the line, fitted also to every step that
left requests waiting or was followed by an empty step: the timing rule
of a disaggregated pair's prefill engine), ``ratio`` (each kind's median
served / profiled, no overhead), ``bucket`` (decode: the median ratio of each batch
bucket's own steps, the kind's where a bucket has fewer than ``MIN_STEPS``;
prefill: the kind's ratio), ``adjacent`` (validate's line, fitted to the
steps of the levels served just before and just after only: does the
nearer minute predict a level better?), ``ensemble`` (validate's line,
each compared metric the mean over every step's cost times each of
``ENSEMBLE_FACTORS``: near a queue's edge a few per cent of step cost
moves a request past another's arrival and a mean by far more, and the
mean over the machine's likely speeds may predict such a level better
than one draw), ``profiled`` (no refit). A run
saved before
the jitter is rebuilt when ``steady`` gives its errors; one saved after,
``line``.

Usage: .venv/bin/python scripts/refit-resimulate.py RUN_DIR [VALIDATE FLAGS]
  RUN_DIR holds validate's profile.json (``--save-profile``), report.json
  (``--json``) and logs/steps-server.jsonl (``--log-dir``); VALIDATE FLAGS
  are the workload and engine flags the run was given (none for defaults).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from saved_run import (
    SavedRun,
    ensembled,
    load_run,
    rebuilt_requests,
    validates_refits,
    without_jitter,
)

from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.calibration import (
    MIN_STEPS,
    Calibration,
    FitMethod,
    StepFit,
    busy_steps,
    calibrated,
    fit,
)
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.validation_metrics import judge, steady_rate
from neuron_scheduler.step import StepKind

Lines = Sequence[dict[str, Any]]
Refit = Callable[[Profile, Lines], Profile]


def by_line(profile: Profile, lines: Lines) -> Profile:
    return calibrated(profile, fit(profile, lines))


def by_steady_line(profile: Profile, lines: Lines) -> Profile:
    return calibrated(profile, without_jitter(fit(profile, lines)))


def by_queued_line(profile: Profile, lines: Lines) -> Profile:
    """The line, also fitted to each step that left requests waiting or
    was followed by an empty step (as the pair's prefill engine is)."""
    return calibrated(profile, fit(profile, lines, until_empty=True))


def by_ratio(profile: Profile, lines: Lines) -> Profile:
    line = fit(profile, lines)

    def ratio(kind: StepFit) -> StepFit:
        if kind.method is FitMethod.KEPT:
            return kind
        return StepFit(kind.median_ratio, 0.0, kind.steps, kind.median_ratio,
                       FitMethod.RATIO, kind.line_slope)  # fmt: skip

    both = Calibration(ratio(line.prefill_steps), ratio(line.decode_steps))
    return calibrated(profile, both)


def by_bucket(profile: Profile, lines: Lines) -> Profile:
    """Decode timings scaled by their batch bucket's median ratio."""
    cost = ProfileCostModel(profile, interpolate=True)
    ratios: dict[int, list[float]] = defaultdict(list)
    for shape, served in busy_steps(lines):
        if not shape.prefill_chunks:
            ratios[shape.decode_rows].append(served / cost.estimate(shape))
    kind_wide = by_ratio(profile, lines)
    whole = statistics.median(r for rows in ratios.values() for r in rows)
    scale = {
        rows: statistics.median(found) if len(found) >= MIN_STEPS else whole
        for rows, found in ratios.items()
    }
    timings = tuple(
        replace(
            mine,
            samples_s=tuple(
                s * scale.get(theirs.rows, whole) for s in theirs.samples_s
            ),
        )
        if theirs.kind is StepKind.DECODE
        else mine
        for mine, theirs in zip(kind_wide.timings, profile.timings, strict=True)
    )
    return replace(kind_wide, timings=timings)


#: The ``ensemble`` candidate's factors on every step's cost: the machine's
#: speed a few per cent either way of the other levels' line.
ENSEMBLE_FACTORS = (0.95, 0.975, 1.0, 1.025, 1.05)

# Each candidate: its refit, the levels' steps it is fitted to, and the
# factors on every step's cost its metrics are averaged over.
CANDIDATES: dict[
    str, tuple[Refit, Callable[[SavedRun, int], Lines], tuple[float, ...]]
] = {
    "line": (by_line, SavedRun.others, (1.0,)),
    "steady": (by_steady_line, SavedRun.others, (1.0,)),
    "queued": (by_queued_line, SavedRun.others, (1.0,)),
    "ratio": (by_ratio, SavedRun.others, (1.0,)),
    "bucket": (by_bucket, SavedRun.others, (1.0,)),
    "adjacent": (by_line, SavedRun.adjacent, (1.0,)),
    "ensemble": (by_line, SavedRun.others, ENSEMBLE_FACTORS),
    "profiled": (lambda profile, _lines: profile, SavedRun.others, (1.0,)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("validate_flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    run = load_run(args.run_dir, args.validate_flags)
    # The profile the levels were simulated with, before any refit.
    profile, levels = run.profile, run.levels
    again: dict[str, dict[str, Any]] = {name: {"levels": []} for name in CANDIDATES}
    print(
        "level                        refit     mape   TTFT   TPOT   E2EL"
        "  p90 ITL p99 ITL  worst p99"
    )
    for index, level in enumerate(levels):
        others = run.others(index)
        refits = validates_refits(profile, others)
        specs = rebuilt_requests(run.options, refits, level, levels[0])
        for name, (refit, fitted_to, factors) in CANDIDATES.items():
            refitted = refit(profile, fitted_to(run, index))
            entry, finish_s = ensembled(run.options, refitted, level, specs, factors)
            again[name]["levels"].append(entry)
            print(_row(level["level"], name, entry))
            if level["request_rate"] is None and level["max_concurrency"] is None:
                measured = run.report["capacity"]["measured_req_s"]
                capacity = steady_rate(finish_s) / measured
                again[name]["capacity"] = {"relative_error": capacity - 1}
                print(f"{'':29}capacity {capacity - 1:+.1%}")
    for name, rerun in again.items():
        print(_summary(name, rerun))


def _summary(name: str, rerun: dict[str, Any]) -> str:
    """One candidate over the run: its mean mape, its mean absolute error
    of p90 and p99 ITL, and the targets it misses."""
    mapes = [level["mape"] for level in rerun["levels"]]
    tails = {
        key: statistics.mean(
            abs(level["relative_error"][key]) for level in rerun["levels"]
        )
        for key in ("p90_itl_ms", "p99_itl_ms")
    }
    verdict = judge(rerun)
    missed = [
        f"{level['level'].split(' (')[0]} {miss['metric']} {miss['error']:+.1%}"
        for level in verdict["levels"]
        for miss in level["missed"]
    ]
    if not verdict.get("capacity_met", True):
        missed.insert(0, f"capacity {rerun['capacity']['relative_error']:+.1%}")
    return (
        f"{name:<9} mean mape {statistics.mean(mapes):5.2f}%, worst "
        f"{max(mapes):5.1f}%; mean |error| p90 ITL {tails['p90_itl_ms']:.1%}, "
        f"p99 ITL {tails['p99_itl_ms']:.1%}; missed: {'; '.join(missed) or 'none'}"
    )


def _row(label: str, name: str, errors: dict[str, Any]) -> str:
    e = errors["relative_error"]
    worst = max((k for k in e if k.startswith("p99_")), key=lambda k: abs(e[k]))
    return (
        f"{label[:28]:<28} {name:<9} {errors['mape']:>5.1f}% "
        f"{e['mean_ttft_ms']:>+6.1%} {e['mean_tpot_ms']:>+6.1%} "
        f"{e['mean_e2el_ms']:>+6.1%}  {e['p90_itl_ms']:>+6.1%}  "
        f"{e['p99_itl_ms']:>+6.1%}  {worst} {e[worst]:+.1%}"
    )


if __name__ == "__main__":
    main()
