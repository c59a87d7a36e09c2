"""How many buckets of each kind to compile within a compile-time budget.

Every bucket is a compiled graph: one per prefill token bucket, and one per
(decode batch bucket, decode context bucket) pair, since a static decode
graph fixes both. More buckets mean less padding and more compile time. For
every count of each kind (up to the given maxima) the exact optimum bucket
list is found (``buckets.optimal_buckets``); each combination is then charged
by replaying the observed steps at its padded shapes through the cost model
(the scheduler's steps do not depend on the intermediate buckets: admission
and packing see only the largest). The combinations that no cheaper one
beats form the Pareto frontier; within the budget the fastest is chosen.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from neuron_scheduler.buckets import (
    aligned_sizes_below,
    optimal_buckets,
    padding_cost,
    smallest_bucket,
)
from neuron_scheduler.sim.cost_model import CostModel, StepShape
from neuron_scheduler.sim.robust_buckets import robust_buckets


class CompileBudgetError(ValueError):
    """A budget below one bucket of each kind, or bad compile seconds."""


@dataclass(frozen=True)
class CompileSeconds:
    """Seconds to compile one prefill graph and one decode graph."""

    prefill: float
    decode: float

    def __post_init__(self) -> None:
        for kind, seconds in (("prefill", self.prefill), ("decode", self.decode)):
            if not seconds > 0:
                raise CompileBudgetError(
                    f"compile seconds per {kind} bucket must be > 0, got {seconds}"
                )

    @classmethod
    def from_profile(cls, measured: Mapping[str, float]) -> CompileSeconds | None:
        """The mean of a profile's ``compile_seconds`` per kind (keys
        ``"prefill:<tokens>"`` / ``"decode:<rows>"``), or ``None`` if it
        lacks either kind."""
        kinds: dict[str, list[float]] = {"prefill": [], "decode": []}
        for key, seconds in measured.items():
            kind = key.split(":", 1)[0]
            if kind in kinds:
                kinds[kind].append(seconds)
        if not kinds["prefill"] or not kinds["decode"]:
            return None
        return cls(
            sum(kinds["prefill"]) / len(kinds["prefill"]),
            sum(kinds["decode"]) / len(kinds["decode"]),
        )

    def minutes(self, prefill: int, batch: int, context: int) -> float:
        """Compile minutes of ``prefill`` token buckets and ``batch`` x
        ``context`` decode graphs."""
        return (prefill * self.prefill + batch * context * self.decode) / 60


@dataclass(frozen=True)
class BudgetRow:
    """One point of the frontier: the bucket lists, the padding share of
    each kind, the replayed step seconds and the compile minutes.
    ``output_throughput`` is filled in by a simulation of the row."""

    prefill: tuple[int, ...]
    batch: tuple[int, ...]
    context: tuple[int, ...]
    prefill_padding: float
    batch_padding: float
    context_padding: float
    step_seconds: float
    compile_minutes: float
    output_throughput: float | None = None

    @property
    def counts(self) -> tuple[int, int, int]:
        return len(self.prefill), len(self.batch), len(self.context)

    def as_dict(self) -> dict[str, object]:
        return {
            "prefill_buckets": list(self.prefill),
            "batch_buckets": list(self.batch),
            "context_buckets": list(self.context),
            "prefill_padding": self.prefill_padding,
            "batch_padding": self.batch_padding,
            "context_padding": self.context_padding,
            "replayed_step_seconds": self.step_seconds,
            "compile_minutes": self.compile_minutes,
            "output_throughput": self.output_throughput,
        }


def _ratio(padding: float, values: Sequence[int], weights: Sequence[float]) -> float:
    useful = sum(v * w for v, w in zip(values, weights, strict=True))
    return padding / (padding + useful) if padding + useful else 0.0


def _optima(
    values: Sequence[int],
    weights: Sequence[float],
    max_count: int,
    maximum: int,
    align: int,
    robust: bool,
) -> list[tuple[tuple[int, ...], float]]:
    """(buckets, padding share on the sample) for 1 .. ``max_count``
    buckets (fewer when the alignment leaves no room for more), robust or
    the sample's exact optimum."""
    most = min(max_count, aligned_sizes_below(maximum, align) + 1)
    choose = robust_buckets if robust else optimal_buckets
    result = []
    for count in range(1, most + 1):
        buckets = choose(values, weights, count, maximum, align)
        ratio = _ratio(padding_cost(buckets, values, weights), values, weights)
        result.append((buckets, ratio))
    return result


def pareto_frontier(
    prefill_tokens: Sequence[int],
    decode_steps: Sequence[tuple[int, int]],
    cost: CostModel,
    compile_seconds: CompileSeconds,
    *,
    maxima: tuple[int, int, int],
    max_counts: tuple[int, int, int],
    alignment: tuple[int, int, int],
    robust: bool = True,
) -> list[BudgetRow]:
    """The frontier, cheapest compile first: each row replays faster than
    every row that compiles in less time.

    ``prefill_tokens``: each prefill step's total tokens; ``decode_steps``:
    each decode step's (batch, longest context); ``maxima``: the required
    largest (prefill tokens, batch, context); ``max_counts`` and
    ``alignment`` per kind in the same order.
    """
    (max_tokens, max_seqs, max_len), (n_pre, n_batch, n_ctx) = maxima, max_counts
    (a_pre, a_batch, a_ctx) = alignment
    prefill_options = _prefill_options(
        prefill_tokens, cost, n_pre, max_tokens, a_pre, robust
    )
    decode_options = _decode_options(
        decode_steps,
        cost,
        (n_batch, n_ctx),
        (max_seqs, max_len),
        (a_batch, a_ctx),
        robust,
    )
    rows_all = [
        BudgetRow(
            pre,
            batch,
            ctx,
            pre_ratio,
            batch_ratio,
            ctx_ratio,
            pre_seconds + dec_seconds,
            compile_seconds.minutes(len(pre), len(batch), len(ctx)),
        )
        for pre, pre_ratio, pre_seconds in prefill_options
        for batch, batch_ratio, ctx, ctx_ratio, dec_seconds in decode_options
    ]
    rows_all.sort(key=lambda r: (r.compile_minutes, r.step_seconds))
    frontier: list[BudgetRow] = []
    for row in rows_all:
        if not frontier or row.step_seconds < frontier[-1].step_seconds:
            frontier.append(row)
    return frontier


def _prefill_options(
    prefill_tokens: Sequence[int],
    cost: CostModel,
    max_count: int,
    maximum: int,
    align: int,
    robust: bool,
) -> list[tuple[tuple[int, ...], float, float]]:
    """Per prefill bucket count up to ``max_count``: the optimal buckets,
    their padding ratio and the seconds the prefill steps take on them."""
    prefills = Counter(prefill_tokens)
    values, weights = list(prefills), [float(c) for c in prefills.values()]
    options = []
    for buckets, ratio in _optima(values, weights, max_count, maximum, align, robust):
        seconds = sum(
            count
            * cost.mean_step_time(StepShape(((smallest_bucket(buckets, tokens), 0),)))
            for tokens, count in prefills.items()
        )
        options.append((buckets, ratio, seconds))
    return options


def _decode_options(
    decode_steps: Sequence[tuple[int, int]],
    cost: CostModel,
    max_counts: tuple[int, int],
    maxima: tuple[int, int],
    alignment: tuple[int, int],
    robust: bool,
) -> list[tuple[tuple[int, ...], float, tuple[int, ...], float, float]]:
    """Per (batch, context) bucket count pair: the optimal batch buckets
    and their padding, the context buckets optimal under them (context
    padding weighted by the padded rows that read it) and theirs, and the
    seconds the decode steps take."""
    (n_batch, n_ctx), (max_seqs, max_len), (a_batch, a_ctx) = (
        max_counts,
        maxima,
        alignment,
    )
    decodes = Counter(decode_steps)
    batches = Counter(batch for batch, _ in decode_steps)
    b_values, b_weights = list(batches), [float(c) for c in batches.values()]
    options = []
    for batch_buckets, batch_ratio in _optima(
        b_values, b_weights, n_batch, max_seqs, a_batch, robust
    ):
        rows: Counter[int] = Counter()
        for (batch, context), count in decodes.items():
            rows[context] += count * smallest_bucket(batch_buckets, batch)
        c_values, c_weights = list(rows), [float(w) for w in rows.values()]
        for context_buckets, context_ratio in _optima(
            c_values, c_weights, n_ctx, max_len, a_ctx, robust
        ):
            seconds = _decode_seconds(decodes, batch_buckets, context_buckets, cost)
            options.append(
                (batch_buckets, batch_ratio, context_buckets, context_ratio, seconds)
            )
    return options


def _decode_seconds(
    decodes: Counter[tuple[int, int]],
    batch_buckets: tuple[int, ...],
    context_buckets: tuple[int, ...],
    cost: CostModel,
) -> float:
    """Seconds the decode steps take padded to these buckets."""
    padded: Counter[tuple[int, int, int, int]] = Counter()
    for (batch, context), count in decodes.items():
        key = (
            smallest_bucket(batch_buckets, batch),
            smallest_bucket(context_buckets, context),
            context,
            batch,
        )
        padded[key] += count
    return sum(
        count * cost.mean_step_time(StepShape((), rows, ctx, True, actual, real))
        for (rows, ctx, actual, real), count in padded.items()
    )


def within_budget(frontier: list[BudgetRow], budget_minutes: float) -> list[BudgetRow]:
    """The frontier's rows that compile within ``budget_minutes``; raises
    ``CompileBudgetError`` with the numbers when not even one bucket of each
    kind fits."""
    cheapest = frontier[0].compile_minutes
    if budget_minutes < cheapest:
        raise CompileBudgetError(
            f"--compile-budget-minutes {budget_minutes:g} is below one bucket of "
            f"each kind ({cheapest:.2f} minutes)"
        )
    return [row for row in frontier if row.compile_minutes <= budget_minutes]


def format_frontier(rows: Sequence[BudgetRow], chosen: BudgetRow) -> str:
    """The Pareto table: buckets per kind, padding, throughput, minutes."""
    lines = [
        f"{'buckets p/b/c':<15}{'graphs':>7}{'prefill pad':>12}{'batch pad':>10}"
        f"{'context pad':>12}{'output tok/s':>13}{'compile min':>12}"
    ]
    for row in rows:
        p, b, c = row.counts
        throughput = (
            f"{row.output_throughput:.1f}" if row.output_throughput is not None else "-"
        )
        mark = "  <- chosen" if row is chosen else ""
        lines.append(
            f"{f'{p}/{b}/{c}':<15}{p + b * c:>7}{row.prefill_padding:>12.1%}"
            f"{row.batch_padding:>10.1%}{row.context_padding:>12.1%}"
            f"{throughput:>13}{row.compile_minutes:>12.1f}{mark}"
        )
    lines.append(
        "graphs: one per prefill bucket and one per (batch, context) bucket pair; "
        "output tok/s: simulated with the row's buckets"
    )
    return "\n".join(lines)
