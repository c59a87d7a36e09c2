"""The options several commands share, each defined once, and the
translation of parsed arguments into the simulator's options."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any

from neuron_scheduler.sim.cost_model import HARDWARE, MODELS
from neuron_scheduler.sim.disaggregated import DisaggregationOptions, PoolSizes
from neuron_scheduler.sim.kv_transfer import (
    DEFAULT_LATENCY_S,
    DEFAULT_LINK_BYTES_PER_S,
    TransferMode,
    TransferModel,
)
from neuron_scheduler.sim.routing import RouterKind
from neuron_scheduler.sim.run_setup import (
    PROFILED_FIELDS,
    ROOFLINE_ENGINE,
    EngineChoice,
)
from neuron_scheduler.sim.slo import parse_percentiles
from neuron_scheduler.sim.workload import WorkloadOptions


def rate_argument(text: str) -> float:
    value = float(text)
    if not (value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0 or 'inf', got {text!r}")
    return value


def output_file(text: str) -> str:
    """A file a command writes when it is done: refused at once, naming it,
    when it is a directory or its directory does not exist, so that a long
    run does not end with nowhere to put what it made."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r}: no directory {str(path.parent)!r} to write it in"
        )
    return text


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the OS
    says; a container may allow fewer than the machine has)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def positive_number(text: str, unit: str) -> float:
    """A finite number > 0 of ``unit`` (named in the error)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(
            f"must be a number of {unit} > 0, got {text!r}"
        )
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    return positive_number(text, "seconds")


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


def labelled_config(text: str, option: str = "--config") -> tuple[str, dict[str, Any]]:
    """``LABEL=JSON`` as ``(label, object)``, or an error naming ``option``."""
    label, sep, raw = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"{option} {text!r} must be LABEL=JSON")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f"{option} {label}: invalid JSON ({error})"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{option} {label}: JSON must be an object")
    return label, value


def role_config_argument(role: str) -> Callable[[str], tuple[str, dict[str, Any]]]:
    """``plan --{role}-config``: ``LABEL=JSON``, or a bare JSON object
    (labelled by its position later: ``None``)."""
    option = f"--{role}-config"

    def parse(text: str) -> tuple[str, dict[str, Any]]:
        if text.lstrip().startswith("{"):
            try:
                return "", neuron_config_argument(text)
            except argparse.ArgumentTypeError as error:
                raise argparse.ArgumentTypeError(f"{option}: {error}") from None
        return labelled_config(text, option)

    return parse


def neuron_config_argument(text: str) -> dict[str, Any]:
    """``--neuron-config``: a JSON object, or an error naming the option."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"invalid JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return value


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


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine settings and the accelerator cost model (shared)."""
    for name in PROFILED_FIELDS:
        default = getattr(ROOFLINE_ENGINE, name)
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


def add_engine_spec_arguments(
    parser: argparse.ArgumentParser,
    defaults: Mapping[str, object],
    model_help: str,
    neuron_config_help: str,
) -> None:
    """The engine a command starts (shared by ``profile`` and ``validate``,
    each with its own ``defaults`` and model)."""
    parser.add_argument("--model", help=model_help)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=defaults["max_model_len"],
        help="engine max_model_len (default: %(default)s)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults["max_num_batched_tokens"],
        help="engine max_num_batched_tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=defaults["max_num_seqs"],
        help="engine max_num_seqs (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=defaults["kv_cache_memory_bytes"],
        help="KV cache size (default: %(default)s)",
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="KV block size (default: vLLM's)"
    )
    parser.add_argument(
        "--neuron-config",
        type=neuron_config_argument,
        default={},
        metavar="JSON",
        help=f"{neuron_config_help} (default: {{}})",
    )


def workload_options(args: argparse.Namespace) -> WorkloadOptions:
    """The ``WorkloadOptions`` of a command's parsed workload arguments."""
    return WorkloadOptions(
        trace=args.workload,
        num_requests=args.num_requests,
        sample=args.sample,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        time_scale=args.time_scale,
        seed=args.seed,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        clip_to_model_len=args.clip_to_model_len,
    )


def engine_choice(args: argparse.Namespace) -> EngineChoice:
    """The ``EngineChoice`` of a command's parsed engine arguments."""
    return EngineChoice(**{f.name: getattr(args, f.name) for f in fields(EngineChoice)})


def add_goodput_argument(parser: argparse.ArgumentParser) -> None:
    """``--goodput``: the per-request SLOs goodput counts (vLLM's form)."""
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=["ttft:2000", "tpot:100"],
        metavar="KEY:MS",
        help="goodput SLOs (default: ttft:2000 tpot:100)",
    )


def add_policy_arguments(
    parser: argparse.ArgumentParser, policy_help: str, config_help: str
) -> None:
    """``--policy`` and ``--config``: the schedulers a command compares."""
    parser.add_argument(
        "--policy",
        action="append",
        choices=["seed", "unconstrained"],
        help=policy_help,
    )
    parser.add_argument(
        "--config",
        action="append",
        type=labelled_config,
        metavar="LABEL=JSON",
        help=config_help,
    )


def add_router_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--router``: how requests are spread over replicas."""
    parser.add_argument(
        "--router",
        choices=[p.value for p in RouterKind],
        default=RouterKind.VLLM.value,
        help=help_text,
    )


def add_jobs_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--jobs``: processes to use (default: the cores this process may
    use)."""
    parser.add_argument(
        "--jobs", type=positive_count, default=usable_cores(), help=help_text
    )


def pool_sizes_argument(text: str) -> PoolSizes:
    try:
        return PoolSizes.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_disaggregation_arguments(
    parser: argparse.ArgumentParser, searched: bool = False
) -> None:
    """``--disaggregated xPyD`` (``searched``: a flag, the sizes are the
    command's to find) and the per-pool and transfer options."""
    if searched:
        parser.add_argument(
            "--disaggregated",
            action="store_true",
            help="also plan the cheapest xPyD (x prefill, y decode engines "
            "joined by KV transfers) meeting the SLOs, beside each config's "
            "colocated replicas (default: off)",
        )
    else:
        parser.add_argument(
            "--disaggregated",
            type=pool_sizes_argument,
            metavar="xPyD",
            help="simulate x prefill and y decode engines joined by KV "
            "transfers (e.g. 1P1D, 2P3D; default: colocated engines)",
        )
    for role in ("prefill", "decode"):
        default_help = (
            "(default: the design's"
            + (", with kv_loads_take_slots" if role == "decode" else "")
            + ")"
        )
        if searched:
            parser.add_argument(
                f"--{role}-config",
                type=role_config_argument(role),
                action="append",
                metavar="[LABEL=]JSON",
                help=f"with --disaggregated: a {role} engines' neuron_config; "
                "repeatable: every prefill config is tried with every decode "
                f"config {default_help}",
            )
        else:
            parser.add_argument(
                f"--{role}-config",
                type=neuron_config_argument,
                default={},
                metavar="JSON",
                help=f"with --disaggregated: the {role} engines' neuron_config "
                + default_help,
            )
        parser.add_argument(
            f"--{role}-tensor-parallel-size",
            type=positive_count,
            default=None,
            help=f"with --disaggregated: the {role} engines' roofline TP size "
            "(default: --tensor-parallel-size)",
        )
        parser.add_argument(
            f"--{role}-cost-profile",
            metavar="FILE",
            help=f"with --disaggregated: the {role} engines' profile (default: "
            "--cost-profile, or the roofline model)",
        )
    parser.add_argument(
        "--kv-transfer-mode",
        choices=[mode.value for mode in TransferMode],
        default=TransferMode.READ.value,
        help="with --disaggregated: read (the decode engine pulls the KV after "
        "the prefill, AWS's mode) or write (the prefill engine pushes each "
        "chunk as it computes it) (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-link-gb-per-s",
        type=float,
        default=DEFAULT_LINK_BYTES_PER_S / 1e9,
        help="with --disaggregated: bandwidth of each prefill-decode engine "
        "pair's link, GB/s, shared by its transfers (default: %(default)g, one "
        "trn2 chip's share of trn2.48xlarge EFA)",
    )
    parser.add_argument(
        "--kv-link-latency-ms",
        type=float,
        default=DEFAULT_LATENCY_S * 1e3,
        help="with --disaggregated: latency of one transfer, ms (default: "
        "%(default)g, an assumption)",
    )


@cache
def _disaggregation_defaults(searched: bool) -> dict[str, Any]:
    """Each per-pool and transfer option's default, by destination."""
    parser = argparse.ArgumentParser()
    add_disaggregation_arguments(parser, searched)
    defaults = vars(parser.parse_args([]))
    del defaults["disaggregated"]
    return defaults


def disaggregation_flags_given(
    args: argparse.Namespace, searched: bool = False
) -> list[str]:
    """The per-pool and transfer flags ``args`` set (options only
    ``--disaggregated`` reads), as written on the command line
    (``searched``: as ``add_disaggregation_arguments`` was called)."""
    return [
        "--" + dest.replace("_", "-")
        for dest, default in _disaggregation_defaults(searched).items()
        if getattr(args, dest) != default
    ]


def disaggregation_options(
    args: argparse.Namespace,
    sizes: PoolSizes | None = None,
    configs: tuple[dict[str, Any], dict[str, Any]] | None = None,
) -> DisaggregationOptions:
    """The ``DisaggregationOptions`` of parsed arguments (``sizes``: default
    ``--disaggregated``'s; ``configs``: the prefill and decode
    ``neuron_config``, default ``--prefill-config`` and ``--decode-config``);
    ``ValueError`` naming a transfer figure out of range."""
    prefill_config, decode_config = configs or (args.prefill_config, args.decode_config)
    return DisaggregationOptions(
        sizes=sizes or args.disaggregated,
        prefill_config=prefill_config,
        decode_config=decode_config,
        prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
        decode_tensor_parallel_size=args.decode_tensor_parallel_size,
        prefill_cost_profile=args.prefill_cost_profile,
        decode_cost_profile=args.decode_cost_profile,
        transfer=TransferModel(
            TransferMode(args.kv_transfer_mode),
            link_bytes_per_s=args.kv_link_gb_per_s * 1e9,
            latency_s=args.kv_link_latency_ms * 1e-3,
        ),
    )
