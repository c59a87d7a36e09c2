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
from neuron_scheduler.sim.disaggregated import Pool, simulate_disaggregated
from neuron_scheduler.sim.disaggregated_metrics import disaggregated_metrics
from neuron_scheduler.sim.kv_transfer import TransferModel
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
    #: Disaggregated: this many prefill engines beside ``replicas`` decode
    #: engines (0: ``replicas`` colocated engines).
    prefill_engines: int = 0


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
    #: The prefill and decode pools of xPyD points (one pair per per-role
    #: config combination; a point's ``config`` indexes them) and the
    #: transfer.
    pools: tuple[tuple[Pool, Pool], ...] = ()
    transfer: TransferModel | None = None


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
    slos = job.slos
    if point.prefill_engines and not point.replicas:
        slos = [slo for slo in slos if slo.metric == "ttft"]
        stopped, metrics = _prefill_bound(job, point, specs, percentiles)
    elif point.prefill_engines:
        stopped, metrics = _disaggregated(job, point, specs, percentiles)
    else:
        result = simulate(
            specs,
            job.policies[point.config],
            job.settings,
            job.cost,
            replicas=point.replicas,
            router=job.router,
            stop_when=SLOWatch(job.slos, specs),
        )
        stopped = result.stopped_early
        metrics = compute_metrics(result, percentiles=percentiles)
    values = {str(slo): metrics[slo.key] for slo in slos}
    meets = not stopped and all(metrics[slo.key] <= slo.ms for slo in slos)
    if stopped:
        metrics = {}  # partial: not a run to quote
    return Evaluation(point, meets, stopped, values, metrics)


def _prefill_bound(
    job: PlanJob,
    point: Point,
    specs: list[RequestSpec],
    percentiles: tuple[float, ...],
) -> tuple[bool, dict[str, Any]]:
    """The prefill pool alone, every prompt's blocks freed at its end (as if
    the decode side took each at once): no xPyD with these prefill engines
    has a shorter TTFT, whatever its decode engines, so one that misses
    the TTFT SLOs here needs more prefill engines (the routing of a real
    pair differs, by the loads it sees: a bound up to that)."""
    prefill = job.pools[point.config][0]
    prompts_only = [replace(spec, output_len=1) for spec in specs]
    ttft_slos = [slo for slo in job.slos if slo.metric == "ttft"]
    result = simulate(
        prompts_only,
        prefill.policy,
        prefill.settings,
        prefill.cost,
        replicas=point.prefill_engines,
        router=job.router,
        stop_when=SLOWatch(ttft_slos, prompts_only),
    )
    return result.stopped_early, compute_metrics(result, percentiles=percentiles)


def _disaggregated(
    job: PlanJob,
    point: Point,
    specs: list[RequestSpec],
    percentiles: tuple[float, ...],
) -> tuple[bool, dict[str, Any]]:
    """An xPyD point's run: stopped early or not, and its metrics."""
    assert job.transfer is not None
    prefill, decode = job.pools[point.config]
    run = simulate_disaggregated(
        specs,
        replace(prefill, engines=point.prefill_engines),
        replace(decode, engines=point.replicas),
        job.transfer,
        router=job.router,
        stop_when=SLOWatch(job.slos, specs),
    )
    return run.stopped_early, disaggregated_metrics(run, percentiles=percentiles)


# ------------------------------------------------------------------ search


class ReplicaSearch:
    """The fewest replicas meeting the SLOs at one rate: lo fails (0 always
    does), hi meets; doubling finds hi, bisection closes the gap."""

    def __init__(
        self,
        config: int,
        rate: float | None,
        max_replicas: int,
        prefill_engines: int = 0,
    ) -> None:
        self.config, self.rate, self.max_replicas = config, rate, max_replicas
        #: Disaggregated: the replicas are decode engines beside these.
        self.prefill_engines = prefill_engines
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
        return [
            Point(self.config, c, self.rate, self.prefill_engines)
            for c in sorted(set(counts))
        ]

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


class DisaggregatedSearch:
    """The cheapest xPyD of one pair of pools (``config``: its index in
    ``PlanJob.pools``) meeting the SLOs at one rate: for x = 1, 2, ...
    prefill engines, the fewest decode engines (a ``ReplicaSearch`` capped
    at what would still cost less than the best found), until x prefill
    engines and one decode engine cost at least the best."""

    def __init__(
        self,
        rate: float | None,
        max_engines: int,
        prefill_chips: float,
        decode_chips: float,
        config: int = 0,
    ) -> None:
        self.config = config
        self.rate, self.max_engines = rate, max_engines
        self.prefill_chips, self.decode_chips = prefill_chips, decode_chips
        self.best: Evaluation | None = None
        self.evaluations: list[Evaluation] = []
        self._inner: ReplicaSearch | None = None
        #: The prefill engines whose TTFT bound is being checked (``None``:
        #: a decode search is under way, or the search is over).
        self._bound: int | None = 1

    def chips(self, point: Point) -> float:
        return (
            point.prefill_engines * self.prefill_chips
            + point.replicas * self.decode_chips
        )

    def done(self) -> bool:
        return self._inner is None and self._bound is None

    def next_points(self, width: int) -> list[Point]:
        """The prefill-only bound of the next prefill count (a point with
        0 decode engines, ``_prefill_bound``), then its decode search."""
        if self._bound is not None:
            return [Point(self.config, 0, self.rate, self._bound)]
        assert self._inner is not None
        return self._inner.next_points(width)

    def record(self, evaluation: Evaluation) -> None:
        self.evaluations.append(evaluation)
        if self._bound is not None:
            prefill, self._bound = self._bound, None
            if evaluation.meets:
                self._inner = self._next_inner(prefill)
            else:  # no decode pool helps: more prefill engines
                self._after(prefill)
            return
        inner = self._inner
        assert inner is not None
        inner.record(evaluation)
        if not inner.done():
            return
        found = inner.answer
        if found is not None and (
            self.best is None or self.chips(found.point) < self.chips(self.best.point)
        ):
            self.best = found
        self._inner = None
        self._after(inner.prefill_engines)

    def _after(self, prefill: int) -> None:
        """Go on to ``prefill`` + 1 engines' bound, if they can still win."""
        if self._next_inner(prefill + 1) is not None:
            self._bound = prefill + 1

    def _next_inner(self, prefill: int) -> ReplicaSearch | None:
        """The decode search for ``prefill`` engines, or ``None`` when
        none can beat the best."""
        budget = self.max_engines * (self.prefill_chips + self.decode_chips)
        if self.best is not None:
            budget = self.chips(self.best.point)
        room = (budget - prefill * self.prefill_chips) / self.decode_chips
        # Strictly cheaper than the best: fewer decode engines than ``room``.
        most = math.ceil(room) - 1 if self.best is not None else math.floor(room)
        most = min(most, self.max_engines)
        if prefill > self.max_engines or most < 1:
            return None
        return ReplicaSearch(self.config, self.rate, most, prefill)

    @property
    def answer(self) -> Evaluation | None:
        return self.best


Search = ReplicaSearch | RateSearch | DisaggregatedSearch


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
    chips: float | None
    if isinstance(search, DisaggregatedSearch):
        entry["rate"] = search.rate if search.rate is not None else own
        point = answer.point if answer else None
        entry["prefill_engines"] = point.prefill_engines if point else None
        entry["decode_engines"] = point.replicas if point else None
        entry["replicas"] = point.prefill_engines + point.replicas if point else None
        if point is None:
            entry["note"] = (
                f"no xPyD of at most {search.max_engines} engines a pool meets the SLOs"
            )
        chips = search.chips(point) if point else None
    elif isinstance(search, ReplicaSearch):
        entry["rate"] = search.rate if search.rate is not None else own
        entry["replicas"] = answer.point.replicas if answer else None
        if answer is None:
            entry["note"] = (
                f"more than --max-replicas {search.max_replicas} replicas needed"
            )
        chips = entry["replicas"] * chips_per_replica if answer else None
    else:
        entry["replicas"] = search.replicas
        entry["max_rate"] = answer.point.rate if answer else None
        if answer is None:
            entry["note"] = (
                f"{search.replicas} replicas sustain no rate of at least "
                f"{search.granularity:g} req/s"
            )
        chips = search.replicas * chips_per_replica
    entry["chips"] = chips
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
            **(
                {"prefill_engines": e.point.prefill_engines}
                if e.point.prefill_engines
                else {}
            ),
            **(
                {"prefill_bound": True}
                if e.point.prefill_engines and not e.point.replicas
                else {}
            ),
            "rate": e.point.rate if e.point.rate is not None else own,
            "meets": e.meets,
            "stopped_early": e.stopped_early,
            "values_ms": e.values if not e.stopped_early else None,
        }
        for e in sorted(
            search.evaluations,
            key=lambda e: (e.point.prefill_engines, e.point.replicas, e.point.rate),
        )
    ]
    return entry
