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
    from neuron_scheduler.bench.command import add_arguments

    add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from neuron_scheduler.demo import run_demo

        run_demo(args.model_dir, args.max_tokens)
        return 0
    from neuron_scheduler.bench.command import run

    try:
        return run(args)
    except ValueError as error:  # bad workload / option: say what, no traceback
        parser.exit(2, f"neuron-scheduler bench: error: {error}\n")


if __name__ == "__main__":
    raise SystemExit(main())
