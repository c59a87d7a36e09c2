"""``neuron-scheduler demo``: vLLM with NeuronScheduler on a tiny local
model."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-dir", help="where to make/reuse the tiny model (default: a temp dir)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=8,
        help="tokens generated per prompt (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    from neuron_scheduler.offline.demo import run_demo

    run_demo(args.model_dir, args.max_tokens)
    return 0
