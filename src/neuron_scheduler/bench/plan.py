"""``neuron-scheduler plan``: how many engines a workload needs under SLOs.

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

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from neuron_scheduler.bench.command import (
    add_engine_arguments,
    add_workload_arguments,
    build_workload,
    describe_setup,
    engine_setup,
    policies,
    workload_name,
)
from neuron_scheduler.bench.cost_model import CostModel, RooflineCostModel
from neuron_scheduler.bench.engines import (
    Policy,
    RequestRecord,
)
from neuron_scheduler.bench.metrics import (
    GoodputSLO,
    compute_metrics,
    parse_percentile,
    percentile_key,
)
from neuron_scheduler.bench.routing import RoutingPolicy
from neuron_scheduler.bench.simulate import simulate
from neuron_scheduler.bench.workload import RequestSpec
from neuron_scheduler.harness import EngineSettings

#: Latency metrics an SLO can name, as ``bench`` reports them.
SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_MAX_REPLICAS = 64


class PlanError(ValueError):
    """Bad plan input, named."""


@dataclass(frozen=True)
class SLO:
    """``metric``'s ``percentile`` must be at most ``ms`` milliseconds."""

    metric: str
    percentile: float
    ms: float

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``ttft:p90:2000`` (the ``p`` is optional); ``PlanError`` naming
        the text and what is wrong."""
        parts = text.split(":")
        if len(parts) != 3:
            raise PlanError(f"--slo {text!r}: expected METRIC:pPERCENTILE:MS")
        metric, percentile_text, ms_text = parts
        if metric not in SLO_METRICS:
            raise PlanError(
                f"--slo {text!r}: unknown metric {metric!r} (one of "
                f"{', '.join(SLO_METRICS)})"
            )
        try:
            percentile = parse_percentile(percentile_text, f"--slo {text!r}")
            ms = float(ms_text)
        except ValueError as error:
            message = (
                str(error)
                if "--slo" in str(error)
                else (f"--slo {text!r}: milliseconds {ms_text!r} is not a number")
            )
            raise PlanError(message) from None
        if not ms > 0:
            raise PlanError(f"--slo {text!r}: milliseconds must be > 0")
        return cls(metric, percentile, ms)

    @property
    def key(self) -> str:
        """The ``bench`` metric key: ``p90_ttft_ms``."""
        return f"{percentile_key(self.percentile)}_{self.metric}_ms"

    def __str__(self) -> str:
        return f"{self.metric}:{percentile_key(self.percentile)}:{self.ms:g}"


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
            (slo, (1 - slo.percentile / 100) * (counts[slo.metric] - 1) + 2)
            for slo in slos
            if slo.metric in counts
        ]
        self._violations = [0] * len(self._limits)

    def __call__(self, record: RequestRecord) -> bool:
        ttft = (record.first_token_s - record.arrival_s) * 1e3
        values = {"ttft": ttft, "e2el": (record.finish_s - record.arrival_s) * 1e3}
        if record.num_tokens > 1:
            values["tpot"] = (
                (record.finish_s - record.first_token_s) * 1e3 / (record.num_tokens - 1)
            )
        for i, (slo, limit) in enumerate(self._limits):
            value = values.get(slo.metric)
            if value is not None and value > slo.ms:
                self._violations[i] += 1
                if self._violations[i] >= limit:
                    return True
        return False


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
    ``specs`` at the workload's own times, and the workload arguments that
    build it at another rate."""

    specs: list[RequestSpec]
    workload_args: argparse.Namespace
    policies: list[Policy]
    settings: EngineSettings
    cost: CostModel
    slos: list[SLO]
    router: RoutingPolicy


def own_rate(specs: Sequence[RequestSpec]) -> float:
    """Mean request rate of ``specs``' arrival times (``inf``: all at once)."""
    times = sorted(s.arrival_s for s in specs)
    span = times[-1] - times[0] if times else 0.0
    return (len(times) - 1) / span if span > 0 else math.inf


def workload_at(job: PlanJob, rate: float | None) -> list[RequestSpec]:
    """The workload as ``bench --request-rate rate`` builds it."""
    if rate is None:
        return job.specs
    args = argparse.Namespace(**{**vars(job.workload_args), "request_rate": rate})
    return build_workload(args, job.settings.max_model_len)[0]


def evaluate(job: PlanJob, point: Point) -> Evaluation:
    """Simulate ``point`` and judge it against every SLO."""
    specs = workload_at(job, point.rate)
    percentiles = tuple(sorted({slo.percentile for slo in job.slos}))
    result = simulate(
        specs,
        job.policies[point.config],
        job.settings,
        job.cost,
        replicas=point.replicas,
        router=job.router,
        stop_when=SLOWatch(job.slos, specs),
    )
    metrics = compute_metrics(result, GoodputSLO(), percentiles)
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


# ------------------------------------------------------------------ command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from neuron_scheduler.bench.command import (
        labelled_config,
        positive_count,
        usable_cores,
    )

    add_workload_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument(
        "--slo",
        nargs="+",
        required=True,
        metavar="METRIC:pP:MS",
        help="service-level objectives, all to be met: metric (ttft, tpot, itl, "
        "e2el), percentile, milliseconds, e.g. ttft:p90:2000 tpot:p99:100 "
        "(required; no default)",
    )
    parser.add_argument(
        "--policy",
        action="append",
        choices=["seed", "unconstrained"],
        help="a config to plan for (repeatable; default: seed and "
        "unconstrained when no --config is given)",
    )
    parser.add_argument(
        "--config",
        action="append",
        type=labelled_config,
        metavar="LABEL=JSON",
        help="a NeuronScheduler config to plan for (repeatable; default: none)",
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--rate",
        type=float,
        default=None,
        help="request rate to serve: answer the fewest replicas (default: the "
        "workload's own rate)",
    )
    target.add_argument(
        "--replicas",
        type=positive_count,
        default=None,
        help="replicas available: answer the highest rate they sustain "
        "(default: off, plan replicas for --rate)",
    )
    parser.add_argument(
        "--rate-granularity",
        type=float,
        default=0.1,
        help="with --replicas, the step of the rate search in req/s (default: "
        "%(default)s)",
    )
    parser.add_argument(
        "--max-replicas",
        type=positive_count,
        default=DEFAULT_MAX_REPLICAS,
        help="the most replicas to consider (default: %(default)s)",
    )
    parser.add_argument(
        "--router",
        choices=[p.value for p in RoutingPolicy],
        default=RoutingPolicy.VLLM.value,
        help="how requests are spread over replicas (default: %(default)s)",
    )
    parser.add_argument(
        "--price-per-hour",
        type=float,
        default=None,
        help="price of one accelerator chip per hour, for the fleet's cost "
        "(default: no cost column)",
    )
    parser.add_argument(
        "--jobs",
        type=positive_count,
        default=usable_cores(),
        help="simulations run at once (default: all cores, %(default)s here)",
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        metavar="FILE",
        help="write the plans as JSON (default: no file)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="plot SLO attainment against the searched quantity (default: no plot)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    slos = [SLO.parse(text) for text in args.slo]
    if args.rate is not None and not args.rate > 0:
        raise PlanError(f"--rate must be > 0, got {args.rate}")
    if not args.rate_granularity > 0:
        raise PlanError(f"--rate-granularity must be > 0, got {args.rate_granularity}")
    if args.price_per_hour is not None and args.price_per_hour < 0:
        raise PlanError(f"--price-per-hour must be >= 0, got {args.price_per_hour}")
    cost, settings = engine_setup(args)
    specs, fit = build_workload(args, settings.max_model_len)
    chosen = policies(args)
    base_rate = own_rate(specs)
    if math.isinf(base_rate) and args.rate is None and args.replicas is None:
        raise PlanError(
            "the workload arrives all at once: give --rate (or --request-rate) to "
            "plan replicas for"
        )
    print(describe_setup(args, cost, settings, len(specs), fit), file=sys.stderr)
    job = PlanJob(specs, args, chosen, settings, cost, slos, RoutingPolicy(args.router))
    searches: list[Search]
    if args.replicas is None:
        # None: the workload's own arrival times, as bench without a rate.
        rate = args.rate
        searches = [
            ReplicaSearch(i, rate, args.max_replicas) for i in range(len(chosen))
        ]
        print(
            f"planning replicas for {rate or base_rate:.3g} req/s under "
            f"{' '.join(map(str, slos))}",
            file=sys.stderr,
        )
    else:
        start = base_rate if math.isfinite(base_rate) else 1.0
        searches = [
            RateSearch(i, args.replicas, start, args.rate_granularity)
            for i in range(len(chosen))
        ]
        print(
            f"planning the highest rate {args.replicas} replicas sustain (to "
            f"{args.rate_granularity:g} req/s) under {' '.join(map(str, slos))}",
            file=sys.stderr,
        )
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(desc="simulations", unit="run")
    run_searches(
        job,
        searches,
        args.jobs,
        (lambda _e: progress.update(1)) if progress is not None else None,
    )
    if progress is not None:
        progress.close()
    chips = cost.num_chips if isinstance(cost, RooflineCostModel) else 1.0
    plans = [
        _plan_entry(chosen[i].label, search, slos, chips, args, base_rate)
        for i, search in enumerate(searches)
    ]
    print(format_plans(plans, slos))
    if args.json_path:
        document = {
            "settings": {
                **asdict(settings),
                "cost_model": cost.describe(),
                "workload": workload_name(args),
                "num_requests": len(specs),
                "own_rate": base_rate,
                "router": args.router,
                "slos": [str(s) for s in slos],
                "max_replicas": args.max_replicas,
                "rate_granularity": args.rate_granularity,
            },
            "plans": plans,
        }
        with open(args.json_path, "w") as handle:
            json.dump(document, handle, indent=2)
    if args.plot:
        plot_plans(plans, slos, args.plot)
    return 0


def _plan_entry(
    label: str,
    search: Search,
    slos: list[SLO],
    chips_per_replica: float,
    args: argparse.Namespace,
    own: float,
) -> dict[str, Any]:
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
    if args.price_per_hour is not None and entry["chips"] is not None:
        entry["cost_per_hour"] = entry["chips"] * args.price_per_hour
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


def format_plans(plans: list[dict[str, Any]], slos: list[SLO]) -> str:
    """One line per config: the answer, chips, cost, each SLO at it."""
    header = f"{'config':<28}{'replicas':>9}{'rate req/s':>12}{'chips':>8}"
    if any("cost_per_hour" in p for p in plans):
        header += f"{'cost/h':>10}"
    header += "".join(f"{str(s):>22}" for s in slos)
    lines = [header]
    for plan in plans:
        rate = plan.get("max_rate", plan.get("rate"))
        line = (
            f"{plan['label']:<28}"
            f"{_cell(plan['replicas'], '{:d}'):>9}"
            f"{_cell(rate, '{:.2f}'):>12}"
            f"{_cell(plan['chips'], '{:g}'):>8}"
        )
        if any("cost_per_hour" in p for p in plans):
            line += f"{_cell(plan.get('cost_per_hour'), '{:.2f}'):>10}"
        for slo in slos:
            value = plan["slos"][str(slo)]["value_ms"]
            line += f"{_cell(value, '{:.0f} ms'):>22}"
        lines.append(line)
        if "note" in plan:
            lines.append(f"  {plan['note']}")
    return "\n".join(lines)


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def plot_plans(plans: list[dict[str, Any]], slos: list[SLO], path: str) -> None:
    """Each SLO's value as a share of its target (at or below 1 meets)
    against the searched quantity, one line per config; runs stopped early
    (a miss certain) are crosses above the line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(slos), figsize=(5 * len(slos), 4), squeeze=False)
    by_rate = "max_rate" in plans[0]
    for axis, slo in zip(axes[0], slos, strict=True):
        for number, plan in enumerate(plans):
            color = f"C{number}"
            xs, ys, missed = [], [], []
            for e in plan["evaluations"]:
                x = e["rate"] if by_rate else e["replicas"]
                if e["values_ms"] is None:
                    missed.append(x)
                else:
                    xs.append(x)
                    ys.append(e["values_ms"][str(slo)] / slo.ms)
            axis.plot(xs, ys, marker="o", color=color, label=plan["label"])
            if missed:
                top = max([2.0, *ys])
                axis.scatter(missed, [top] * len(missed), marker="x", color=color)
        axis.axhline(1.0, color="grey", linestyle="--")
        axis.set_yscale("log")
        axis.set_xlabel("request rate (req/s)" if by_rate else "replicas")
        axis.set_ylabel(f"{slo} / target (x: missed, run stopped early)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)
