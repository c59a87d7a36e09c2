"""``neuron-scheduler tune``: print the buckets that minimise padding for a
workload (``sim.tuning``, ``sim.tuner``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from neuron_scheduler.cli.options import (
    add_engine_arguments,
    add_workload_arguments,
    engine_choice,
    output_file,
    workload_options,
)
from neuron_scheduler.sim import holdout
from neuron_scheduler.sim.compile_budget import format_frontier
from neuron_scheduler.sim.run_setup import describe_setup, engine_setup
from neuron_scheduler.sim.tuner import DEFAULT_MAX_CONTEXT_BUCKETS, format_tune_result
from neuron_scheduler.sim.tuning import (
    DEFAULT_COMPILE_SECONDS,
    Tuned,
    TuneOptions,
    TuneSetup,
    check_tune_options,
    tune,
)
from neuron_scheduler.sim.workload import RequestSpec, WorkloadOptions, build_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument(
        "--config",
        default="{}",
        metavar="JSON",
        help="neuron_config to tune for (e.g. packing, reserve admission; "
        "default: {}, the design's defaults)",
    )
    parser.add_argument(
        "--max-prefill-buckets",
        type=int,
        default=None,
        help="prefill token buckets to choose (default: as many as the "
        "default list has)",
    )
    parser.add_argument(
        "--max-decode-buckets",
        type=int,
        default=None,
        help="decode batch buckets to choose (default: as many as the default "
        "list has)",
    )
    parser.add_argument(
        "--max-context-buckets",
        type=int,
        default=DEFAULT_MAX_CONTEXT_BUCKETS,
        help="decode context buckets to choose (default: %(default)s)",
    )
    parser.add_argument(
        "--align",
        type=int,
        default=None,
        help="every tuned bucket but the maximum a multiple of this, for all "
        "kinds (default: per kind, below)",
    )
    parser.add_argument(
        "--align-prefill",
        type=int,
        default=None,
        help="prefill token alignment (default: 128, the tile compiled "
        "attention kernels use)",
    )
    parser.add_argument(
        "--align-batch",
        type=int,
        default=None,
        help="decode batch alignment (default: 1)",
    )
    parser.add_argument(
        "--align-context",
        type=int,
        default=None,
        help="decode context alignment (default: the KV block size)",
    )
    parser.add_argument(
        "--compile-budget-minutes",
        type=float,
        default=None,
        help="choose how many buckets of each kind to compile within this "
        "many minutes (--max-*-buckets become the upper limits); prints the "
        "Pareto table (default: off, the counts as given)",
    )
    parser.add_argument(
        "--compile-seconds-per-bucket",
        type=float,
        default=None,
        help="seconds to compile one bucket's graph, for the budget (default: "
        "the --cost-profile's measured compile seconds if it has them, else "
        f"{DEFAULT_COMPILE_SECONDS:g})",
    )
    parser.add_argument(
        "--sample-exact",
        action="store_true",
        help="tune the exact optimum for this sample (default: buckets for the "
        "traffic the sample stands for: smoothed, with a ladder above its "
        "range; docs/benchmark.md, robust tuning)",
    )
    parser.add_argument(
        "--split-decodes",
        action="store_true",
        help="add decode_split_break_even_positions, derived from the cost "
        "model, to the config: decode batches split in two by context where "
        "that reads less KV (docs/options.md; default: off)",
    )
    parser.add_argument(
        "--holdout",
        type=float,
        default=None,
        metavar="FRACTION",
        help="tune on the rest and report, on this share of the requests (the "
        "last by arrival for a trace with its own times, a random share "
        "otherwise), the tuned config against that part's own optimum and "
        "power-of-two buckets (default: off)",
    )
    parser.add_argument(
        "--holdout-workload",
        metavar="FILE",
        help="hold out this trace instead (read with the same options; default: off)",
    )
    parser.add_argument(
        "--output",
        metavar="FILE",
        type=output_file,
        help="write the tuned neuron_config there (default: print it only)",
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        metavar="FILE",
        type=output_file,
        help="write the tuned config and, with a budget, the Pareto table as "
        "JSON (default: no file)",
    )


def tune_options(args: argparse.Namespace) -> TuneOptions:
    """The ``TuneOptions`` of the parsed arguments; ``ValueError`` naming
    ``--config`` when it is not JSON."""
    try:
        base = json.loads(args.config)
    except json.JSONDecodeError as error:
        raise ValueError(f"--config {args.config!r}: invalid JSON ({error})") from None
    return TuneOptions(
        base=base,
        max_prefill_buckets=args.max_prefill_buckets,
        max_decode_buckets=args.max_decode_buckets,
        max_context_buckets=args.max_context_buckets,
        align=args.align,
        align_prefill=args.align_prefill,
        align_batch=args.align_batch,
        align_context=args.align_context,
        compile_budget_minutes=args.compile_budget_minutes,
        compile_seconds_per_bucket=args.compile_seconds_per_bucket,
        robust=not args.sample_exact,
        split_decodes=args.split_decodes,
    )


def run(args: argparse.Namespace) -> int:
    options = tune_options(args)
    cost, settings = engine_setup(engine_choice(args))
    setup = check_tune_options(options, settings, cost)
    workload = workload_options(args)
    specs, fit = build_workload(workload, settings.max_model_len)
    specs, held = _held_out(args, workload, specs, settings.max_model_len)
    print(
        describe_setup(workload.name, cost, settings, len(specs), fit), file=sys.stderr
    )
    tuned = tune(setup, specs, settings, cost)
    _print_tuned(args, setup, tuned)
    report = tuned.budget_report(setup)
    if held is not None:
        result = holdout.evaluate(setup, tuned.neuron_config, held, settings, cost)
        print(holdout.format_holdout(result), file=sys.stderr)
        note = holdout.load_note(specs, held)
        if note is not None:
            print(note, file=sys.stderr)
        report["holdout"] = {**result.as_dict(), "load_note": note}
    text = json.dumps(tuned.neuron_config)
    print(text)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text + "\n")
    if args.json_path:
        with open(args.json_path, "w") as handle:
            json.dump(
                {"neuron_config": tuned.neuron_config, **report}, handle, indent=1
            )
    return 0


def _held_out(
    args: argparse.Namespace,
    workload: WorkloadOptions,
    specs: list[RequestSpec],
    max_model_len: int,
) -> tuple[list[RequestSpec], list[RequestSpec] | None]:
    """(requests to tune on, requests held out or ``None``)."""
    if args.holdout is not None and args.holdout_workload is not None:
        raise holdout.HoldoutError(
            "--holdout and --holdout-workload exclude each other"
        )
    if args.holdout_workload is not None:
        other = replace(workload, trace=args.holdout_workload)
        held = build_workload(other, max_model_len)[0]
        holdout.check_parts(len(specs), len(held))
        return specs, held
    if args.holdout is None:
        return specs, None
    by_time = holdout.splits_in_time(specs, workload.trace is not None)
    return holdout.split(specs, args.holdout, by_time, workload.seed)


def _print_tuned(args: argparse.Namespace, setup: TuneSetup, tuned: Tuned) -> None:
    """What was observed and chosen, on stderr (the Pareto table with a
    budget)."""
    shapes = tuned.shapes
    print(
        f"{len(shapes.prefill_tokens)} prefill and {len(shapes.decode_batches)} "
        "decode steps observed",
        file=sys.stderr,
    )
    print(format_tune_result(tuned.result), file=sys.stderr)
    if setup.compile_seconds is not None and tuned.chosen is not None:
        print(
            f"compile budget {args.compile_budget_minutes:g} min at "
            f"{setup.compile_seconds.prefill:g} s per prefill and "
            f"{setup.compile_seconds.decode:g} s per decode graph:",
            file=sys.stderr,
        )
        print(format_frontier(tuned.rows, tuned.rows[tuned.chosen]), file=sys.stderr)
