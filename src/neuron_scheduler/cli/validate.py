"""``neuron-scheduler validate``: compare the simulator with the real
server on this machine (``sim.validation``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from neuron_scheduler.cli.options import (
    add_arrival_and_length_arguments,
    add_engine_spec_arguments,
    add_goodput_argument,
    labelled_config,
    neuron_config_argument,
    output_file,
    pool_sizes_argument,
    positive_count,
    positive_number,
    rate_argument,
    workload_options,
)
from neuron_scheduler.offline.engine_spec import CPU_STATIC_WORKER, EngineSpec
from neuron_scheduler.offline.tinymodel import VALIDATION_ENGINE
from neuron_scheduler.sim.slo import parse_goodput
from neuron_scheduler.sim.validation import (
    DisaggregatedValidation,
    ValidateOptions,
    validate,
    validation_model,
)
from neuron_scheduler.sim.validation_metrics import format_report
from neuron_scheduler.sim.validation_plan import (
    DEFAULT_LOAD_FRACTIONS,
    DEFAULT_TIME_BUDGET_S,
    FEWEST_REQUESTS,
    MOST_REQUESTS,
    check_load_fractions,
)

#: ``--load-fractions``' default, as written on the command line.
_DEFAULT_FRACTIONS = ",".join(f"{f:g}" for f in DEFAULT_LOAD_FRACTIONS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        help="trace file in the bench's formats (default: the built-in workload)",
    )
    parser.add_argument(
        "--num-requests",
        type=positive_count,
        default=None,
        help="requests per level (default: with one colocated config, as many "
        f"as --time-budget leaves room for, {FEWEST_REQUESTS} to {MOST_REQUESTS}; "
        f"else {MOST_REQUESTS})",
    )
    parser.add_argument(
        "--time-budget",
        type=minutes_argument,
        default=None,
        metavar="MINUTES",
        help="without --num-requests: give each level as many requests as fit "
        "this wall time, profile and server start included, predicted by "
        "simulating the levels with the profile (default: "
        f"{DEFAULT_TIME_BUDGET_S / 60:g} with one colocated config; with "
        "--config, the whole comparison's, none by default)",
    )
    parser.add_argument(
        "--sample", action="store_true", help="sample the trace's requests at random"
    )
    parser.add_argument(
        "--request-rate",
        type=rate_argument,
        nargs="+",
        default=None,
        help="open-loop levels, req/s (default: --load-fractions' levels; with "
        "--config or --disaggregated 0.5 1, then --max-concurrency 8)",
    )
    parser.add_argument(
        "--load-fractions",
        type=fractions_argument,
        default=None,
        metavar="F,F,...",
        help="measure the engine's capacity for the workload first (every "
        "request at once), then open-loop rates at these shares of it, each "
        "in (0, 1] (instead of --request-rate; default: "
        f"{_DEFAULT_FRACTIONS} when no level is named, with one colocated config)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=positive_count,
        nargs="+",
        default=None,
        help="closed-loop levels: users, each sending its next request at once "
        "(default: none; 8 after the default rates of --config or --disaggregated)",
    )
    add_arrival_and_length_arguments(parser)
    add_engine_spec_arguments(
        parser,
        VALIDATION_ENGINE,
        "model directory (default: a random Llama, hidden 512, 6 layers, made locally)",
        "the server's neuron_config",
    )
    parser.add_argument(
        "--config",
        action="append",
        type=labelled_config,
        metavar="LABEL=JSON",
        help="validate each of these neuron_configs in turn (repeatable, two or "
        "more; instead of --neuron-config) and compare them: throughput and "
        "goodput, ratios to the first, the order (default: one config)",
    )
    parser.add_argument(
        "--rounds",
        type=positive_count,
        metavar="N",
        help="with --config: serve the configs N times, every other round in "
        "reverse order (so that the machine's drift reaches each alike), and "
        "compare the medians (default: 1)",
    )
    add_goodput_argument(parser)
    parser.add_argument(
        "--disaggregated",
        type=pool_sizes_argument,
        metavar="xPyD",
        help="validate a real xPyD instead: x prefill and y decode servers joined "
        "by vLLM's ExampleConnector (a shared folder) behind a read-mode proxy, "
        "against the simulator's xPyD with a transfer model measured here; the "
        "prefill engine's --max-num-batched-tokens is raised to --max-model-len "
        "(default: one colocated server)",
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-config",
            type=neuron_config_argument,
            default=None,
            metavar="JSON",
            help=f"with --disaggregated: the {role} server's neuron_config "
            "(default: --neuron-config)",
        )
    parser.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="refit the profile to the server's own step times: on the first "
        "level (the capacity run with --load-fractions) while the others run, "
        "then, once all have run, each level on every other level's steps, never "
        "its own (with --disaggregated: on a calibration run at the first "
        "level's load before them all); each level is reported with the profile "
        "as measured too; with --save-profile the profile refitted on the first "
        "level is kept as FILE-calibrated (default: on with --load-fractions, "
        "else off)",
    )
    parser.add_argument(
        "--decode-plane",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="simulate with the profile's decode shapes fitted as one plane "
        "(a fixed part, a part a row, a part a row per token of context), "
        "which spreads the moment each shape was timed in over all of them; "
        "the profile as measured is reported beside it; with "
        "--disaggregated, the decode engine's profile (default: off: on "
        "fresh runs it did not beat the shapes as measured, "
        "docs/ground-truth.md)",
    )
    parser.add_argument(
        "--cost-profile",
        metavar="FILE",
        help="a profile of this engine; with --disaggregated, FILE-prefill and "
        "FILE-decode (as --save-profile writes them) where they exist, else FILE "
        "for both (default: profile it first)",
    )
    parser.add_argument(
        "--save-profile",
        metavar="FILE",
        type=output_file,
        help="keep the profile measured (with --disaggregated: FILE-prefill and "
        "FILE-decode) (default: a temp file)",
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        type=output_file,
        help="write the report as JSON (default: no file)",
    )
    parser.add_argument(
        "--log-dir", help="where the server's log goes (default: a temp dir)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def fractions_argument(text: str) -> list[float]:
    """``0.5,0.8,0.95`` as floats, each in (0, 1]."""
    try:
        fractions = [float(part) for part in text.split(",")]
        check_load_fractions(fractions)
    except ValueError as error:  # ValidateError included
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return fractions


def minutes_argument(text: str) -> float:
    """A positive number of minutes, as seconds."""
    return 60 * positive_number(text, "minutes")


def _one_colocated(args: argparse.Namespace) -> bool:
    """Whether one colocated config runs (no ``--config``, no
    ``--disaggregated``): the runs the defaults below are for."""
    return not (args.config or args.disaggregated)


def time_budget(args: argparse.Namespace) -> float | None:
    """The seconds the levels are sized to: ``--time-budget`` (default
    ``DEFAULT_TIME_BUDGET_S`` where one colocated config runs) when
    ``--num-requests`` is not given; with ``--config``, the whole
    comparison's. ``ValueError`` naming it where it cannot apply."""
    one_colocated = _one_colocated(args)
    if args.time_budget is not None:
        minutes = f"--time-budget {args.time_budget / 60:g}"
        if args.num_requests is not None:
            raise ValueError(
                f"{minutes} sizes the levels and --num-requests "
                f"{args.num_requests} fixes them: one or the other"
            )
        if args.disaggregated is not None:
            raise ValueError(
                f"{minutes} sizes colocated levels; with --disaggregated give "
                "--num-requests"
            )
        return args.time_budget
    if args.num_requests is not None or not one_colocated:
        return None
    return DEFAULT_TIME_BUDGET_S


def load_fractions(args: argparse.Namespace) -> list[float] | None:
    """``--load-fractions``; by default ``DEFAULT_LOAD_FRACTIONS`` where
    one colocated config runs and no level is named."""
    if args.load_fractions or args.request_rate or args.max_concurrency:
        return args.load_fractions
    return list(DEFAULT_LOAD_FRACTIONS) if _one_colocated(args) else None


def validate_options(args: argparse.Namespace) -> ValidateOptions:
    """The ``ValidateOptions`` of the parsed arguments: the server runs the
    static-shape CPU worker in eager mode, in float32."""
    engine = EngineSpec(
        model=args.model or validation_model(),
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        dtype="float32",
        enforce_eager=True,
        block_size=args.block_size,
        worker_cls=CPU_STATIC_WORKER,
        neuron_config=args.neuron_config,
    )
    budget = time_budget(args)
    workload = workload_options(args)
    if budget is None and args.num_requests is None:
        workload = replace(workload, num_requests=MOST_REQUESTS)
    fractions = load_fractions(args)
    return ValidateOptions(
        engine=engine,
        workload=workload,
        request_rates=args.request_rate,
        concurrencies=args.max_concurrency,
        cost_profile=args.cost_profile,
        save_profile=args.save_profile,
        log_dir=args.log_dir,
        progress=not args.no_progress,
        load_fractions=fractions,
        goodput=parse_goodput(args.goodput),
        calibrate=bool(fractions) if args.calibrate is None else args.calibrate,
        decode_plane=bool(args.decode_plane),
        time_budget_s=budget,
        disaggregated=disaggregated_validation(args),
    )


def disaggregated_validation(
    args: argparse.Namespace,
) -> DisaggregatedValidation | None:
    """``--disaggregated`` and its per-role configs; ``ValueError`` naming a
    per-role config given without it, or ``--config`` with it."""
    given = [
        f"--{role}-config"
        for role in ("prefill", "decode")
        if getattr(args, f"{role}_config") is not None
    ]
    if args.disaggregated is None:
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --disaggregated")
        return None
    if args.config:
        raise ValueError(
            "--config compares colocated configs; not with --disaggregated"
        )
    return DisaggregatedValidation(
        args.disaggregated, args.prefill_config, args.decode_config
    )


def run(args: argparse.Namespace) -> int:
    options = validate_options(args)
    if args.rounds is not None and not args.config:
        raise ValueError(
            f"--rounds {args.rounds} repeats the configs of --config; give two "
            "or more --config"
        )
    if args.config:
        from neuron_scheduler.sim.config_comparison import (
            compare_configs,
            format_comparison,
        )

        if args.neuron_config:
            raise ValueError(
                f"--neuron-config {json.dumps(args.neuron_config)} and --config: "
                "each --config is a whole neuron_config"
            )
        report = compare_configs(options, args.config, args.rounds or 1)
        print(format_comparison(report))
    elif options.disaggregated is not None:
        from neuron_scheduler.sim.validation_disaggregated import (
            validate_disaggregated,
        )

        report = validate_disaggregated(options)
        print(format_report(report))
    else:
        report = validate(options)
        print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0
