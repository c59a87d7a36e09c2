"""The bucket tuner: buckets that minimise padding for a workload.

The shapes come from one simulated run of the real scheduler with the given
``neuron_config`` (so chunking at ``max_num_batched_tokens``, prefix-cache
hits, packing and the decode batches the admission rule allows are all as
they would be): the total tokens of every prefill step, the batch size of
every decode step, and every decode step's longest context. Each bucket list
is then the exact optimum of ``buckets.optimal_buckets``:

* prefill: padded tokens, each step weighted 1;
* decode batch: padded slots, each step weighted 1;
* decode context: KV positions read, each step weighted by its padded batch
  under the tuned batch buckets (every padded row reads the whole bucket).

With ``--compile-budget-minutes`` the tuner also chooses how many buckets of
each kind to compile (``compile_budget``): a Pareto table of bucket counts,
padding, simulated output throughput and compile minutes, and the config of
the row with the highest throughput within the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from neuron_scheduler.buckets import (
    aligned_sizes_below,
    default_seq_buckets,
    default_token_buckets,
    optimal_buckets,
    padding_cost,
    powers_of_two_buckets,
    smallest_bucket,
)
from neuron_scheduler.config import EngineLimits, NeuronConfig
from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.sim.compile_budget import (
    BudgetRow,
    CompileBudgetError,
    CompileSeconds,
    pareto_frontier,
    within_budget,
)
from neuron_scheduler.sim.cost_model import CostModel
from neuron_scheduler.sim.policies import Policy
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.robust_buckets import robust_buckets
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.workload import RequestSpec
from neuron_scheduler.step import StepKind, StepRecord

DEFAULT_MAX_CONTEXT_BUCKETS = 8
#: Seconds to compile one bucket's graph when nothing measured says better
#: (Neuron graphs of an 8B model take ~15-40 s each).
DEFAULT_COMPILE_SECONDS = 30.0
#: Frontier rows simulated at most (evenly spaced, the fastest included).
MAX_SIMULATED_ROWS = 10


@dataclass
class ObservedShapes:
    """What the scheduler produced, step by step."""

    prefill_tokens: list[int] = field(default_factory=list)
    decode_batches: list[int] = field(default_factory=list)
    decode_contexts: list[int] = field(default_factory=list)

    def add(self, record: StepRecord) -> None:
        if record.kind is StepKind.PREFILL:
            self.prefill_tokens.append(record.total_actual)
        elif record.kind is StepKind.DECODE:
            self.decode_batches.append(record.num_seqs)
            self.decode_contexts.append(record.context_len)


@dataclass(frozen=True)
class BucketChoice:
    """One bucket list and the padding it costs on the observed shapes."""

    name: str
    buckets: tuple[int, ...]
    padding: float
    padded_total: float

    @property
    def padding_ratio(self) -> float:
        return self.padding / self.padded_total if self.padded_total else 0.0


def _choice(
    name: str, buckets: tuple[int, ...], values: Sequence[int], weights: Sequence[float]
) -> BucketChoice:
    padding = padding_cost(buckets, values, weights)
    return BucketChoice(
        name,
        buckets,
        padding,
        padding + float(sum(v * w for v, w in zip(values, weights, strict=True))),
    )


def top_powers_of_two(maximum: int, count: int) -> tuple[int, ...]:
    """``count`` buckets: ``maximum`` and the powers of two just below it."""
    return powers_of_two_buckets(maximum)[-count:]


@dataclass(frozen=True)
class TuneResult:
    """Per bucket list, the choices compared; the last is the tuned one."""

    prefill: tuple[BucketChoice, ...]
    decode: tuple[BucketChoice, ...]
    context: tuple[BucketChoice, ...]

    def neuron_config(self, base: dict[str, Any]) -> dict[str, Any]:
        return {
            **base,
            "num_batched_tokens_buckets": list(self.prefill[-1].buckets),
            "num_seqs_buckets": list(self.decode[-1].buckets),
            "decode_context_length_buckets": list(self.context[-1].buckets),
        }


def check_bucket_counts(**counts: int) -> None:
    """Raise ``ValueError`` naming the option if a bucket count is below 1
    (``max_prefill_buckets=0`` -> ``--max-prefill-buckets``)."""
    for name, value in counts.items():
        if value < 1:
            option = "--" + name.replace("_", "-")
            raise ValueError(f"{option} must be >= 1, got {value}")


@dataclass(frozen=True)
class Alignment:
    """What every tuned bucket but the maximum must be a multiple of:
    compiled kernels tile prefill by 128 tokens, KV comes in blocks."""

    prefill: int = 128
    batch: int = 1
    context: int = 16

    def check(
        self, limits: EngineLimits, prefill: int, decode: int, context: int
    ) -> None:
        """Raise ``ValueError`` with the numbers when an alignment is below 1
        or leaves fewer sizes below a maximum than the buckets asked for."""
        kinds = (
            ("prefill", self.prefill, limits.max_prefill_tokens, prefill, "prefill"),
            ("batch", self.batch, limits.max_num_seqs, decode, "decode"),
            ("context", self.context, limits.max_model_len, context, "context"),
        )
        for kind, align, maximum, buckets, count_option in kinds:
            if align < 1:
                raise ValueError(f"--align-{kind} must be >= 1, got {align}")
            room = aligned_sizes_below(maximum, align)
            if buckets - 1 > room:
                raise ValueError(
                    f"--align-{kind} {align} leaves {room} bucket sizes below the "
                    f"maximum {maximum}; --max-{count_option}-buckets {buckets} "
                    f"needs {buckets - 1}"
                )


def _tuned(
    values: Sequence[int],
    weights: Sequence[float],
    max_buckets: int,
    maximum: int,
    align: int,
    robust: bool,
) -> tuple[BucketChoice, ...]:
    """The sample's exact optimum and, with ``robust``, then the robust
    choice (``robust_buckets``): the last is the one tuned."""
    exact = optimal_buckets(values, weights, max_buckets, maximum, align)
    choices = [_choice("sample-exact", exact, values, weights)]
    if robust:
        buckets = robust_buckets(values, weights, max_buckets, maximum, align)
        choices.append(_choice("robust", buckets, values, weights))
    return tuple(choices)


def tune_buckets(
    shapes: ObservedShapes,
    limits: EngineLimits,
    *,
    max_prefill_buckets: int,
    max_decode_buckets: int,
    max_context_buckets: int,
    alignment: Alignment | None = None,
    robust: bool = True,
) -> TuneResult:
    """Bucket lists for ``shapes`` under ``alignment`` (default: none),
    next to the default lists: with ``robust`` those for the traffic the
    sample stands for (``robust_buckets``), else the sample's exact
    optimum."""
    check_bucket_counts(
        max_prefill_buckets=max_prefill_buckets,
        max_decode_buckets=max_decode_buckets,
        max_context_buckets=max_context_buckets,
    )
    alignment = alignment or Alignment(1, 1, 1)
    alignment.check(
        limits, max_prefill_buckets, max_decode_buckets, max_context_buckets
    )
    prefill_max = limits.max_prefill_tokens
    ones = [1.0] * len(shapes.prefill_tokens)
    prefill = (
        _choice(
            "default", default_token_buckets(prefill_max), shapes.prefill_tokens, ones
        ),
        *_tuned(
            shapes.prefill_tokens,
            ones,
            max_prefill_buckets,
            prefill_max,
            alignment.prefill,
            robust,
        ),
    )
    ones = [1.0] * len(shapes.decode_batches)
    decode = (
        _choice(
            "default",
            default_seq_buckets(limits.max_num_seqs),
            shapes.decode_batches,
            ones,
        ),
        *_tuned(
            shapes.decode_batches,
            ones,
            max_decode_buckets,
            limits.max_num_seqs,
            alignment.batch,
            robust,
        ),
    )
    rows = [
        float(smallest_bucket(decode[-1].buckets, b)) for b in shapes.decode_batches
    ]
    contexts = shapes.decode_contexts
    context = (
        _choice("default", (limits.max_model_len,), contexts, rows),
        _choice(
            f"powers of two x{max_context_buckets}",
            top_powers_of_two(limits.max_model_len, max_context_buckets),
            contexts,
            rows,
        ),
        *_tuned(
            contexts,
            rows,
            max_context_buckets,
            limits.max_model_len,
            alignment.context,
            robust,
        ),
    )
    return TuneResult(prefill, decode, context)


def format_tune_result(result: TuneResult) -> str:
    lines = [f"{'shape':<16}{'buckets':<20}{'padding':>8}  list"]
    groups = (
        ("prefill tokens", result.prefill),
        ("decode batch", result.decode),
        ("decode context", result.context),
    )
    for title, choices in groups:
        for choice in choices:
            lines.append(
                f"{title:<16}{choice.name:<20}{choice.padding_ratio:>8.1%}  "
                f"{list(choice.buckets)}"
            )
            title = ""
    lines.append(
        "padding: share of padded work that is padding (prefill tokens, decode "
        "slots, decode KV positions read)"
    )
    return "\n".join(lines)


@dataclass(frozen=True)
class TuneOptions:
    """What to tune for and how many buckets (``None``: the default list's
    count); ``compile_budget_minutes``: choose the counts within it."""

    base: dict[str, Any] = field(default_factory=dict)
    max_prefill_buckets: int | None = None
    max_decode_buckets: int | None = None
    max_context_buckets: int = DEFAULT_MAX_CONTEXT_BUCKETS
    align: int | None = None
    align_prefill: int | None = None
    align_batch: int | None = None
    align_context: int | None = None
    compile_budget_minutes: float | None = None
    compile_seconds_per_bucket: float | None = None
    #: Buckets for the traffic the sample stands for (``robust_buckets``);
    #: ``False``: the sample's exact optimum.
    robust: bool = True


@dataclass(frozen=True)
class TuneSetup:
    """``TuneOptions`` checked against an engine: the bucket counts, the
    alignment and the compile seconds (``None``: no budget)."""

    options: TuneOptions
    limits: EngineLimits
    counts: dict[str, int]
    alignment: Alignment
    compile_seconds: CompileSeconds | None


def check_tune_options(
    options: TuneOptions, settings: EngineSettings, cost: CostModel
) -> TuneSetup:
    """The setup ``options`` make for this engine, or ``ValueError`` naming
    the bad option (before anything is simulated)."""
    limits = settings.limits
    NeuronConfig.from_dict(options.base, limits)
    counts = {
        "max_prefill_buckets": len(default_token_buckets(limits.max_prefill_tokens))
        if options.max_prefill_buckets is None
        else options.max_prefill_buckets,
        "max_decode_buckets": len(default_seq_buckets(limits.max_num_seqs))
        if options.max_decode_buckets is None
        else options.max_decode_buckets,
        "max_context_buckets": options.max_context_buckets,
    }
    check_bucket_counts(**counts)
    align = options.align
    alignment = Alignment(
        prefill=options.align_prefill or align or 128,
        batch=options.align_batch or align or 1,
        context=options.align_context or align or settings.block_size,
    )
    alignment.check(limits, *counts.values())
    compile_seconds = _compile_seconds(options, cost)
    return TuneSetup(options, limits, counts, alignment, compile_seconds)


@dataclass
class Tuned:
    """What ``tune`` found: the observed shapes, the tuned buckets, the
    config, and with a budget the Pareto rows and the chosen one."""

    shapes: ObservedShapes
    result: TuneResult
    neuron_config: dict[str, Any]
    rows: list[BudgetRow] = field(default_factory=list)
    chosen: int | None = None

    def budget_report(self, setup: TuneSetup) -> dict[str, Any]:
        """The budget's part of ``tune --json`` (empty without one)."""
        if setup.compile_seconds is None or self.chosen is None:
            return {}
        return {
            "compile_budget_minutes": setup.options.compile_budget_minutes,
            "compile_seconds": {
                "prefill": setup.compile_seconds.prefill,
                "decode": setup.compile_seconds.decode,
            },
            "pareto": [r.as_dict() for r in self.rows],
            "chosen": self.chosen,
        }


def tune(
    setup: TuneSetup,
    specs: list[RequestSpec],
    settings: EngineSettings,
    cost: CostModel,
) -> Tuned:
    """Simulate ``specs`` once with the base config, tune each kind's
    buckets on the shapes seen, and with a budget choose the Pareto row of
    the highest simulated throughput within it."""
    base = setup.options.base
    shapes = ObservedShapes()
    simulate(
        specs, Policy("tune", NeuronScheduler, base), settings, cost, on_step=shapes.add
    )
    result = tune_buckets(
        shapes,
        setup.limits,
        **setup.counts,
        alignment=setup.alignment,
        robust=setup.options.robust,
    )
    tuned = Tuned(shapes, result, result.neuron_config(base))
    if setup.compile_seconds is not None:
        limits, alignment = setup.limits, setup.alignment
        frontier = pareto_frontier(
            shapes.prefill_tokens,
            list(zip(shapes.decode_batches, shapes.decode_contexts, strict=True)),
            cost,
            setup.compile_seconds,
            maxima=(
                limits.max_prefill_tokens,
                limits.max_num_seqs,
                limits.max_model_len,
            ),
            max_counts=tuple(setup.counts.values()),  # type: ignore[arg-type]
            alignment=(alignment.prefill, alignment.batch, alignment.context),
            robust=setup.options.robust,
        )
        budget = setup.options.compile_budget_minutes
        assert budget is not None
        rows = _simulated(within_budget(frontier, budget), base, specs, settings, cost)
        chosen = max(
            (r for r in rows if r.output_throughput is not None),
            key=lambda r: (r.output_throughput, -r.compile_minutes),
        )
        tuned.rows, tuned.chosen = rows, rows.index(chosen)
        tuned.neuron_config = _config_of(chosen, base)
    NeuronConfig.from_dict(tuned.neuron_config, setup.limits)  # valid by construction
    return tuned


def _compile_seconds(options: TuneOptions, cost: CostModel) -> CompileSeconds | None:
    """Seconds per bucket for the budget (``None``: no budget asked for)."""
    per_bucket = options.compile_seconds_per_bucket
    if options.compile_budget_minutes is None:
        if per_bucket is not None:
            raise CompileBudgetError(
                "--compile-seconds-per-bucket needs --compile-budget-minutes"
            )
        return None
    if per_bucket is not None:
        return CompileSeconds(per_bucket, per_bucket)
    if isinstance(cost, ProfileCostModel) and cost.profile.compile_seconds:
        measured = CompileSeconds.from_profile(cost.profile.compile_seconds)
        if measured is not None:
            return measured
    return CompileSeconds(DEFAULT_COMPILE_SECONDS, DEFAULT_COMPILE_SECONDS)


def _config_of(row: BudgetRow, base: dict[str, Any]) -> dict[str, Any]:
    return {
        **base,
        "num_batched_tokens_buckets": list(row.prefill),
        "num_seqs_buckets": list(row.batch),
        "decode_context_length_buckets": list(row.context),
    }


def _simulated(
    rows: list[BudgetRow],
    base: dict[str, Any],
    specs: list[RequestSpec],
    settings: EngineSettings,
    cost: CostModel,
) -> list[BudgetRow]:
    """``rows`` with the simulated output throughput of each (at most
    ``MAX_SIMULATED_ROWS`` of them, evenly spaced, the last included)."""
    step = max(1, -(-len(rows) // MAX_SIMULATED_ROWS))
    picked = set(range(len(rows) - 1, -1, -step))
    result = []
    for index, row in enumerate(rows):
        if index in picked:
            policy = Policy(f"{row.counts}", NeuronScheduler, _config_of(row, base))
            run = simulate(specs, policy, settings, cost)
            throughput = compute_metrics(run)["output_throughput"]
            row = replace(row, output_throughput=throughput)
        result.append(row)
    return result
