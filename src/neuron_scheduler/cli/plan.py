"""``neuron-scheduler plan``: the fewest replicas (or the highest rate)
meeting latency SLOs (``sim.planner``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from itertools import product
from typing import Any

from neuron_scheduler.cli.options import (
    add_disaggregation_arguments,
    add_engine_arguments,
    add_jobs_argument,
    add_policy_arguments,
    add_router_argument,
    add_workload_arguments,
    disaggregation_flags_given,
    disaggregation_options,
    engine_choice,
    output_file,
    positive_count,
    workload_options,
)
from neuron_scheduler.sim.cost_model import CostModel, RooflineCostModel
from neuron_scheduler.sim.disaggregated import Pool, PoolSizes, build_pools
from neuron_scheduler.sim.kv_transfer import TransferModel
from neuron_scheduler.sim.planner import (
    DEFAULT_MAX_REPLICAS,
    DisaggregatedSearch,
    PlanError,
    PlanJob,
    RateSearch,
    ReplicaSearch,
    Search,
    own_rate,
    plan_entry,
    run_searches,
)
from neuron_scheduler.sim.report import format_plans, plot_plans
from neuron_scheduler.sim.routing import RouterKind
from neuron_scheduler.sim.run_setup import describe_setup, engine_setup, policies
from neuron_scheduler.sim.slo import SLO
from neuron_scheduler.sim.workload import build_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    add_policy_arguments(
        parser,
        "a config to plan for (repeatable; default: seed and "
        "unconstrained when no --config is given)",
        "a NeuronScheduler config to plan for (repeatable; default: none)",
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
    add_router_argument(
        parser, "how requests are spread over replicas (default: %(default)s)"
    )
    parser.add_argument(
        "--price-per-hour",
        type=float,
        default=None,
        help="price of one accelerator chip per hour, for the fleet's cost "
        "(default: no cost column)",
    )
    add_jobs_argument(
        parser, "simulations run at once (default: all cores, %(default)s here)"
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        metavar="FILE",
        type=output_file,
        help="write the plans as JSON (default: no file)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        type=output_file,
        help="plot SLO attainment against the searched quantity (default: no plot)",
    )
    add_disaggregation_arguments(parser, searched=True)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    slos = [SLO.parse(text) for text in args.slo]
    _check_numbers(args)
    cost, settings = engine_setup(engine_choice(args))
    workload = workload_options(args)
    specs, fit = build_workload(workload, settings.max_model_len)
    chosen = policies(args.policy or [], args.config or [])
    base_rate = own_rate(specs)
    if math.isinf(base_rate) and args.rate is None and args.replicas is None:
        raise PlanError(
            "the workload arrives all at once: give --rate (or --request-rate) to "
            "plan replicas for"
        )
    print(
        describe_setup(workload.name, cost, settings, len(specs), fit), file=sys.stderr
    )
    pairs, transfer = _pools(args)
    job = PlanJob(
        specs,
        workload,
        chosen,
        settings,
        cost,
        slos,
        RouterKind(args.router),
        tuple(pools for _, pools in pairs),
        transfer,
    )
    searches = _searches(args, len(chosen), base_rate, slos)
    for index, (_, (prefill, decode)) in enumerate(pairs):
        searches.append(
            DisaggregatedSearch(
                args.rate,
                args.max_replicas,
                _chips(prefill.cost),
                _chips(decode.cost),
                config=index,
            )
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
    labels = [policy.label for policy in chosen] + [label for label, _ in pairs]
    plans = [
        plan_entry(
            labels[i], search, slos, _chips(cost), args.price_per_hour, base_rate
        )
        for i, search in enumerate(searches)
    ]
    for plan, (_, pools) in zip(plans[len(chosen) :], pairs, strict=True):
        for pool in pools:
            plan[f"{pool.role}_config"] = pool.policy.neuron_config
    print(format_plans(plans, slos))
    if args.json_path:
        document = {
            "settings": {
                **asdict(settings),
                "cost_model": cost.describe(),
                "workload": workload.name,
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


def _searches(
    args: argparse.Namespace, num_configs: int, base_rate: float, slos: list[SLO]
) -> list[Search]:
    """One search per config: the fewest replicas at ``--rate`` (default:
    the workload's own times), or with ``--replicas`` the highest rate; the
    question is said on stderr."""
    goal = " ".join(map(str, slos))
    if args.replicas is None:
        # None: the workload's own arrival times, as bench without a rate.
        rate = args.rate
        print(
            f"planning replicas for {rate or base_rate:.3g} req/s under {goal}",
            file=sys.stderr,
        )
        return [ReplicaSearch(i, rate, args.max_replicas) for i in range(num_configs)]
    start = base_rate if math.isfinite(base_rate) else 1.0
    print(
        f"planning the highest rate {args.replicas} replicas sustain (to "
        f"{args.rate_granularity:g} req/s) under {goal}",
        file=sys.stderr,
    )
    return [
        RateSearch(i, args.replicas, start, args.rate_granularity)
        for i in range(num_configs)
    ]


def _chips(cost: CostModel) -> float:
    """Chips one engine of ``cost`` takes (a profiled engine: 1)."""
    return cost.num_chips if isinstance(cost, RooflineCostModel) else 1.0


def _pools(
    args: argparse.Namespace,
) -> tuple[list[tuple[str, tuple[Pool, Pool]]], TransferModel | None]:
    """With ``--disaggregated``: a label and the pools (their sizes are the
    search's) for every prefill config with every decode config, and the
    transfer; the per-pool flags without it are refused."""
    if not args.disaggregated:
        stray = disaggregation_flags_given(args, searched=True)
        if stray:
            raise PlanError(f"{stray[0]} applies only with --disaggregated")
        return [], None
    if args.replicas is not None:
        raise PlanError(
            "--disaggregated plans engines for a rate; --replicas does not apply"
        )
    prefills = _role_configs("prefill", args.prefill_config)
    decodes = _role_configs("decode", args.decode_config)
    pairs = []
    transfer = None
    for (prefill_label, prefill), (decode_label, decode) in product(prefills, decodes):
        options = disaggregation_options(args, PoolSizes(1, 1), (prefill, decode))
        label = "disaggregated"
        if len(prefills) * len(decodes) > 1:
            label += f" P:{prefill_label} D:{decode_label}"
        pairs.append((label, build_pools(options, engine_choice(args))))
        transfer = options.transfer
    return pairs, transfer


def _role_configs(
    role: str, given: list[tuple[str, dict[str, Any]]] | None
) -> list[tuple[str, dict[str, Any]]]:
    """A role's configs, each labelled (an unlabelled one by its place:
    ``prefill1``, ...); none given: the design's, ``design``. ``PlanError``
    for a label given twice."""
    if not given:
        return [("design", {})]
    labelled = [
        (label or f"{role}{number}", config)
        for number, (label, config) in enumerate(given, 1)
    ]
    labels = [label for label, _ in labelled]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise PlanError(f"--{role}-config label {twice[0]!r} is given twice")
    return labelled


def _check_numbers(args: argparse.Namespace) -> None:
    """``PlanError`` naming a rate, granularity or price out of range."""
    if args.rate is not None and not args.rate > 0:
        raise PlanError(f"--rate must be > 0, got {args.rate}")
    if not args.rate_granularity > 0:
        raise PlanError(f"--rate-granularity must be > 0, got {args.rate_granularity}")
    if args.price_per_hour is not None and args.price_per_hour < 0:
        raise PlanError(f"--price-per-hour must be >= 0, got {args.price_per_hour}")
