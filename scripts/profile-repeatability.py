"""Do profiles of one configuration agree on what each shape costs?

What a simulator ranks configs by is the relative cost of shapes: a config
that runs more small batches wins if small batches are cheap. A machine
whose speed drifts (10-30% between ten-second windows on a shared CPU)
makes each profile's shapes cost what the moment they were timed in cost,
and so two profiles of the same configuration disagree shape by shape. This
reads profiles of one configuration (``neuron-scheduler profile`` or
``validate --save-profile``) and prints:

* each profile's drift reference, where it has one (how far its moments
  ran from its median);
* per shape, the spread of its median between the profiles once each
  profile's overall speed is divided out (each profile's speed: the median
  over shapes of its cost over the shape's median across profiles): the
  standard deviation of its log, and the largest over the smallest;
  summed up over the decode and the prefill shapes, as charged
  (``samples_s``) and as measured (``measured_s``, where the drift
  correction scaled them);
* the shapes that cost less than the same batch at a shorter context
  (decode rows, or prefill tokens full, by more than ``--tolerance``):
  a profile's order by context that the engine cannot have.

Usage: .venv/bin/python scripts/profile-repeatability.py PROFILE PROFILE ...
       [--tolerance 0.02]
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from neuron_scheduler.offline.step_profile import Profile, StepTiming
from neuron_scheduler.step import StepKind

Shape = tuple[str, int, int, int]


def _shape(timing: StepTiming) -> Shape:
    return (timing.kind.value, timing.tokens, timing.context, timing.fill)


def medians(profile: Profile, measured: bool) -> dict[Shape, float]:
    """Each shape's median: as charged, or as measured (empty where the
    profile kept no measured times)."""
    result = {}
    for timing in profile.timings:
        samples = timing.measured_s if measured else timing.samples_s
        if samples:
            result[_shape(timing)] = statistics.median(samples)
    return result


def spreads(costs: Sequence[dict[Shape, float]]) -> dict[Shape, tuple[float, float]]:
    """Per shape every profile has, its cost once each profile's overall
    speed is divided out: the standard deviation of its log between the
    profiles (about the relative spread) and the largest over the
    smallest."""
    shapes = set.intersection(*(set(c) for c in costs))
    across = {s: statistics.median(c[s] for c in costs) for s in shapes}
    speeds = [statistics.median(c[s] / across[s] for s in shapes) for c in costs]
    result = {}
    for shape in shapes:
        relative = [c[shape] / speed for c, speed in zip(costs, speeds, strict=True)]
        deviation = statistics.stdev(math.log(r) for r in relative)
        result[shape] = deviation, max(relative) / min(relative)
    return result


def inversions(costs: dict[Shape, float], tolerance: float) -> list[str]:
    """Shapes cheaper than the same batch at the next shorter context by
    more than ``tolerance``."""
    by_batch: dict[tuple[str, int, int], list[tuple[int, float]]] = {}
    for (kind, tokens, context, fill), seconds in costs.items():
        if kind == StepKind.PREFILL.value and fill != tokens:
            continue  # partly filled prefill buckets: one context only
        by_batch.setdefault((kind, tokens, fill), []).append((context, seconds))
    found = []
    for (kind, tokens, _), points in sorted(by_batch.items()):
        points.sort()
        for (c0, s0), (c1, s1) in zip(points, points[1:], strict=False):
            if s1 < s0 * (1 - tolerance):
                found.append(
                    f"{kind} {tokens}: {s0 * 1e3:.1f} ms at {c0}, "
                    f"{s1 * 1e3:.1f} ms at {c1}"
                )
    return found


def _summary(label: str, values: list[tuple[float, float]]) -> str:
    if not values:
        return f"  {label:<16} (no shape in every profile)"
    deviations = [d for d, _ in values]
    return (
        f"  {label:<16} sd {statistics.median(deviations):.1%} median, "
        f"{statistics.fmean(deviations):.1%} mean; largest / smallest "
        f"{statistics.median(r for _, r in values):.3f}x median, "
        f"{max(r for _, r in values):.3f}x worst ({len(values)} shapes)"
    )


def report(profiles: dict[str, Profile], tolerance: float) -> list[str]:
    lines = ["drift reference (slowest / fastest moment over its median):"]
    for name, profile in profiles.items():
        drift = profile.meta.get("drift")
        text = (
            f"{drift['slowest_x']:.3f} / {drift['fastest_x']:.3f} over "
            f"{len(drift['seconds'])} moments"
            if drift
            else "none (timed before the correction)"
        )
        lines.append(f"  {name}: {text}")
    for measured in (False, True):
        costs = [medians(p, measured) for p in profiles.values()]
        if not all(costs):
            continue
        what = "as measured" if measured else "as charged"
        by_shape = spreads(costs)
        lines.append(f"spread of each shape between the profiles, {what}:")
        for kind in StepKind.DECODE, StepKind.PREFILL:
            values = [v for s, v in by_shape.items() if s[0] == kind.value]
            lines.append(_summary(f"{kind.value} shapes", values))
        lines.append(f"cheaper at a longer context (by > {tolerance:.0%}), {what}:")
        for name, cost in zip(profiles, costs, strict=True):
            found = inversions(cost, tolerance)
            lines.append(f"  {name}: {len(found)}")
            lines += [f"    {shape}" for shape in found]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--tolerance", type=float, default=0.02)
    args = parser.parse_args()
    if len(args.profiles) < 3:
        parser.error("give three profiles or more")
    profiles = {str(path): Profile.load(path) for path in args.profiles}
    print("\n".join(report(profiles, args.tolerance)))


if __name__ == "__main__":
    main()
