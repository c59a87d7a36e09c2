"""Held-out evaluation of tuned buckets (``tune --holdout``).

The workload is split into a part to tune on and a part held out: in time
for a trace with its own arrival times (the tuning part first, as
yesterday's traffic is to today's), at random otherwise; or the held-out
part is another trace (``--holdout-workload``). On the held-out part the
tuned config is simulated next to that part's own sample-exact optimum (the
best any tuning of it could do) and to the power-of-two buckets with the
same options (what not tuning gives). Within a compile budget both compare
at the tuned config's cost: the own optimum is chosen within the budget,
and the powers of two take the tuned config's bucket counts (as many
graphs).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from neuron_scheduler.config import SHAPE_BUCKET_KEYS
from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.sim.cost_model import CostModel
from neuron_scheduler.sim.policies import Policy
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.tuner import top_powers_of_two
from neuron_scheduler.sim.tuning import TuneSetup, tune
from neuron_scheduler.sim.workload import RequestSpec

#: The fewest requests either part may have.
MIN_PART_REQUESTS = 20
#: The figures compared per config.
COMPARED = (
    "output_throughput",
    "prefill_padding_ratio",
    "decode_padding_ratio",
    "decode_kv_read_padding_ratio",
)


class HoldoutError(ValueError):
    """A held-out split that cannot be made as asked (with the numbers)."""


def splits_in_time(specs: Sequence[RequestSpec], from_trace: bool) -> bool:
    """Whether ``specs`` are held out in time: a trace with its own arrival
    times is (yesterday's traffic against today's); anything else is split
    at random."""
    return from_trace and any(s.arrival_s > 0 for s in specs)


def split(
    specs: Sequence[RequestSpec], fraction: float, by_time: bool, seed: int
) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """(tuning part, held-out part): the last ``fraction`` of the requests
    by arrival when ``by_time`` (the held-out part's times start at 0),
    else a random ``fraction`` (``seed``), each part in arrival order."""
    if not 0 < fraction < 1:
        raise HoldoutError(f"--holdout must be in (0, 1), got {fraction!r}")
    held_count = round(len(specs) * fraction)
    if by_time:
        ordered = sorted(specs, key=lambda s: s.arrival_s)
        cut = len(ordered) - held_count
        tuning, held = ordered[:cut], ordered[cut:]
        start = held[0].arrival_s if held else 0.0
        held = [replace(s, arrival_s=s.arrival_s - start) for s in held]
    else:
        chosen = set(random.Random(seed).sample(range(len(specs)), held_count))
        tuning = [s for i, s in enumerate(specs) if i not in chosen]
        held = [s for i, s in enumerate(specs) if i in chosen]
    check_parts(len(tuning), len(held), fraction)
    return tuning, held


def check_parts(tuning: int, held: int, fraction: float | None = None) -> None:
    """``HoldoutError`` when either part has fewer than
    ``MIN_PART_REQUESTS`` requests, with the counts."""
    if min(tuning, held) < MIN_PART_REQUESTS:
        split_text = f" (--holdout {fraction:g})" if fraction is not None else ""
        raise HoldoutError(
            f"the split{split_text} leaves {tuning} requests to tune on and {held} "
            f"held out; each part needs at least {MIN_PART_REQUESTS}"
        )


def load_note(tuning: Sequence[RequestSpec], held: Sequence[RequestSpec]) -> str | None:
    """What to know when both parts are sent at once and differ in size: the
    held-out part is then another load (batch sizes follow the load), not
    only other requests; ``None`` otherwise."""
    at_once = all(s.arrival_s == 0 for s in (*tuning, *held))
    if not at_once or len(tuning) == len(held):
        return None
    return (
        f"note: every request is sent at once, so the held-out part is a load "
        f"of {len(held)} at once against the {len(tuning)} tuned on, and its "
        "batches differ with the load; to compare like with like, hold out a "
        "sample of the load you tune for (--holdout-workload)"
    )


@dataclass(frozen=True)
class HoldoutResult:
    """Per config (tuned, the held-out part's own optimum, powers of two):
    its ``neuron_config`` and ``COMPARED`` figures on the held-out part."""

    num_requests: int
    configs: dict[str, dict[str, Any]]

    def ratio(self, label: str, to: str) -> float:
        """Output throughput of ``label`` over that of ``to``."""
        mine = self.configs[label]["output_throughput"]
        theirs = self.configs[to]["output_throughput"]
        return mine / theirs if theirs else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_requests": self.num_requests,
            "configs": self.configs,
            "tuned_vs_own_optimum": self.ratio("tuned", "own-optimum"),
            "tuned_vs_powers_of_two": self.ratio("tuned", "powers-of-two"),
        }


def evaluate(
    setup: TuneSetup,
    tuned: dict[str, Any],
    held: list[RequestSpec],
    settings: EngineSettings,
    cost: CostModel,
) -> HoldoutResult:
    """Simulate ``held`` with the tuned config, with its own sample-exact
    optimum (tuned on it, same options) and with power-of-two buckets."""
    own = tune(replace(setup, options=replace(setup.options, robust=False)), held,
               settings, cost).neuron_config  # fmt: skip
    powers = powers_of_two_config(setup, tuned)
    configs = {"tuned": tuned, "own-optimum": own, "powers-of-two": powers}
    figures = {}
    for label, config in configs.items():
        run = simulate(held, Policy(label, NeuronScheduler, config), settings, cost)
        metrics = compute_metrics(run)
        figures[label] = {
            "neuron_config": config,
            **{key: metrics[key] for key in COMPARED},
        }
    return HoldoutResult(len(held), figures)


def powers_of_two_config(setup: TuneSetup, tuned: dict[str, Any]) -> dict[str, Any]:
    """The options with power-of-two buckets, what not tuning gives: the
    default token and batch buckets and as many context buckets as the
    context count allows; within a compile budget, as many of each kind as
    ``tuned`` has (as many graphs), the top powers of two below each
    maximum."""
    base = {k: v for k, v in setup.carried.items() if k not in SHAPE_BUCKET_KEYS}
    limits = setup.limits
    if setup.compile_seconds is None:
        count = setup.counts["max_context_buckets"]
        context = top_powers_of_two(limits.max_model_len, count)
        return {**base, "decode_context_length_buckets": list(context)}
    maxima = (limits.max_prefill_tokens, limits.max_num_seqs, limits.max_model_len)
    return {
        **base,
        **{
            key: list(top_powers_of_two(maximum, len(tuned[key])))
            for key, maximum in zip(SHAPE_BUCKET_KEYS, maxima, strict=True)
        },
    }


def format_holdout(result: HoldoutResult) -> str:
    """One line per config: throughput, its ratio to the own optimum, and
    the padding ratios."""
    lines = [
        f"held out: {result.num_requests} requests",
        f"{'config':<16}{'output tok/s':>14}{'vs own opt':>12}{'prefill pad':>13}"
        f"{'decode pad':>12}{'KV-read pad':>13}",
    ]
    for label, figures in result.configs.items():
        lines.append(
            f"{label:<16}{figures['output_throughput']:>14.1f}"
            f"{result.ratio(label, 'own-optimum'):>12.2f}"
            f"{figures['prefill_padding_ratio']:>13.3f}"
            f"{figures['decode_padding_ratio']:>12.3f}"
            f"{figures['decode_kv_read_padding_ratio']:>13.3f}"
        )
    return "\n".join(lines)
