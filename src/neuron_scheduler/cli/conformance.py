"""``neuron-scheduler conformance``: vLLM's own scheduler tests with the
stock scheduler and with ours, compared."""

from __future__ import annotations

import argparse

from neuron_scheduler.cli.options import output_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tests",
        default=None,
        help="root of vLLM's test tree holding tests/v1/core "
        "(default: ../shared/vllm-<installed version>-tests)",
    )
    parser.add_argument(
        "--json",
        type=output_file,
        help="also write each test's outcome and verdict to this file (default: "
        "no file)",
    )


def run(args: argparse.Namespace) -> int:
    from neuron_scheduler.conformance.runner import run_command

    return run_command(args.tests, args.json)
