"""The machine's speed through a profile run, and the correction it implies.

A shared or throttled CPU runs the same step 10-30% slower in one ten
seconds than in the next. A profile that times its shapes one group after
another then charges each group the speed of its own moment: a decode
context measured in a slow moment costs more than a longer one measured in
a fast moment, and every comparison between configurations that use
different shapes inherits that error. So the profiler times one small
reference step between its blocks of work, and ``DriftReference`` scales
every sample to the reference's median speed over the run, by the
reference's time interpolated at the moment the sample was taken, as far
as the reference's movement exceeds its own jitter.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass
from functools import cached_property
from typing import Any


class DriftError(ValueError):
    """References that cannot describe a run (named)."""


@dataclass(frozen=True)
class DriftReference:
    """The reference step's times (``samples``: a few steps each) at each
    moment ``at`` it was timed (seconds since the run began, increasing).

    A moment's time is its samples' median. Those medians move with the
    machine and with the reference's own step-to-step jitter; the
    correction applies the share of their movement the jitter does not
    explain (``weight``: 1 where the machine moved far more than a median
    of a few steps jitters, 0 where no more)."""

    label: str
    at: tuple[float, ...]
    samples: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.at or len(self.at) != len(self.samples):
            raise DriftError(
                f"drift reference {self.label!r}: {len(self.at)} moments and "
                f"{len(self.samples)} timings (need as many, at least one)"
            )
        if any(b <= a for a, b in zip(self.at, self.at[1:], strict=False)):
            raise DriftError(f"drift reference {self.label!r}: moments not increasing")
        if any(not steps or min(steps) <= 0 for steps in self.samples):
            raise DriftError(
                f"drift reference {self.label!r}: a moment with no step or a "
                f"time <= 0 in {self.samples}"
            )

    @cached_property
    def seconds(self) -> tuple[float, ...]:
        """The reference's time at each moment: its steps' median."""
        return tuple(statistics.median(steps) for steps in self.samples)

    @cached_property
    def typical_s(self) -> float:
        """The reference's median over the run: the speed samples are
        scaled to."""
        return statistics.median(self.seconds)

    @cached_property
    def weight(self) -> float:
        """The share of the moments' movement (the variance of their log
        times) that the jitter of a median of their steps does not explain
        (a median of n steps jitters about pi/2 / n times a step's
        variance); 0 with one moment."""
        if len(self.samples) < 2:
            return 0.0
        moved = statistics.variance(math.log(s) for s in self.seconds)
        jitters = [
            statistics.variance(math.log(s) for s in steps) * math.pi / 2 / len(steps)
            for steps in self.samples
            if len(steps) > 1
        ]
        if moved <= 0:
            return 0.0
        jitter = statistics.fmean(jitters) if jitters else 0.0
        return max(0.0, 1.0 - jitter / moved)

    def speed_at(self, at: float) -> float:
        """The reference's time at ``at``: linear between the moments it
        was timed, the nearest one's before the first and after the last."""
        seconds = self.seconds
        right = bisect.bisect_left(self.at, at)
        if right == 0:
            return seconds[0]
        if right == len(self.at):
            return seconds[-1]
        a0, a1 = self.at[right - 1], self.at[right]
        s0, s1 = seconds[right - 1], seconds[right]
        return s0 + (s1 - s0) * (at - a0) / (a1 - a0)

    def factor(self, at: float) -> float:
        """What a sample timed at ``at`` is multiplied by: above 1 in a
        fast moment, below 1 in a slow one (``weight`` of the way)."""
        return (self.typical_s / self.speed_at(at)) ** self.weight

    def spread(self) -> tuple[float, float]:
        """The slowest and the fastest moment, as times of the typical."""
        typical = self.typical_s
        return max(self.seconds) / typical, min(self.seconds) / typical

    def to_json(self) -> dict[str, Any]:
        slowest, fastest = self.spread()
        return {
            "reference": self.label,
            "typical_s": self.typical_s,
            "slowest_x": round(slowest, 4),
            "fastest_x": round(fastest, 4),
            "weight": round(self.weight, 4),
            "at_s": [round(a, 3) for a in self.at],
            "seconds": list(self.seconds),
            "samples_s": [list(steps) for steps in self.samples],
        }
