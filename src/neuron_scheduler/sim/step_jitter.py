"""How a served decode step's time varies about the machine's speed of the moment.

A profile times each shape a few times, alone: a simulator charging its
medians (refitted to a server's steps, ``sim.calibration``) gives every
step of a shape one time. A server's decode steps vary more, and their
variation is what makes inter-token latency's tail. Part of it is the
machine's speed moving over minutes, which no model of a future run can
know; the rest is how steps vary inside a few seconds at one speed (on
the family-25 EPYC of docs/ground-truth.md, p10 0.84-0.88, p90 1.15-1.20
and p99 1.29-1.42 of their window's speed, alike between loads and runs).

``StepJitter.about_windows`` measures that rest: it bins busy decode steps
into windows of ``WINDOW_S``, divides each step's served time by its fitted
time times its window's speed (the window's served over fitted seconds),
and keeps ``QUANTILES`` quantiles of the ratios, scaled to mean 1 so that
no mean moves. A refitted profile's cost model charges each decode step a
factor drawn from them with a seeded generator (the same run charges the
same times). Prefill steps are not drawn for: few, long, and their spread
is their shapes'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Seconds of a window whose steps are taken to share one machine speed.
WINDOW_S = 10.0

#: Steps of a kind a window needs before its speed counts.
MIN_WINDOW_STEPS = 3

#: Quantiles kept: 0, 1, ..., 100%.
QUANTILES = 101

#: The seed of each cost model's draws.
JITTER_SEED = 0

#: Draws a block: each takes one factor from each 1/STRATA of the jitter.
STRATA = 100


@dataclass(frozen=True)
class StepJitter:
    """``quantiles``: ``QUANTILES`` evenly spaced quantiles of a decode
    step's time over its fitted time at its window's speed, mean 1
    (empty: no jitter, every step charged as fitted)."""

    quantiles: tuple[float, ...] = ()

    @classmethod
    def about_windows(
        cls, steps: Sequence[tuple[float, float, float]], window_s: float = WINDOW_S
    ) -> StepJitter:
        """The jitter of busy decode ``steps``, each ``(start s, fitted s,
        served s)``: each step's served over fitted seconds times its
        window's speed, over the windows of ``window_s`` from the first
        start with ``MIN_WINDOW_STEPS`` steps (none: no jitter). A step
        with no time on either side (a served time that was all a KV
        connector's, taken off) tells nothing and is left out."""
        if window_s <= 0:
            raise ValueError(f"window_s={window_s!r}: a window must be positive")
        windows: dict[int, list[tuple[float, float]]] = {}
        first = min((start for start, _, _ in steps), default=0.0)
        for start, fitted, served in steps:
            if fitted > 0 and served > 0:
                window = int((start - first) // window_s)
                windows.setdefault(window, []).append((fitted, served))
        ratios: list[float] = []
        for found in windows.values():
            if len(found) < MIN_WINDOW_STEPS:
                continue
            speed = sum(s for _, s in found) / sum(f for f, _ in found)
            ratios.extend(s / (f * speed) for f, s in found)
        if not ratios:
            return cls()
        pooled = np.asarray(ratios) / np.mean(ratios)
        shares = np.linspace(0.0, 1.0, QUANTILES)
        return cls(tuple(round(float(q), 4) for q in np.quantile(pooled, shares)))

    def __bool__(self) -> bool:
        return bool(self.quantiles)

    def quantile(self, share: float) -> float:
        """The factor at ``share`` (0 to 1), between the kept quantiles
        (1 without jitter)."""
        q = self.quantiles
        if len(q) < 2:
            return q[0] if q else 1.0
        at = min(max(share, 0.0), 1.0) * (len(q) - 1)
        below = min(int(at), len(q) - 2)
        return q[below] + (q[below + 1] - q[below]) * (at - below)


class JitterDraws:
    """Factors drawn from a ``StepJitter``, one a call, seeded: in blocks of
    ``STRATA``, each block one factor from each of its equal shares of the
    distribution, at a random point within it and in a random order. Any
    block's factors then follow the jitter's quantiles, their mean 1 to
    within the strata's width (independent draws leave that to chance)."""

    def __init__(self, jitter: StepJitter, seed: int = JITTER_SEED) -> None:
        self.jitter = jitter
        self._rng = np.random.default_rng(seed)
        self._block: list[float] = []

    def __call__(self) -> float:
        """The next step's factor (1 without jitter)."""
        if not self.jitter:
            return 1.0
        if not self._block:
            shares = (np.arange(STRATA) + self._rng.random(STRATA)) / STRATA
            self._rng.shuffle(shares)
            self._block = [self.jitter.quantile(float(s)) for s in shares]
        return self._block.pop()
