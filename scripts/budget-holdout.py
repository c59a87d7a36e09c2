"""Does a config tuned within a compile budget hold on other traffic?

For each ``--seeds`` value (the workload's seed), tunes within the budget
on the workload (or, with ``--holdout``, on the part ``tune --holdout``
keeps) and simulates, on the sample tuned on, on the part held out and on
each ``--fresh REQUESTS:SEED`` sample of the same source, the tuned config
and the power-of-two buckets at its bucket counts (as many graphs): what
tuning gains over not tuning at the same compile cost, on the traffic it
was tuned on and on traffic it was not. Every other argument is
``tune``'s (``--compile-budget-minutes`` required).

Usage: .venv/bin/python scripts/budget-holdout.py --compile-budget-minutes 10
       [--seeds 0] [--holdout 0.3] [--fresh 300:7 200:11] [tune's arguments]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from neuron_scheduler.cli import tune as tune_cli
from neuron_scheduler.cli.options import engine_choice, workload_options
from neuron_scheduler.config import SHAPE_BUCKET_KEYS
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.sim import holdout
from neuron_scheduler.sim.policies import Policy
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.run_setup import engine_setup
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.tuning import check_tune_options, tune
from neuron_scheduler.sim.workload import build_workload


def _throughput(specs: list[Any], config: dict[str, Any], settings, cost) -> float:
    run = simulate(specs, Policy("config", NeuronScheduler, config), settings, cost)
    return float(compute_metrics(run)["output_throughput"])


def evaluate(
    args: argparse.Namespace, seed: int, setup, settings, cost
) -> dict[str, Any]:
    """The tuned lists and, per part, tuned and powers-of-two tok/s: the
    sample tuned on, the part held out (``--holdout``) and each ``--fresh``
    sample of the same source."""
    workload = replace(workload_options(args), seed=seed)
    tuning, _ = build_workload(workload, settings.max_model_len)
    parts = {}
    if args.holdout is not None:
        by_time = holdout.splits_in_time(tuning, workload.trace is not None)
        tuning, parts["held out"] = holdout.split(tuning, args.holdout, by_time, seed)
    for count, fresh_seed in args.fresh:
        fresh = replace(workload, num_requests=count, seed=fresh_seed)
        parts[f"fresh {count}:{fresh_seed}"] = build_workload(
            fresh, settings.max_model_len
        )[0]
    tuned = tune(setup, tuning, settings, cost).neuron_config
    powers = holdout.powers_of_two_config(setup, tuned)
    figures = {
        name: {
            "tuned": _throughput(part, tuned, settings, cost),
            "powers": _throughput(part, powers, settings, cost),
        }
        for name, part in {"tuning": tuning, **parts}.items()
    }
    return {"seed": seed, "tuned": tuned, "parts": figures}


def _count_and_seed(text: str) -> tuple[int, int]:
    count, _, seed = text.partition(":")
    try:
        return int(count), int(seed)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected REQUESTS:SEED, e.g. 300:7"
        ) from None


def _line(result: dict[str, Any]) -> str:
    tuned = result["tuned"]
    lists = " / ".join(str(tuned[key]) for key in SHAPE_BUCKET_KEYS)
    parts = "; ".join(
        f"{name}: {p['tuned']:.1f} vs {p['powers']:.1f} tok/s, "
        f"{p['tuned'] / p['powers']:.3f}x"
        for name, p in result["parts"].items()
    )
    return f"seed {result['seed']}: {parts}  [{lists}]"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tune_cli.add_arguments(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--fresh", type=_count_and_seed, nargs="*", default=[], metavar="N:SEED"
    )
    args = parser.parse_args(argv)
    if args.compile_budget_minutes is None:
        parser.error("--compile-budget-minutes is required")
    if args.holdout is None and not args.fresh:
        parser.error("nothing to hold out: give --holdout or --fresh")
    cost, settings = engine_setup(engine_choice(args))
    setup = check_tune_options(tune_cli.tune_options(args), settings, cost)
    results = []
    for seed in args.seeds:
        results.append(evaluate(args, seed, setup, settings, cost))
        print(_line(results[-1]), flush=True)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
