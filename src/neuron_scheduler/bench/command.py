"""``neuron-scheduler bench``: argument parsing and the run loop."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from typing import Any

from neuron_scheduler.bench.cost_model import (
    HARDWARE,
    MODELS,
    CostModel,
    cost_model_for,
)
from neuron_scheduler.bench.metrics import GoodputSLO, compute_metrics
from neuron_scheduler.bench.report import format_table, plot
from neuron_scheduler.bench.simulate import (
    SEED,
    UNCONSTRAINED,
    Policy,
    RunResult,
    simulate,
)
from neuron_scheduler.bench.workload import (
    RequestSpec,
    builtin_workload,
    clip_to_model_len,
    load_trace,
    retime,
    select,
)
from neuron_scheduler.harness import EngineSettings
from neuron_scheduler.scheduler import NeuronScheduler

BUILTIN_REQUEST_RATE = 1.0


def _rate(text: str) -> float:
    value = float(text)
    if not (value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0 or 'inf', got {text!r}")
    return value


def _config(text: str) -> tuple[str, dict[str, Any]]:
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
    parser.add_argument("--workload", help="trace file (default: built-in synthetic)")
    parser.add_argument(
        "--num-requests", type=int, default=None, help="default 200 (built-in) or all"
    )
    parser.add_argument(
        "--sample",
        action="store_true",
        help="sample --num-requests instead of the first N",
    )
    parser.add_argument("--request-rate", type=_rate, default=None, help="req/s or inf")
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine settings and the accelerator cost model (shared)."""
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--hardware", default="trn2", choices=sorted(HARDWARE))
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    parser.add_argument("--tensor-parallel-size", type=int, default=4)


def engine_setup(args: argparse.Namespace) -> tuple[CostModel, EngineSettings]:
    """The cost model and engine settings the arguments name; the KV cache
    defaults to what fits beside the weights."""
    cost = cost_model_for(args.hardware, args.model, args.tensor_parallel_size)
    num_blocks = args.num_kv_blocks or cost.kv_capacity_tokens() // args.block_size
    settings = EngineSettings(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    return cost, settings


def describe_setup(
    args: argparse.Namespace, settings: EngineSettings, num_requests: int
) -> str:
    return (
        f"workload: {num_requests} requests ({args.workload or 'built-in'}); "
        f"{args.hardware} x TP{args.tensor_parallel_size}, {args.model}; "
        f"KV {settings.num_kv_blocks} blocks of {settings.block_size}; "
        f"max_num_seqs {settings.max_num_seqs}, "
        f"max_model_len {settings.max_model_len}, max_num_batched_tokens "
        f"{settings.max_num_batched_tokens}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", action="append", choices=["seed", "unconstrained"])
    parser.add_argument("--config", action="append", type=_config, metavar="LABEL=JSON")
    add_workload_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument(
        "--goodput", nargs="+", default=["ttft:2000", "tpot:100"], metavar="KEY:MS"
    )
    parser.add_argument("--json", dest="json_path", metavar="FILE")
    parser.add_argument("--plot", metavar="FILE.png")
    parser.add_argument(
        "--save-detailed", action="store_true", help="per-request records in --json"
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--overhead",
        action="store_true",
        help="time schedule() overhead vs the stock Scheduler instead",
    )
    parser.add_argument("--overhead-steps", type=int, default=200)


def build_workload(args: argparse.Namespace) -> list[RequestSpec]:
    if args.workload is None:
        rate = (
            args.request_rate if args.request_rate is not None else BUILTIN_REQUEST_RATE
        )
        return builtin_workload(
            args.num_requests or 200,
            rate,
            args.burstiness,
            args.seed,
            args.max_model_len,
        )
    specs = select(load_trace(args.workload), args.num_requests, args.sample, args.seed)
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
    return clip_to_model_len(specs, args.max_model_len)


def policies(args: argparse.Namespace) -> list[Policy]:
    chosen: list[Policy] = []
    for name in args.policy or []:
        chosen.append(SEED if name == "seed" else UNCONSTRAINED)
    for label, neuron_config in args.config or []:
        chosen.append(Policy(label, NeuronScheduler, neuron_config))
    return chosen or [SEED, UNCONSTRAINED]


def run(args: argparse.Namespace) -> int:
    if args.overhead:
        from neuron_scheduler.bench.overhead import run_overhead

        return run_overhead(args)
    cost, settings = engine_setup(args)
    slo = GoodputSLO.parse(args.goodput)
    specs = build_workload(args)
    chosen = policies(args)
    print(describe_setup(args, settings, len(specs)), file=sys.stderr)
    results: list[RunResult] = []
    metrics: list[dict[str, Any]] = []
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(specs) * len(chosen), desc="simulating", unit="req")
    for policy in chosen:
        if progress is not None:
            progress.set_postfix_str(policy.label)
        result = simulate(
            specs,
            policy,
            settings,
            cost,
            on_finish=(lambda _i: progress.update(1)) if progress is not None else None,
        )
        results.append(result)
        run_metrics = compute_metrics(result, slo)
        run_metrics["neuron_config"] = policy.neuron_config
        if args.save_detailed:
            run_metrics["requests"] = [asdict(r) for r in result.records]
        metrics.append(run_metrics)
    if progress is not None:
        progress.close()
    print(format_table(metrics))
    if args.json_path:
        described = {
            **asdict(settings),
            "hardware": args.hardware,
            "model": args.model,
            "tensor_parallel_size": args.tensor_parallel_size,
            "workload": args.workload or "built-in",
            "num_requests": len(specs),
        }
        document = {"settings": described, "runs": metrics}
        with open(args.json_path, "w") as handle:
            json.dump(document, handle, indent=2)
    if args.plot:
        plot(results, args.plot)
    return 0
