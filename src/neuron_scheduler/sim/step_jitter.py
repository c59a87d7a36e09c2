"""How much a served step's time varies about its shape's typical time.

A profile times each shape a few times on an in-process engine, alone: its
samples of a shape agree within a few percent, and a simulator charging
their median gives every step of a shape one time. A server's steps of one
shape vary more (the API server and the client share the machine with
the engine core; on the 2-core Xeon of docs/ground-truth.md, decode steps
of one shape ran 0.84-0.90x their median at p10 and 1.13-1.27x at p90),
and that variation is what widens inter-token latency's tail. A
``StepJitter`` holds it as quantiles of served / shape-median, scaled to
mean 1 so that it moves no mean, and draws a factor per step from a seeded
generator (a run is reproducible).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

#: Quantiles kept: 0, 1, ..., 100%.
QUANTILES = 101

#: A shape needs this many served steps to tell its typical time.
MIN_STEPS_A_SHAPE = 10


@dataclass(frozen=True)
class StepJitter:
    """``quantiles``: ``QUANTILES`` evenly spaced quantiles of a step's
    time over its shape's typical time, mean 1 (empty: no jitter)."""

    quantiles: tuple[float, ...]

    @classmethod
    def of_steps(cls, steps: Sequence[tuple[Hashable, float]]) -> StepJitter:
        """The jitter of served ``(shape key, seconds)`` steps, each over
        its shape's median; shapes with fewer than ``MIN_STEPS_A_SHAPE``
        steps are left out (none left: no jitter)."""
        by_shape: dict[Hashable, list[float]] = {}
        for key, seconds in steps:
            by_shape.setdefault(key, []).append(seconds)
        ratios = [
            np.asarray(times) / np.median(times)
            for times in by_shape.values()
            if len(times) >= MIN_STEPS_A_SHAPE and np.median(times) > 0
        ]
        if not ratios:
            return cls(())
        pooled = np.concatenate(ratios)
        pooled = pooled / pooled.mean()
        levels = np.linspace(0.0, 1.0, QUANTILES)
        return cls(tuple(float(q) for q in np.quantile(pooled, levels)))

    def __bool__(self) -> bool:
        return bool(self.quantiles)

    def quantile(self, share: float) -> float:
        """The factor at ``share`` (0 to 1), between the kept quantiles."""
        levels = np.linspace(0.0, 1.0, len(self.quantiles))
        return float(np.interp(share, levels, self.quantiles))

    def draw(self, rng: np.random.Generator) -> float:
        """A step's factor: 1 without jitter, else one drawn from ``rng``."""
        return self.quantile(float(rng.random())) if self.quantiles else 1.0
