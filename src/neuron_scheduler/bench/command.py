"""``neuron-scheduler bench``: argument parsing and the run loop."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from typing import Any

from neuron_scheduler.bench.cost_choice import cost_model_for
from neuron_scheduler.bench.cost_model import (
    HARDWARE,
    MODELS,
    CostModel,
    CostModelError,
)
from neuron_scheduler.bench.engines import (
    SEED,
    UNCONSTRAINED,
    Policy,
    RunResult,
)
from neuron_scheduler.bench.metrics import (
    GoodputSLO,
    compute_metrics,
    parse_percentiles,
)
from neuron_scheduler.bench.profile_cost import ProfileCostModel
from neuron_scheduler.bench.report import format_table, plot
from neuron_scheduler.bench.routing import RoutingPolicy
from neuron_scheduler.bench.simulate import simulate
from neuron_scheduler.bench.workload import (
    FitReport,
    RequestSpec,
    WorkloadError,
    builtin_workload,
    fit_to_model_len,
    load_trace,
    random_workload,
    retime,
    select,
)
from neuron_scheduler.config import EngineLimits, NeuronConfig
from neuron_scheduler.harness import EngineSettings
from neuron_scheduler.scheduler import NeuronScheduler

BUILTIN_REQUEST_RATE = 1.0


def rate_argument(text: str) -> float:
    value = float(text)
    if not (value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0 or 'inf', got {text!r}")
    return value


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the OS
    says; a container may allow fewer than the machine has)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def positive_count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def percentiles_argument(text: str) -> tuple[float, ...]:
    try:
        return parse_percentiles(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def labelled_config(text: str) -> tuple[str, dict[str, Any]]:
    label, sep, raw = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"--config {text!r} must be LABEL=JSON")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f"--config {label}: invalid JSON ({error})"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--config {label}: JSON must be an object")
    return label, value


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Options choosing the requests (shared by ``bench`` and ``tune``)."""
    parser.add_argument(
        "--workload",
        help="trace file: Azure CSV, Mooncake JSONL or length-only CSV "
        "(default: the built-in synthetic workload)",
    )
    parser.add_argument(
        "--num-requests",
        type=positive_count,
        default=None,
        help="requests to use (default: 200 for generated workloads, all of a trace)",
    )
    parser.add_argument(
        "--sample",
        action="store_true",
        help="sample --num-requests at random instead of the first N",
    )
    parser.add_argument(
        "--request-rate",
        type=rate_argument,
        default=None,
        help="requests per second, or inf (default: 1 for generated "
        "workloads, the trace's own times otherwise)",
    )
    add_arrival_and_length_arguments(parser)


def add_arrival_and_length_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload options besides which requests and at what rate (shared
    by every command that calls ``build_workload``: bench, tune, plan,
    validate)."""
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps; 1 = Poisson (default: 1)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="stretch a trace's own arrival times by this factor (default: 1)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed of generated workloads (default: %(default)s)",
    )
    parser.add_argument(
        "--random-input-len",
        type=int,
        default=None,
        help="vLLM's random dataset: mean prompt length (with "
        "--random-output-len instead of the built-in workload; default: off)",
    )
    parser.add_argument(
        "--random-output-len",
        type=int,
        default=None,
        help="vLLM's random dataset: mean output length (default: off)",
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="vLLM's random dataset: lengths uniform within +-ratio of the mean "
        "(default: 0)",
    )
    parser.add_argument(
        "--clip-to-model-len",
        action="store_true",
        help="trim prompts that do not fit max_model_len instead of counting "
        "them as failed requests, as the server does (default: off)",
    )


#: Engine defaults of the roofline model (a profile brings its own).
ROOFLINE_ENGINE = {
    "max_num_seqs": 32,
    "max_num_batched_tokens": 8192,
    "max_model_len": 8192,
    "block_size": 32,
}
ROOFLINE_HARDWARE, ROOFLINE_MODEL, ROOFLINE_TP = "trn2", "llama-3.1-8b", 4
ROOFLINE_CHOICES = ("hardware", "model", "tensor_parallel_size")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine settings and the accelerator cost model (shared)."""
    for name, default in ROOFLINE_ENGINE.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            help=f"engine {name} (default: {default}, or the profile's)",
        )
    parser.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="vLLM's prefix caching (default: off)",
    )
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV cache blocks (default: what fits beside the weights, or the "
        "profile's)",
    )
    parser.add_argument(
        "--hardware",
        choices=sorted(HARDWARE),
        default=None,
        help="roofline accelerator (default: trn2)",
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="roofline model (default: llama-3.1-8b)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="roofline tensor-parallel cores (default: 4)",
    )
    parser.add_argument(
        "--cost-profile",
        metavar="FILE",
        help="charge steps from a profile measured by neuron-scheduler profile "
        "instead of the roofline model (default: roofline)",
    )
    parser.add_argument(
        "--interpolate",
        action="store_true",
        help="with --cost-profile: interpolate shapes the profile lacks instead "
        "of refusing them",
    )


def engine_setup(args: argparse.Namespace) -> tuple[CostModel, EngineSettings]:
    """The cost model and engine settings the arguments name. The engine
    defaults to the roofline's (KV: what fits beside the weights), or, with
    ``--cost-profile``, to the profiled engine, which an explicit setting
    may not contradict."""
    profile_path = getattr(args, "cost_profile", None)
    if profile_path is None:
        cost = cost_model_for(
            args.hardware or ROOFLINE_HARDWARE,
            args.model or ROOFLINE_MODEL,
            args.tensor_parallel_size or ROOFLINE_TP,
        )
        engine = {k: getattr(args, k) or v for k, v in ROOFLINE_ENGINE.items()}
        blocks = args.num_kv_blocks or cost.kv_capacity_tokens() // engine["block_size"]
    else:
        chosen = [k for k in ROOFLINE_CHOICES if getattr(args, k) is not None]
        if chosen:
            raise CostModelError(
                f"--{chosen[0].replace('_', '-')} names a roofline model; with "
                "--cost-profile the profiled engine is the model"
            )
        cost = cost_model_for(
            ROOFLINE_HARDWARE,
            ROOFLINE_MODEL,
            ROOFLINE_TP,
            profile=profile_path,
            interpolate=args.interpolate,
        )
        assert isinstance(cost, ProfileCostModel)
        profiled = cost.profile.engine
        engine = {}
        for key in ROOFLINE_ENGINE:
            given, measured = getattr(args, key), int(profiled[key])
            if given is not None and given != measured:
                raise CostModelError(
                    f"--{key.replace('_', '-')} {given} does not match the profile "
                    f"{profile_path} ({key} {measured})"
                )
            engine[key] = measured
        blocks = args.num_kv_blocks or int(cost.profile.kv_cache["num_blocks"])
    settings = EngineSettings(
        max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        max_model_len=engine["max_model_len"],
        block_size=engine["block_size"],
        num_kv_blocks=blocks,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    return cost, settings


def check_profile_covers(
    cost: CostModel, settings: EngineSettings, chosen: list[Policy]
) -> None:
    """With a profile and no ``--interpolate``: every bucket shape a static
    policy can produce must be profiled (refused before simulating)."""
    if not isinstance(cost, ProfileCostModel) or cost.interpolate:
        return
    limits = EngineLimits(
        settings.max_num_batched_tokens, settings.max_model_len, settings.max_num_seqs
    )
    for policy in chosen:
        if not policy.static_shapes:
            continue
        config = NeuronConfig.from_dict(policy.neuron_config or {}, limits)
        missing = cost.missing_shapes(
            config.num_batched_tokens_buckets,
            config.num_seqs_buckets,
            config.decode_context_length_buckets,
        )
        if missing:
            raise CostModelError(
                f"policy {policy.label!r} needs shapes the profile lacks: "
                f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}; "
                "profile that configuration, or pass --interpolate"
            )


def describe_setup(
    args: argparse.Namespace,
    cost: CostModel,
    settings: EngineSettings,
    num_requests: int,
    fit: FitReport,
) -> str:
    fitted = (
        f"; {fit.rejected} rejected (prompt >= max_model_len), "
        f"{fit.outputs_capped} outputs capped, {fit.clipped} clipped"
        if fit.rejected or fit.outputs_capped or fit.clipped
        else ""
    )
    return (
        f"workload: {num_requests} requests ({workload_name(args)}){fitted}; "
        f"{cost.describe()}; KV {settings.num_kv_blocks} blocks of "
        f"{settings.block_size}; max_num_seqs {settings.max_num_seqs}, "
        f"max_model_len {settings.max_model_len}, max_num_batched_tokens "
        f"{settings.max_num_batched_tokens}"
    )


def workload_name(args: argparse.Namespace) -> str:
    if args.workload:
        return str(args.workload)
    if args.random_input_len is not None:
        return (
            f"random {args.random_input_len}/{args.random_output_len} "
            f"+-{args.random_range_ratio:g}"
        )
    return "built-in"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        action="append",
        choices=["seed", "unconstrained"],
        help="seed: NeuronScheduler with the design's defaults; unconstrained: "
        "vLLM's scheduler, dynamic shapes (repeatable; default: both)",
    )
    parser.add_argument(
        "--config",
        action="append",
        type=labelled_config,
        metavar="LABEL=JSON",
        help="a NeuronScheduler with this neuron_config (repeatable; default: "
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
    parser.add_argument(
        "--router",
        choices=[p.value for p in RoutingPolicy],
        default=RoutingPolicy.VLLM.value,
        help="how requests are spread over --replicas: vllm (vLLM 0.32's own "
        "data-parallel load balancing), round-robin, least-loaded (default: "
        "%(default)s)",
    )
    parser.add_argument(
        "--jobs",
        type=positive_count,
        default=usable_cores(),
        help="processes that step a fleet's engines (--replicas > 1; the "
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
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=["ttft:2000", "tpot:100"],
        metavar="KEY:MS",
        help="goodput SLOs (default: ttft:2000 tpot:100)",
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        metavar="FILE",
        help="write the results as JSON (default: no file)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
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
        "(bench.published) and print published vs simulated",
    )


def build_workload(
    args: argparse.Namespace, max_model_len: int
) -> tuple[list[RequestSpec], FitReport]:
    """The requests the arguments name, fitted to ``max_model_len`` as the
    server fits them (see ``fit_to_model_len``)."""
    generated_rate = (
        args.request_rate if args.request_rate is not None else BUILTIN_REQUEST_RATE
    )
    random_lengths = (args.random_input_len, args.random_output_len)
    if (random_lengths[0] is None) != (random_lengths[1] is None):
        raise WorkloadError(
            "--random-input-len and --random-output-len go together, got "
            f"{random_lengths[0]!r} and {random_lengths[1]!r}"
        )
    if args.workload is None and random_lengths[0] is not None:
        specs = random_workload(
            args.num_requests or 200,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            generated_rate,
            args.burstiness,
            args.seed,
        )
    elif args.workload is None:
        specs = builtin_workload(
            args.num_requests or 200, generated_rate, args.burstiness, args.seed
        )
    else:
        if random_lengths[0] is not None:
            raise WorkloadError("--random-input-len and --workload exclude each other")
        specs = select(
            load_trace(args.workload), args.num_requests, args.sample, args.seed
        )
        has_times = any(s.arrival_s > 0 for s in specs)
        rate = args.request_rate
        if rate is None and not has_times:
            rate = math.inf  # length-only traces: everything at once, as vLLM's default
        specs = retime(
            specs,
            time_scale=args.time_scale,
            request_rate=rate,
            burstiness=args.burstiness,
            seed=args.seed,
        )
    return fit_to_model_len(specs, max_model_len, clip=args.clip_to_model_len)


def policies(args: argparse.Namespace) -> list[Policy]:
    chosen: list[Policy] = []
    for name in args.policy or []:
        chosen.append(SEED if name == "seed" else UNCONSTRAINED)
    for label, neuron_config in args.config or []:
        chosen.append(Policy(label, NeuronScheduler, neuron_config))
    return chosen or [SEED, UNCONSTRAINED]


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
        return
    (mode,) = modes
    ignored = sorted(given - MODE_FLAGS[mode] - {mode})
    if ignored:
        names = ", ".join(flags[dest] for dest in ignored)
        raise ValueError(f"{flags[mode]} runs no workload and ignores {names}")


def run(args: argparse.Namespace) -> int:
    check_mode_flags(args)
    if args.overhead:
        from neuron_scheduler.bench.overhead import run_overhead

        return run_overhead(args)
    if args.published:
        from neuron_scheduler.bench.published import run_published

        return run_published(args.json_path)
    cost, settings = engine_setup(args)
    slo = GoodputSLO.parse(args.goodput)
    specs, fit = build_workload(args, settings.max_model_len)
    chosen = policies(args)
    check_profile_covers(cost, settings, chosen)
    print(describe_setup(args, cost, settings, len(specs), fit), file=sys.stderr)
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
            router=RoutingPolicy(args.router),
            jobs=args.jobs,
        )
        results.append(result)
        run_metrics = compute_metrics(result, slo, args.metric_percentiles)
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
    print(format_table(metrics))
    if args.json_path:
        described = {
            **asdict(settings),
            "cost_model": cost.describe(),
            "cost_profile": args.cost_profile,
            "workload": workload_name(args),
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
