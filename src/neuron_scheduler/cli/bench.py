"""``neuron-scheduler bench``: simulate a workload through the real
schedulers on a cost model, and print or write the results."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from typing import Any

from neuron_scheduler.cli.options import (
    add_disaggregation_arguments,
    add_engine_arguments,
    add_goodput_argument,
    add_jobs_argument,
    add_policy_arguments,
    add_router_argument,
    add_workload_arguments,
    disaggregation_flags_given,
    engine_choice,
    output_file,
    percentiles_argument,
    positive_count,
    workload_options,
)
from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.sim.cost_model import CostModel
from neuron_scheduler.sim.policies import Policy
from neuron_scheduler.sim.records import RunResult
from neuron_scheduler.sim.report import format_table, plot
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.routing import RouterKind
from neuron_scheduler.sim.run_setup import (
    check_profile_covers,
    describe_setup,
    engine_setup,
    policies,
)
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.slo import SLO, parse_goodput
from neuron_scheduler.sim.time_breakdown import never_mix_lower_bound
from neuron_scheduler.sim.workload import RequestSpec, build_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_policy_arguments(
        parser,
        "seed: NeuronScheduler with the design's defaults; unconstrained: "
        "vLLM's scheduler, dynamic shapes (repeatable; default: both)",
        "a NeuronScheduler with this neuron_config (repeatable; default: "
        "none besides --policy)",
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--max-concurrency",
        type=positive_count,
        default=None,
        help="at most this many requests in flight, as vllm bench serve "
        "(default: no limit)",
    )
    add_engine_arguments(parser)
    parser.add_argument(
        "--replicas",
        type=positive_count,
        default=1,
        help="simulate this many engines (each a real scheduler with its own KV "
        "cache) behind --router, on one virtual clock (default: %(default)s)",
    )
    add_router_argument(
        parser,
        "how requests are spread over --replicas: vllm (vLLM 0.32's own "
        "data-parallel load balancing), round-robin, least-loaded (default: "
        "%(default)s)",
    )
    add_disaggregation_arguments(parser)
    add_jobs_argument(
        parser,
        "processes that step a fleet's engines (--replicas > 1; the "
        "results are the same for any value; default: all cores, "
        "%(default)s here)",
    )
    parser.add_argument(
        "--metric-percentiles",
        type=percentiles_argument,
        default=(),
        metavar="P,P,...",
        help="also report these percentiles of each latency (as vllm bench "
        "serve, e.g. 50,90,99; default: mean, median and p99 only)",
    )
    add_goodput_argument(parser)
    parser.add_argument(
        "--json",
        dest="json_path",
        metavar="FILE",
        type=output_file,
        help="write the results as JSON (default: no file)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        type=output_file,
        help="plot latency CDFs, padding, running (default: no plot)",
    )
    parser.add_argument(
        "--save-detailed", action="store_true", help="per-request records in --json"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (default: shown)"
    )
    parser.add_argument(
        "--overhead",
        action="store_true",
        help="time schedule() overhead vs the stock Scheduler instead",
    )
    parser.add_argument(
        "--overhead-steps",
        type=int,
        default=200,
        help="steps timed per size with --overhead (default: 200)",
    )
    parser.add_argument(
        "--published",
        action="store_true",
        help="instead: replay every published Neuron vLLM benchmark point "
        "(sim.published) and print published vs simulated",
    )


#: The modes of ``bench`` that replace the simulation, and the flags each
#: reads besides its own; any other flag given with one is refused.
MODE_FLAGS = {
    "overhead": {"overhead_steps", "json_path", "no_progress"},
    "published": {"json_path", "no_progress"},
}


def check_mode_flags(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming a flag the chosen mode would ignore
    (``--overhead`` and ``--published`` run something else entirely), or
    a flag ``--overhead-steps`` that only ``--overhead`` reads."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    defaults = vars(parser.parse_args([]))
    given = {dest for dest, value in defaults.items() if getattr(args, dest) != value}
    modes = [mode for mode in MODE_FLAGS if mode in given]
    if len(modes) > 1:
        raise ValueError(f"{flags[modes[0]]} and {flags[modes[1]]} exclude each other")
    if not modes:
        if "overhead_steps" in given:
            raise ValueError("--overhead-steps applies only with --overhead")
        _check_disaggregation_flags(args, given, flags)
        return
    (mode,) = modes
    ignored = sorted(given - MODE_FLAGS[mode] - {mode})
    if ignored:
        names = ", ".join(flags[dest] for dest in ignored)
        raise ValueError(f"{flags[mode]} runs no workload and ignores {names}")


#: What ``--disaggregated`` replaces: its pools have their own configs
#: (``--overhead`` and ``--published`` are refused as modes before).
NOT_WITH_DISAGGREGATED = ("policy", "config", "replicas", "plot")


def _check_disaggregation_flags(
    args: argparse.Namespace, given: set[str], flags: dict[str, str]
) -> None:
    """Per-pool flags need ``--disaggregated``, which excludes the flags
    choosing colocated policies and fleets."""
    if "disaggregated" not in given:
        stray = disaggregation_flags_given(args)
        if stray:
            raise ValueError(f"{stray[0]} applies only with --disaggregated")
        return
    clash = [flags[dest] for dest in NOT_WITH_DISAGGREGATED if dest in given]
    if clash:
        raise ValueError(
            f"--disaggregated sets its pools' configs and sizes; {clash[0]} does "
            "not apply (use --prefill-config / --decode-config)"
        )


def run(args: argparse.Namespace) -> int:
    check_mode_flags(args)
    if args.disaggregated is not None:
        from neuron_scheduler.cli.bench_disaggregated import run_disaggregated

        return run_disaggregated(args)
    if args.overhead:
        from neuron_scheduler.sim.overhead import run_overhead

        return run_overhead(args.overhead_steps, args.json_path)
    if args.published:
        from neuron_scheduler.sim.published import run_published

        return run_published(args.json_path)
    cost, settings = engine_setup(engine_choice(args))
    goodput = parse_goodput(args.goodput)
    workload = workload_options(args)
    specs, fit = build_workload(workload, settings.max_model_len)
    chosen = policies(args.policy or [], args.config or [])
    check_profile_covers(cost, settings, chosen)
    print(
        describe_setup(workload.name, cost, settings, len(specs), fit), file=sys.stderr
    )
    results, metrics = _simulate_each(args, chosen, specs, settings, cost, goodput)
    print(format_table(metrics))
    if args.json_path:
        described = {
            **asdict(settings),
            "cost_model": cost.describe(),
            "cost_profile": args.cost_profile,
            "workload": workload.name,
            "num_requests": len(specs),
            "max_concurrency": args.max_concurrency,
            "replicas": args.replicas,
            "router": args.router,
            "fit_to_model_len": asdict(fit),
        }
        document = {"settings": described, "runs": metrics}
        with open(args.json_path, "w") as handle:
            json.dump(document, handle, indent=2)
    if args.plot:
        plot(results, args.plot)
    return 0


def _simulate_each(
    args: argparse.Namespace,
    chosen: list[Policy],
    specs: list[RequestSpec],
    settings: EngineSettings,
    cost: CostModel,
    goodput: tuple[SLO, ...],
) -> tuple[list[RunResult], list[dict[str, Any]]]:
    """Each policy's run and its metrics (with what the cost model charged
    it, and with ``--save-detailed`` every request), under a progress bar."""
    results: list[RunResult] = []
    metrics: list[dict[str, Any]] = []
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(specs) * len(chosen), desc="simulating", unit="req")
    for policy in chosen:
        if progress is not None:
            progress.set_postfix_str(policy.label)
        before = cost.report()
        result = simulate(
            specs,
            policy,
            settings,
            cost,
            on_finish=(lambda _i: progress.update(1)) if progress is not None else None,
            max_concurrency=args.max_concurrency,
            replicas=args.replicas,
            router=RouterKind(args.router),
            jobs=args.jobs,
        )
        results.append(result)
        run_metrics = compute_metrics(result, goodput, args.metric_percentiles)
        engine = replace(settings, **policy.engine_overrides)
        bound = never_mix_lower_bound(specs, engine, cost, engines=args.replicas)
        run_metrics["never_mix_lower_bound_s"] = bound
        run_metrics["duration_over_lower_bound"] = (
            result.duration_s / bound if bound else 0.0
        )
        run_metrics["neuron_config"] = policy.neuron_config
        charged = cost.report()
        if charged:
            run_metrics["cost_model"] = {
                key: value - before.get(key, 0) if isinstance(value, int) else value
                for key, value in charged.items()
            }
        if args.save_detailed:
            run_metrics["requests"] = [asdict(r) for r in result.records]
        metrics.append(run_metrics)
    if progress is not None:
        progress.close()
    return results, metrics
