"""A profile refitted to what steps cost where the engine serves.

A profile is measured on an in-process engine; a server adds per-step costs
the profile does not see (the engine core's hand-off to the worker, output
processing, the API server and the client sharing the machine's caches and
memory with the worker). The scheduler's step log
(``neuron_scheduler.step_log``) gives each served step's shape and the time
to the next step's start; for the steps where the engine was busy
throughout (the next step holds a request of this one), this module fits,
for prefill steps and for decode steps apart, ``served = scale x profiled +
overhead_s`` by least squares (one fit a kind for the whole run, never per
level) and scales every timing of the profile by its kind's fit. The kinds
differ: with the serving path kept off the worker's core, a CPU server's
prefill steps took what the profile says and its decode steps (bound by
memory, not arithmetic) ~13% longer, at every load. Where a kind's
profiled times do not spread enough to show a slope (the line's slope is
not positive by two standard errors: near-equal shapes on noisy cores),
its fit is the median ratio alone, ``served = ratio x profiled``, and says
so; a kind with fewer than ``MIN_STEPS`` busy steps keeps its profiled
times. The decode fit also carries how its served steps varied about the
machine's speed of the moment (``sim.step_jitter``), which the refitted
profile's cost model charges step by step. ``validate --calibrate`` fits
on its first level and simulates the others with the refitted profile.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.cost_model import StepShape
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.step_jitter import StepJitter
from neuron_scheduler.step import StepKind

#: Fewer busy steps of a kind than this give that kind no fit.
MIN_STEPS = 20

#: A line's slope counts when it is this many standard errors above 0.
MIN_SLOPE_SIGMAS = 2.0


class CalibrationError(ValueError):
    """The step log cannot be fitted (the message says why)."""


class FitMethod(str, Enum):
    """How a kind's ``scale`` and ``overhead_s`` were found."""

    LINE = "line"  # least squares over the kind's busy steps
    RATIO = "ratio"  # the median ratio, no overhead: the line's slope was lost
    KEPT = "kept"  # too few busy steps: the profiled times, unchanged


@dataclass(frozen=True)
class StepFit:
    """One kind of steps: ``served = scale x profiled + overhead_s`` over
    ``steps`` busy steps; ``median_ratio``: the median of served /
    profiled; ``line_slope``: the least-squares slope, ``scale`` or not
    (see ``method``); ``jitter``: the ``StepJitter`` quantiles of its
    steps about their window's speed (decode steps only; empty: none)."""

    scale: float
    overhead_s: float
    steps: int
    median_ratio: float
    method: FitMethod = FitMethod.LINE
    line_slope: float = 0.0
    jitter: tuple[float, ...] = ()

    def fitted(self, profiled_s: float) -> float:
        """What this fit charges a step profiled at ``profiled_s``."""
        return max(0.0, self.scale * profiled_s + self.overhead_s)


@dataclass(frozen=True)
class Calibration:
    """The fit of the prefill steps and that of the decode steps."""

    prefill_steps: StepFit
    decode_steps: StepFit

    def of(self, kind: StepKind) -> StepFit:
        return self.prefill_steps if kind is StepKind.PREFILL else self.decode_steps


def step_log_size(path: str | Path) -> int:
    """Bytes in a step log so far (0: none yet): where to read on from."""
    try:
        return Path(path).stat().st_size
    except FileNotFoundError:
        return 0


def read_step_log(
    path: str | Path, offset: int = 0, end: int | None = None
) -> list[dict[str, Any]]:
    """The lines of a step log from byte ``offset`` on, to byte ``end``
    (``None``: the end; a missing file: none)."""
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            text = log.read(-1 if end is None else max(0, end - offset)).decode()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def level_spans(
    lines: Sequence[dict[str, Any]], served: Sequence[int]
) -> list[tuple[int, int]]:
    """Each level's first and last index in ``lines``, a step log of levels
    run one after another, ``served[i]`` requests served in level ``i`` (a
    request the server rejected never reaches the log), in the order the
    log first names them. ``CalibrationError`` where the log names another
    number of requests."""
    order: list[str] = []
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for index, line in enumerate(lines):
        for request in line["ids"]:
            if request not in first:
                first[request] = index
                order.append(request)
            last[request] = index
    if len(order) != sum(served):
        raise CalibrationError(
            f"the step log names {len(order)} requests; the levels served "
            f"{sum(served)} ({', '.join(map(str, served))})"
        )
    spans, start = [], 0
    for count in served:
        requests = order[start : start + count]
        start += count
        spans.append((min(first[r] for r in requests), max(last[r] for r in requests)))
    return spans


def level_lines(
    lines: Sequence[dict[str, Any]], served: Sequence[int]
) -> list[list[dict[str, Any]]]:
    """Each level's lines (``level_spans``' levels) as ``validate`` reads
    them while it runs: from the level's first line to the next level's
    first, the last level's to the end, so that the empty step after a
    level's last step (which times a pair's prefill step) is the level's."""
    firsts = [first for first, _ in level_spans(lines, served)]
    ends = [*firsts[1:], len(lines)]
    return [list(lines[a:b]) for a, b in zip(firsts, ends, strict=True)]


def line_shape(line: dict[str, Any]) -> StepShape | None:
    """The shape a logged step ran as (``None``: an empty step)."""
    if line["kind"] == "prefill":
        return StepShape(
            tuple((int(t), int(b)) for t, b in line["chunks"]),
            prefill_tokens_actual=sum(line.get("scheduled", ())),
        )
    if line["kind"] == "decode":
        return StepShape(
            (), line["rows"], line["context"], True,
            line["context_actual"], line["rows_actual"],
        )  # fmt: skip
    return None


def busy_lines(
    lines: Sequence[dict[str, Any]], until_empty: bool = False
) -> Iterator[tuple[int, StepShape, float]]:
    """Each logged step whose next step holds one of its requests (the
    engine had work throughout, so the gap is the step's cost): its index
    in ``lines``, its shape and the seconds to that next step's start.
    ``until_empty``: a prefill engine of a disaggregated pair, whose
    requests end in the one step that prefills them: also a step followed
    by an empty one, which the engine core runs as soon as the step's
    output is in, and a step that left requests waiting (the scheduler
    held more than it took), whose next step starts as soon as it ends:
    under a queue, every step."""
    for index, (line, following) in enumerate(zip(lines, lines[1:], strict=False)):
        shape = line_shape(line)
        if shape is None:
            continue
        ended = until_empty and (following["kind"] == "empty" or _left_waiting(line))
        if ended or set(line["ids"]) & set(following["ids"]):
            yield index, shape, following["t"] - line["t"]


def _left_waiting(line: dict[str, Any]) -> bool:
    """The step began with more requests than it ran (``running`` and
    ``waiting`` counted when it began; a line without them: no)."""
    held = line.get("running", 0) + line.get("waiting", 0)
    return held > len(line["ids"])


def busy_steps(
    lines: Sequence[dict[str, Any]],
    until_empty: bool = False,
    besides_s: Sequence[float] | None = None,
) -> list[tuple[StepShape, float]]:
    """``busy_lines``' shapes and seconds, less ``besides_s`` of the step
    where given (one a line)."""
    return [
        (shape, seconds - (besides_s[index] if besides_s is not None else 0.0))
        for index, shape, seconds in busy_lines(lines, until_empty)
    ]


def fit(
    profile: Profile,
    lines: Sequence[dict[str, Any]],
    until_empty: bool = False,
    besides_s: Sequence[float] | None = None,
) -> Calibration:
    """Fit the served step times of ``lines`` (``busy_steps``) to
    ``profile``'s, prefill and decode steps apart; ``besides_s``: what the
    simulator charges each step beside its profile (a KV connector's
    reads and writes), taken off the served time first so that it is not
    counted twice. ``CalibrationError`` when neither kind has
    ``MIN_STEPS`` busy steps."""
    cost = ProfileCostModel(profile, interpolate=True)
    by_kind: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for index, shape, seconds in busy_lines(lines, until_empty):
        seconds -= besides_s[index] if besides_s is not None else 0.0
        step = (lines[index]["t"], cost.estimate(shape), seconds)
        by_kind[bool(shape.prefill_chunks)].append(step)
    prefills, decodes = by_kind[True], by_kind[False]
    if len(prefills) < MIN_STEPS and len(decodes) < MIN_STEPS:
        raise CalibrationError(
            f"the step log has {len(prefills) + len(decodes)} busy steps "
            f"({len(prefills)} prefill, {len(decodes)} decode); a fit needs "
            f"{MIN_STEPS} of a kind"
        )
    decode = _fit_kind(decodes)
    if decode.method is not FitMethod.KEPT:
        around = [(t, decode.fitted(p), s) for t, p, s in decodes]
        decode = replace(decode, jitter=StepJitter.about_windows(around).quantiles)
    return Calibration(_fit_kind(prefills), decode)


def _fit_kind(steps: Sequence[tuple[float, float, float]]) -> StepFit:
    """One kind's fit over its (start, profiled, served) seconds
    (``median_ratio`` 0.0: no step)."""
    profiled = np.array([p for _, p, _ in steps])
    served = np.array([s for _, _, s in steps])
    ratio = float(np.median(served / profiled)) if steps else 0.0
    if len(steps) < MIN_STEPS:
        return StepFit(1.0, 0.0, len(steps), ratio, FitMethod.KEPT)
    slope, overhead, sigma = _line(profiled, served)
    if slope > MIN_SLOPE_SIGMAS * sigma:
        return StepFit(slope, overhead, len(steps), ratio, FitMethod.LINE, slope)
    return StepFit(ratio, 0.0, len(steps), ratio, FitMethod.RATIO, slope)


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least-squares ``y = slope x + intercept`` and the slope's standard
    error (infinite where ``x`` does not vary)."""
    if float(np.ptp(x)) <= 1e-12 * float(np.max(np.abs(x))):
        return 0.0, float(np.mean(y)), float("inf")
    (slope, intercept), cov = np.polyfit(x, y, 1, cov=True)
    return float(slope), float(intercept), float(np.sqrt(max(cov[0, 0], 0.0)))


def calibrated(profile: Profile, calibration: Calibration) -> Profile:
    """``profile`` with every sample ``scale x s + overhead_s`` (at least 0)
    of its kind's fit, the calibration recorded in its ``meta`` (where
    its cost model finds the decode steps' jitter)."""

    def refit(samples: tuple[float, ...], fit: StepFit) -> tuple[float, ...]:
        return tuple(fit.fitted(s) for s in samples)

    timings = tuple(
        replace(t, samples_s=refit(t.samples_s, calibration.of(t.kind)))
        for t in profile.timings
    )
    meta = {**profile.meta, "calibration": asdict(calibration)}
    return replace(profile, timings=timings, meta=meta)


def scaled(profile: Profile, factor: float) -> Profile:
    """``profile`` with every sample ``factor`` times what it was."""
    timings = tuple(
        replace(t, samples_s=tuple(factor * s for s in t.samples_s))
        for t in profile.timings
    )
    return replace(profile, timings=timings)
