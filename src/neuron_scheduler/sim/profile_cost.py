"""A cost model that charges simulated steps from measured step times
(a ``offline.step_profile.Profile``).

``neuron-scheduler profile`` measures whole engine steps (schedule, forward,
sample, update) of a real engine for every shape its configuration can
produce and writes a ``Profile`` as JSON. ``ProfileCostModel`` charges a
simulated step the median of the profiled step of its shape:

* a static prefill step: its token bucket, at its context-before (the
  profile samples a few contexts per bucket; between them the time is
  interpolated linearly), or, where the profile says the engine's
  attention runs the real tokens only (``meta["prefill_fill"] ==
  "actual"``: the CPU static-shape worker), by its real tokens: the
  bucket's time at context 0 less its time per real token (the slope of
  its samples at context 0, full and less filled, over their real tokens)
  times the tokens short of full, plus what the context before adds to
  the full bucket times the real tokens' share of the bucket (each real
  token reads the context, the padding none of it);
* a static decode step: its rows bucket, at its context bucket, or, where
  the profile says the engine's attention reads each sequence's own context
  (``meta["decode_context"] == "actual"``: the CPU static-shape worker), at
  the real rows' mean context, interpolated between the profile's context
  samples, less what the step's dummy rows would have read (such a kernel
  reads nothing for them: the per-row, per-position slope of the profile's
  context samples times the dummy rows times the context);
* any other shape (a bucket the profile lacks, or a dynamic step of the
  ``unconstrained`` policy: its prompt tokens and decode rows as one token
  count at their mean context) is interpolated between profiled points and
  counted in ``report()``; for static shapes only when ``interpolate`` is
  set, otherwise the missing shape is an error naming it.

A profile refitted to a server's steps (``sim.calibration``) carries how
its served decode steps varied about the machine's speed of the moment:
each charged decode step is then multiplied by a factor drawn from it
(``sim.step_jitter``: mean 1, stratified, each engine of a fleet from its
own stream, seeded afresh for each model, so the same run charges the same
times). ``estimate`` never draws.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_scheduler.offline.step_profile import Profile, StepTiming
from neuron_scheduler.sim.cost_model import CostModel, CostModelError, StepShape
from neuron_scheduler.sim.step_jitter import JITTER_SEED, JitterDraws, StepJitter
from neuron_scheduler.step import StepKind


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x): linear between
    neighbours, extrapolated from the last two above the range, flat below
    the first point (a step is never cheaper than the smallest profiled)."""
    if len(points) == 1 or x <= points[0][0]:
        return points[0][1]
    xs = [p[0] for p in points]
    i = bisect_left(xs, x)
    if i < len(points) and xs[i] == x:
        return points[i][1]
    i = min(max(i, 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope and intercept through ``points`` (slope 0 and the
    only value for a single point)."""
    if len(points) < 2:
        return 0.0, points[0][1]
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return slope, mean_y - slope * mean_x


@dataclass(frozen=True)
class BucketFills:
    """A prefill bucket's cost by its real tokens, from its samples at
    context 0: ``full`` real tokens (the bucket's most), ``least`` (its
    fewest sampled), and the seconds each real token short of full saves
    (the least-squares slope of the samples' medians over their real
    tokens; 0 where fewer tokens did not cost less)."""

    full: int
    least: int
    seconds_per_token: float

    def padding_seconds(self, actual: int) -> float:
        """What a step of ``actual`` real tokens costs less than a full one
        (never below the least-filled sample: flat below it)."""
        return self.seconds_per_token * max(self.full - max(actual, self.least), 0)


def _prefill_tables(
    timings: Iterable[StepTiming],
) -> tuple[dict[int, list[tuple[float, float]]], dict[int, BucketFills]]:
    """Per token bucket: its fullest samples by context before (sorted),
    and, where context 0 was sampled at two fills or more, its
    ``BucketFills``."""
    by_bucket: dict[int, dict[int, list[StepTiming]]] = {}
    for timing in timings:
        if timing.kind is StepKind.PREFILL:
            contexts = by_bucket.setdefault(timing.tokens, {})
            contexts.setdefault(timing.context, []).append(timing)
    tables: dict[int, list[tuple[float, float]]] = {}
    fills: dict[int, BucketFills] = {}
    for bucket, contexts in by_bucket.items():
        fullest = {c: max(ts, key=lambda t: t.fill) for c, ts in contexts.items()}
        tables[bucket] = sorted((float(c), t.median_s) for c, t in fullest.items())
        at_start = contexts.get(0, [])
        sampled = {t.fill for t in at_start}
        if len(sampled) < 2:
            continue
        slope, _ = _line([(float(t.fill), t.median_s) for t in at_start])
        fills[bucket] = BucketFills(max(sampled), min(sampled), max(slope, 0.0))
    return tables, fills


def decode_jitter(profile: Profile) -> StepJitter:
    """The ``StepJitter`` of decode steps that ``profile``'s calibration
    recorded (none: not calibrated, or calibrated before the jitter)."""
    calibration = profile.meta.get("calibration") or {}
    decode = calibration.get("decode_steps") or {}
    return StepJitter(tuple(decode.get("jitter", ())))


class ProfileCostModel(CostModel):
    """Charges steps the medians of a ``Profile`` (see module docstring)."""

    def __init__(self, profile: Profile, *, interpolate: bool = False) -> None:
        self.profile = profile
        self.interpolate = interpolate
        #: Decode steps charged at the real rows' context (not the bucket's).
        self.actual_decode_context = (
            profile.meta.get("decode_context", "bucket") == "actual"
        )
        #: rows bucket -> [(context bucket, median s)]
        self._decode: dict[int, list[tuple[float, float]]] = {}
        for timing in profile.timings:
            if timing.kind is StepKind.DECODE:
                point = (timing.context, timing.median_s)
                self._decode.setdefault(timing.rows, []).append(point)
        for rows in self._decode.values():
            rows.sort()
        #: token bucket -> [(context before, median s)], the bucket full;
        #: and its ``BucketFills`` where prefills are charged their real
        #: tokens (``meta["prefill_fill"] == "actual"``), else none
        self._prefill, fills = _prefill_tables(profile.timings)
        actual_fill = profile.meta.get("prefill_fill") == "actual"
        self._fills = fills if actual_fill else {}
        if not self._prefill or not self._decode:
            raise CostModelError(
                "profile has no prefill or no decode timings: nothing to charge"
            )
        self.exact_steps = 0
        self.interpolated_steps = 0
        #: how served decode steps varied (none: each charged as is)
        self.decode_jitter = decode_jitter(profile)
        #: engine -> its stream of decode factors, made at its first step
        self._draws: dict[int, JitterDraws] = {}

    @classmethod
    def load(cls, path: str | Path, *, interpolate: bool = False) -> ProfileCostModel:
        return cls(Profile.load(path), interpolate=interpolate)

    # ---------------------------------------------------------- interface

    def kv_capacity_tokens(self) -> int:
        return self.profile.kv_capacity_tokens

    def kv_bytes_per_token(self) -> int | None:
        """The profiled engine's KV memory over the tokens it holds."""
        memory = self.profile.engine.get("kv_cache_memory_bytes")
        tokens = self.profile.kv_capacity_tokens
        return int(memory) // tokens if memory and tokens else None

    def describe(self) -> str:
        model = self.profile.model.get("name", "?")
        platform = self.profile.platform.get("name", "?")
        return f"profile: {model} on {platform}"

    def report(self) -> dict[str, Any]:
        return {
            "cost_model": "profile",
            "exact_steps": self.exact_steps,
            "interpolated_steps": self.interpolated_steps,
        }

    def add_counts(self, counts: dict[str, Any]) -> None:
        self.exact_steps += counts.get("exact_steps", 0)
        self.interpolated_steps += counts.get("interpolated_steps", 0)

    def estimate(self, shape: StepShape) -> float:
        counts, strict = (self.exact_steps, self.interpolated_steps), self.interpolate
        self.interpolate = True
        try:
            return self._step_time(shape)
        finally:
            (self.exact_steps, self.interpolated_steps), self.interpolate = (
                counts,
                strict,
            )

    def mean_step_time(self, shape: StepShape) -> float:
        return self._step_time(shape)

    def step_time(self, shape: StepShape, engine: int = 0) -> float:
        seconds = self._step_time(shape)
        if shape.prefill_chunks or not self.decode_jitter:
            return seconds
        draws = self._draws.get(engine)
        if draws is None:
            seed = JITTER_SEED + engine
            draws = self._draws[engine] = JitterDraws(self.decode_jitter, seed)
        return seconds * draws()

    def _step_time(self, shape: StepShape) -> float:
        if shape.static and shape.decode_rows and not shape.prefill_chunks:
            if self.actual_decode_context and shape.decode_context_actual:
                return self._decode_at_actual_context(
                    shape.decode_rows,
                    shape.decode_context_actual,
                    shape.decode_rows_actual or shape.decode_rows,
                )
            return self._decode_time(shape.decode_rows, shape.decode_context)
        if shape.static and shape.prefill_chunks and not shape.decode_rows:
            tokens = shape.prefill_tokens
            context = (
                sum(t * before for t, before in shape.prefill_chunks) / tokens
                if tokens
                else 0.0
            )
            return self._prefill_time(tokens, context, shape.prefill_tokens_actual)
        # A dynamic step: every position computed counts as a prompt token,
        # at the mean context of all of them.
        positions = shape.prefill_tokens + shape.decode_rows
        weighted = shape.decode_rows * shape.decode_context + sum(
            t * before for t, before in shape.prefill_chunks
        )
        self.interpolated_steps += 1
        mean_context = weighted / positions if positions else 0.0
        return self._prefill_curve(positions, mean_context)

    # ------------------------------------------------------------ lookups

    def missing_shapes(
        self,
        token_buckets: Iterable[int],
        seq_buckets: Iterable[int],
        context_buckets: Iterable[int],
    ) -> list[str]:
        """The shapes of a configuration the profile lacks, named."""
        missing = [
            f"prefill of {t} tokens" for t in token_buckets if t not in self._prefill
        ]
        for rows in seq_buckets:
            if self.actual_decode_context:
                # Charged at actual contexts: the rows bucket is the shape.
                if rows not in self._decode:
                    missing.append(f"decode of {rows} rows")
                continue
            contexts = {c for c, _ in self._decode.get(rows, [])}
            missing += [
                f"decode of {rows} rows at context {c}"
                for c in context_buckets
                if c not in contexts
            ]
        return missing

    def _missing(self, what: str) -> CostModelError:
        return CostModelError(
            f"the profile has no {what} (profiled prefill token buckets "
            f"{sorted(self._prefill)}, decode rows {sorted(self._decode)}); "
            "profile this configuration, or pass --interpolate"
        )

    def _prefill_time(self, tokens: int, context: float, actual: int = 0) -> float:
        if tokens in self._prefill:
            self.exact_steps += 1
            full = _interpolate(self._prefill[tokens], context)
            fills = self._fills.get(tokens)
            if not (actual and fills):
                return full
            return self._filled_prefill_time(tokens, full, fills, actual)
        if not self.interpolate:
            raise self._missing(f"prefill shape of {tokens} tokens")
        self.interpolated_steps += 1
        return self._prefill_curve(tokens, context)

    def _filled_prefill_time(
        self, tokens: int, full: float, fills: BucketFills, actual: int
    ) -> float:
        """A ``tokens`` bucket of ``actual`` real tokens that costs ``full``
        filled: as at context 0 with ``actual`` real tokens, plus what the
        context before adds to the full bucket, for the real tokens' share
        of it (each real token reads the context; the padding reads none)."""
        at_start = _interpolate(self._prefill[tokens], 0.0)
        share = min(actual, fills.full) / fills.full
        reading = max(full - at_start, 0.0) * share
        return max(at_start - fills.padding_seconds(actual), 0.0) + reading

    def _prefill_curve(self, tokens: float, context: float) -> float:
        rows = sorted(self._prefill.items())
        curve = [(t, _interpolate(r, context)) for t, r in rows]
        return _interpolate(curve, tokens)

    def _decode_at_actual_context(
        self, rows: int, context: float, real_rows: int
    ) -> float:
        """Rows bucket exact, context interpolated between the samples (all
        rows real there), less the attention of the dummy rows: the
        profile's time per row per position of context (its slope over the
        context samples) times the dummy rows times the context."""
        contexts = self._decode.get(rows)
        if contexts is not None:
            self.exact_steps += 1
            full = _interpolate(contexts, context)
            slope, intercept = _line(contexts)
            dummy_attention = max(slope, 0.0) / rows * (rows - real_rows) * context
            return max(full - dummy_attention, intercept, 0.0)
        if not self.interpolate:
            raise self._missing(f"decode shape of {rows} rows")
        self.interpolated_steps += 1
        by_rows = sorted(self._decode.items())
        return _interpolate([(r, _interpolate(c, context)) for r, c in by_rows], rows)

    def _decode_time(self, rows: int, context: float) -> float:
        contexts = self._decode.get(rows)
        if contexts is not None and any(c == context for c, _ in contexts):
            self.exact_steps += 1
            return _interpolate(contexts, context)
        if not self.interpolate:
            raise self._missing(f"decode shape of {rows} rows at context {context:g}")
        self.interpolated_steps += 1
        by_rows = sorted(self._decode.items())
        return _interpolate([(r, _interpolate(c, context)) for r, c in by_rows], rows)
