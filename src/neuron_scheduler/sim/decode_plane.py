"""A profile's decode steps as one plane, for a worker whose attention reads
each row's own context (``meta["decode_context"] == "actual"``: the CPU
static-shape worker).

``profile`` times each decode shape (rows bucket x context) in one burst of
a few consecutive steps. On a shared CPU the samples of a burst agree
closely while the same shape differs by up to a third between two profiles
taken minutes apart: each burst lands at its own moment of the machine's
speed. Such a worker's decode step costs a fixed part, a part per row of
the bucket (the dense layers run every row) and a part per row per
position of context (the attention), so

    seconds = intercept + per_row x rows + per_row_token x rows x context

fitted to every decode shape at once (least squares on relative errors,
each part >= 0: a part the noise would make negative is 0) spreads each
burst's moment over all of them. ``on_plane`` moves each
shape's samples so that their median is the plane's value there (their
spread kept); the cost model then interpolates and charges dummy rows as
before. A profile of a graph-per-bucket accelerator (``"bucket"``) is
kept as measured: its shapes are not one plane.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import combinations
from typing import Any

import numpy as np

from neuron_scheduler.offline.step_profile import Profile, StepTiming
from neuron_scheduler.step import StepKind

#: Decode shapes a plane of three parameters needs at the least.
MIN_SHAPES = 4


class DecodePlaneError(ValueError):
    """The profile's decode steps cannot be fitted as a plane (why)."""


@dataclass(frozen=True)
class DecodePlane:
    """``intercept_s + per_row_s x rows + per_row_token_s x rows x context``
    fitted to ``shapes`` decode shapes; ``largest_move``: the largest
    relative change of a shape's median."""

    intercept_s: float
    per_row_s: float
    per_row_token_s: float
    shapes: int
    largest_move: float

    def seconds(self, rows: int, context: float) -> float:
        return (
            self.intercept_s
            + self.per_row_s * rows
            + self.per_row_token_s * rows * context
        )

    def report(self) -> dict[str, Any]:
        return {
            "intercept_ms": self.intercept_s * 1e3,
            "per_row_ms": self.per_row_s * 1e3,
            "per_row_token_us": self.per_row_token_s * 1e6,
            "shapes": self.shapes,
            "largest_move": self.largest_move,
        }


def fit_plane(profile: Profile) -> DecodePlane:
    """The plane through ``profile``'s decode medians, each part >= 0;
    ``DecodePlaneError`` for a profile that is not per-row-context
    (``"actual"``), has fewer than ``MIN_SHAPES`` decode shapes or too few
    rows buckets and contexts to fix three parameters, or whose plane is
    not positive at every shape."""
    decode_context = profile.meta.get("decode_context", "bucket")
    if decode_context != "actual":
        raise DecodePlaneError(
            f"the profile's decode steps are timed per context bucket "
            f"(decode_context {decode_context!r}): kept as measured"
        )
    timings = [t for t in profile.timings if t.kind is StepKind.DECODE]
    rows = {t.rows for t in timings}
    contexts = {t.context for t in timings}
    if len(timings) < MIN_SHAPES or len(rows) < 2 or len(contexts) < 2:
        raise DecodePlaneError(
            f"{len(timings)} decode shapes (rows {sorted(rows)}, contexts "
            f"{sorted(contexts)}): a plane needs {MIN_SHAPES} or more over two "
            "or more of each"
        )
    design = np.array([[1.0, t.rows, t.rows * t.context] for t in timings])
    medians = np.array([t.median_s for t in timings])
    weighted = design / medians[:, None]  # relative errors: short shapes count
    ones = np.ones(len(timings))
    (intercept, per_row, per_row_token), *_ = np.linalg.lstsq(
        weighted, ones, rcond=None
    )
    if np.any(design @ np.array([intercept, per_row, per_row_token]) <= 0):
        raise DecodePlaneError(
            f"the plane through the decode medians is not positive at every "
            f"shape (intercept {intercept * 1e3:.2f} ms, per row "
            f"{per_row * 1e3:.3f} ms): kept as measured"
        )
    # Each part is a cost: one the noise drove below 0 is 0 (measured: a
    # tiny model's per-row part, -0.02 ms).
    parts = _non_negative_fit(weighted, ones)
    intercept, per_row, per_row_token = parts
    fitted = design @ parts
    return DecodePlane(
        float(intercept),
        float(per_row),
        float(per_row_token),
        len(timings),
        float(np.max(np.abs(fitted / medians - 1.0))),
    )


def _non_negative_fit(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares of ``design @ x = target`` with every ``x >= 0``: the
    best of the unconstrained fits on each subset of the columns that has
    no negative part (exact; the optimum is one of them)."""
    columns = design.shape[1]
    best, best_residual = np.zeros(columns), float(target @ target)
    for size in range(1, columns + 1):
        for support in combinations(range(columns), size):
            part, *_ = np.linalg.lstsq(design[:, support], target, rcond=None)
            if np.any(part < 0):
                continue
            miss = design[:, support] @ part - target
            residual = float(miss @ miss)
            if residual < best_residual:
                best = np.zeros(columns)
                best[list(support)] = part
                best_residual = residual
    return best


def on_plane(profile: Profile, plane: DecodePlane) -> Profile:
    """``profile`` with each decode shape's samples scaled so that their
    median is ``plane``'s value there; the plane recorded in its
    ``meta``."""

    def moved(timing: StepTiming) -> StepTiming:
        if timing.kind is not StepKind.DECODE:
            return timing
        factor = plane.seconds(timing.rows, timing.context) / timing.median_s
        return replace(timing, samples_s=tuple(s * factor for s in timing.samples_s))

    meta = {**profile.meta, "decode_plane": plane.report()}
    return replace(profile, timings=tuple(moved(t) for t in profile.timings), meta=meta)
