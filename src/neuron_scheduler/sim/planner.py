"""The capacity planner: how many engines a workload needs under SLOs.

For each config (``--policy`` / ``--config``, as ``bench``): with a rate
(``--rate``, default the workload's own), the fewest replicas whose fleet
meets every SLO; with ``--replicas N``, the highest rate N replicas sustain
(to ``--rate-granularity``). Each answer comes from full ``bench``-style
fleet simulations (``simulate(replicas=N)``), so the plan's N meets the SLOs
in a ``bench --replicas N`` run of the same workload, and N-1 is a run it
evaluated and saw fail. A rate is applied as ``bench --request-rate`` applies
it (new Gamma arrivals, ``--burstiness``, ``--seed``): ``plan --rate R``
answers for ``bench --request-rate R``; without ``--rate`` the workload keeps
its own times.

Search: doubling from 1 (or from the rate) until the SLOs flip, then
bisection; each round evaluates up to ``--jobs / configs`` points at once,
in a process pool. A run stops as soon as its finished requests alone make
an SLO unreachable (see ``SLOWatch``): failing runs are the cheap ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.sim.cost_model import CostModel
from neuron_scheduler.sim.policies import Policy
from neuron_scheduler.sim.records import RequestRecord
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.routing import RouterKind
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.slo import SLO
from neuron_scheduler.sim.workload import RequestSpec, WorkloadOptions, build_workload

DEFAULT_MAX_REPLICAS = 64


class PlanError(ValueError):
    """Bad plan input, named."""


class SLOWatch:
    """Stops a run once its finished requests alone make an SLO miss certain:
    when more values exceed the target than the percentile allows even if
    every value still to come is within it (``v >= (1 - p/100)(n - 1) + 2``
    of ``n`` values puts both points numpy's percentile interpolates between
    above the target). TTFT, TPOT and E2EL only (ITL counts are not known in
    advance)."""

    def __init__(self, slos: Sequence[SLO], specs: Sequence[RequestSpec]) -> None:
        served = [s for s in specs if not s.rejected]
        counts = {
            "ttft": len(served),
            "e2el": len(served),
            "tpot": sum(1 for s in served if s.output_len > 1),
        }
        self._limits = [
            (slo, (1 - _percentile(slo) / 100) * (counts[slo.metric] - 1) + 2)
            for slo in slos
            if slo.metric in counts
        ]
        self._violations = [0] * len(self._limits)

    def __call__(self, record: RequestRecord) -> bool:
        values = record.latencies_ms()
        for i, (slo, limit) in enumerate(self._limits):
            value = values.get(slo.metric)
            if value is not None and value > slo.ms:
                self._violations[i] += 1
                if self._violations[i] >= limit:
                    return True
        return False


def _percentile(slo: SLO) -> float:
    assert slo.percentile is not None, f"{slo}: plan's SLOs are percentiles"
    return slo.percentile


@dataclass(frozen=True)
class Point:
    """One evaluation: a config, a replica count, a request rate (``None``:
    the workload's own arrival times)."""

    config: int
    replicas: int
    rate: float | None


@dataclass
class Evaluation:
    point: Point
    meets: bool
    stopped_early: bool
    values: dict[str, float]
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanJob:
    """Everything a worker needs to evaluate points (pickled to it):
    ``specs`` at the workload's own times, and the workload options that
    build it at another rate."""

    specs: list[RequestSpec]
    workload: WorkloadOptions
    policies: list[Policy]
    settings: EngineSettings
    cost: CostModel
    slos: list[SLO]
    router: RouterKind


def own_rate(specs: Sequence[RequestSpec]) -> float:
    """Mean request rate of ``specs``' arrival times (``inf``: all at once)."""
    times = sorted(s.arrival_s for s in specs)
    span = times[-1] - times[0] if times else 0.0
    return (len(times) - 1) / span if span > 0 else math.inf


def workload_at(job: PlanJob, rate: float | None) -> list[RequestSpec]:
    """The workload as ``bench --request-rate rate`` builds it."""
    if rate is None:
        return job.specs
    options = replace(job.workload, request_rate=rate)
    return build_workload(options, job.settings.max_model_len)[0]


def evaluate(job: PlanJob, point: Point) -> Evaluation:
    """Simulate ``point`` and judge it against every SLO."""
    specs = workload_at(job, point.rate)
    percentiles = tuple(sorted({slo.percentile for slo in job.slos if slo.percentile}))
    result = simulate(
        specs,
        job.policies[point.config],
        job.settings,
        job.cost,
        replicas=point.replicas,
        router=job.router,
        stop_when=SLOWatch(job.slos, specs),
    )
    metrics = compute_metrics(result, percentiles=percentiles)
    values = {str(slo): metrics[slo.key] for slo in job.slos}
    meets = not result.stopped_early and all(
        metrics[slo.key] <= slo.ms for slo in job.slos
    )
    if result.stopped_early:
        metrics = {}  # partial: not a run to quote
    return Evaluation(point, meets, result.stopped_early, values, metrics)


# ------------------------------------------------------------------ search


class ReplicaSearch:
    """The fewest replicas meeting the SLOs at one rate: lo fails (0 always
    does), hi meets; doubling finds hi, bisection closes the gap."""

    def __init__(self, config: int, rate: float | None, max_replicas: int) -> None:
        self.config, self.rate, self.max_replicas = config, rate, max_replicas
        self.lo = 0
        self.hi: int | None = None
        self.evaluations: list[Evaluation] = []

    def done(self) -> bool:
        if self.hi is None:
            return self.lo >= self.max_replicas
        return self.hi - self.lo <= 1

    def next_points(self, width: int) -> list[Point]:
        if self.hi is None:
            first = 1 if self.lo == 0 else 2 * self.lo
            counts = [min(self.max_replicas, first * 2**i) for i in range(width)]
        else:
            gap = (self.hi - self.lo) / (width + 1)
            counts = [self.lo + max(1, round(gap * (i + 1))) for i in range(width)]
            counts = [c for c in counts if self.lo < c < self.hi]
        return [Point(self.config, c, self.rate) for c in sorted(set(counts))]

    def record(self, evaluation: Evaluation) -> None:
        self.evaluations.append(evaluation)
        count = evaluation.point.replicas
        if evaluation.meets:
            self.hi = count if self.hi is None else min(self.hi, count)
        elif self.hi is None or count < self.hi:
            self.lo = max(self.lo, count)

    @property
    def answer(self) -> Evaluation | None:
        if self.hi is None:
            return None
        return next(e for e in self.evaluations if e.point.replicas == self.hi)


class RateSearch:
    """The highest rate (a multiple of ``granularity``) ``replicas`` sustain:
    lo meets (0 always does), hi fails; doubling from the workload's own
    rate finds the bracket, bisection closes it."""

    def __init__(
        self, config: int, replicas: int, start: float, granularity: float
    ) -> None:
        self.config, self.replicas, self.granularity = config, replicas, granularity
        #: Rates are whole multiples of the granularity: counted in steps.
        self.start = max(1, round(start / granularity))
        self.lo = 0
        self.hi: int | None = None
        self.evaluations: list[Evaluation] = []

    def _steps(self, evaluation: Evaluation) -> int:
        assert evaluation.point.rate is not None
        return round(evaluation.point.rate / self.granularity)

    def done(self) -> bool:
        return self.hi is not None and self.hi - self.lo <= 1

    def next_points(self, width: int) -> list[Point]:
        if self.hi is None:
            first = self.start if self.lo == 0 else 2 * self.lo
            steps = [first * 2**i for i in range(width)]
        else:
            gap = (self.hi - self.lo) / (width + 1)
            steps = [self.lo + max(1, round(gap * (i + 1))) for i in range(width)]
            steps = [s for s in steps if self.lo < s < self.hi]
        return [
            Point(self.config, self.replicas, round(s * self.granularity, 9))
            for s in sorted(set(steps))
        ]

    def record(self, evaluation: Evaluation) -> None:
        self.evaluations.append(evaluation)
        steps = self._steps(evaluation)
        if evaluation.meets:
            self.lo = max(self.lo, steps)
        else:
            self.hi = steps if self.hi is None else min(self.hi, steps)
        if self.hi is not None and self.lo >= self.hi:
            # Not monotone here: keep the highest success below the lowest
            # failure.
            self.lo = max(
                (self._steps(e) for e in self.evaluations
                 if e.meets and self._steps(e) < self.hi),
                default=0,
            )  # fmt: skip

    @property
    def answer(self) -> Evaluation | None:
        return next(
            (e for e in self.evaluations if e.meets and self._steps(e) == self.lo),
            None,
        )


Search = ReplicaSearch | RateSearch


def run_searches(
    job: PlanJob,
    searches: list[Search],
    jobs: int,
    on_evaluation: Callable[[Evaluation], None] | None = None,
) -> None:
    """Drive every search to its end, evaluating each round's points of all
    searches together (in ``jobs`` processes; inline with 1)."""
    width = max(1, jobs // max(1, len(searches)))
    pool = ProcessPoolExecutor(jobs) if jobs > 1 else None
    try:
        while True:
            pending = [
                (search, point)
                for search in searches
                if not search.done()
                for point in search.next_points(width)
            ]
            if not pending:
                return
            for search, evaluation in zip(
                (s for s, _ in pending),
                _evaluate_all(job, [p for _, p in pending], pool),
                strict=True,
            ):
                search.record(evaluation)
                if on_evaluation is not None:
                    on_evaluation(evaluation)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


def _evaluate_all(
    job: PlanJob, points: list[Point], pool: ProcessPoolExecutor | None
) -> Iterator[Evaluation]:
    if pool is None:
        for point in points:
            yield evaluate(job, point)
        return
    futures: list[Future[Evaluation]] = [
        pool.submit(evaluate, job, point) for point in points
    ]
    for future in futures:
        yield future.result()


def plan_entry(
    label: str,
    search: Search,
    slos: list[SLO],
    chips_per_replica: float,
    price_per_hour: float | None,
    own: float,
) -> dict[str, Any]:
    """One config's plan as ``plan --json`` writes it: the answer, its chips
    and cost, each SLO at it, its metrics, and every evaluation."""
    answer = search.answer
    entry: dict[str, Any] = {"label": label}
    if isinstance(search, ReplicaSearch):
        entry["rate"] = search.rate if search.rate is not None else own
        entry["replicas"] = answer.point.replicas if answer else None
        if answer is None:
            entry["note"] = (
                f"more than --max-replicas {search.max_replicas} replicas needed"
            )
        replicas = entry["replicas"]
    else:
        entry["replicas"] = search.replicas
        entry["max_rate"] = answer.point.rate if answer else None
        if answer is None:
            entry["note"] = (
                f"{search.replicas} replicas sustain no rate of at least "
                f"{search.granularity:g} req/s"
            )
        replicas = search.replicas
    entry["chips"] = replicas * chips_per_replica if replicas else None
    if price_per_hour is not None and entry["chips"] is not None:
        entry["cost_per_hour"] = entry["chips"] * price_per_hour
    entry["slos"] = {
        str(slo): {
            "target_ms": slo.ms,
            "value_ms": answer.values[str(slo)] if answer else None,
            "met": bool(answer),
        }
        for slo in slos
    }
    entry["metrics"] = answer.metrics if answer else None
    entry["evaluations"] = [
        {
            "replicas": e.point.replicas,
            "rate": e.point.rate if e.point.rate is not None else own,
            "meets": e.meets,
            "stopped_early": e.stopped_early,
            "values_ms": e.values if not e.stopped_early else None,
        }
        for e in sorted(
            search.evaluations, key=lambda e: (e.point.replicas, e.point.rate)
        )
    ]
    return entry
