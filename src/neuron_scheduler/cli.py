"""``neuron-scheduler`` command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="neuron-scheduler",
        description="Static-shape scheduling for vLLM on Neuron-like accelerators.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="run vLLM with NeuronScheduler on a tiny local model"
    )
    demo.add_argument("--model-dir", help="where to make/reuse the tiny model")
    demo.add_argument("--max-tokens", type=int, default=8)
    bench = commands.add_parser(
        "bench",
        help="simulate a workload through the real schedulers on a cost model",
    )
    from neuron_scheduler.bench import command, tune

    command.add_arguments(bench)
    tuner = commands.add_parser(
        "tune",
        help="print the neuron_config buckets that minimise padding for a workload",
    )
    tune.add_arguments(tuner)
    profiler = commands.add_parser(
        "profile",
        help="measure engine step times for every shape a configuration makes",
    )
    from neuron_scheduler import profile_command

    profile_command.add_arguments(profiler)
    validator = commands.add_parser(
        "validate",
        help="compare the simulator with the real server on this machine",
    )
    from neuron_scheduler import validate

    validate.add_arguments(validator)
    conformance = commands.add_parser(
        "conformance",
        help="run vLLM's own scheduler tests with the stock scheduler and ours",
    )
    conformance.add_argument(
        "--tests",
        default=None,
        help="root of vLLM's test tree holding tests/v1/core "
        "(default: ../shared/vllm-0.32.0-tests)",
    )
    conformance.add_argument(
        "--json", help="also write each test's outcome and verdict to this file"
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from neuron_scheduler.demo import run_demo

        run_demo(args.model_dir, args.max_tokens)
        return 0
    if args.command == "conformance":
        from neuron_scheduler.conformance.runner import run_command

        return run_command(args.tests, args.json)
    runners = {
        "bench": command.run,
        "tune": tune.run,
        "profile": profile_command.run,
        "validate": validate.run_validate,
    }
    run = runners[args.command]
    try:
        return run(args)
    except ValueError as error:  # bad workload / option: say what, no traceback
        parser.exit(2, f"neuron-scheduler {args.command}: error: {error}\n")


if __name__ == "__main__":
    raise SystemExit(main())
