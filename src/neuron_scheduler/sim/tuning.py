"""A ``neuron-scheduler tune`` run: the options checked against an engine
before anything is simulated, the one simulated run whose shapes the bucket
tuner (``tuner``) fits, and with a compile budget the Pareto row chosen by
simulated throughput (``compile_budget``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from neuron_scheduler.buckets import default_seq_buckets, default_token_buckets
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
from neuron_scheduler.sim.decode_split import SPLIT_KEY, break_even_positions
from neuron_scheduler.sim.policies import Policy
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.tuner import (
    DEFAULT_MAX_CONTEXT_BUCKETS,
    Alignment,
    ObservedShapes,
    TuneResult,
    check_bucket_counts,
    tune_buckets,
)
from neuron_scheduler.sim.workload import RequestSpec

#: Seconds to compile one bucket's graph when nothing measured says better
#: (Neuron graphs of an 8B model take ~15-40 s each).
DEFAULT_COMPILE_SECONDS = 30.0
#: Frontier rows simulated at most (evenly spaced, the fastest included).
MAX_SIMULATED_ROWS = 10


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
    #: Add the cost model's ``decode_split_break_even_positions`` to the
    #: config (``sim.decode_split``); the buckets are tuned as without it.
    split_decodes: bool = False


@dataclass(frozen=True)
class TuneSetup:
    """``TuneOptions`` checked against an engine: the bucket counts, the
    alignment and the compile seconds (``None``: no budget)."""

    options: TuneOptions
    limits: EngineLimits
    counts: dict[str, int]
    alignment: Alignment
    compile_seconds: CompileSeconds | None
    #: The options the tuned config carries besides its buckets: ``base``,
    #: with the decode split's break-even when asked for.
    carried: dict[str, Any] = field(default_factory=dict)


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
    carried = dict(options.base)
    if options.split_decodes:
        carried[SPLIT_KEY] = break_even_positions(cost, settings)
    return TuneSetup(options, limits, counts, alignment, compile_seconds, carried)


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
    tuned = Tuned(shapes, result, result.neuron_config(setup.carried))
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
        rows = _with_throughput(
            within_budget(frontier, budget), setup.carried, specs, settings, cost
        )
        chosen = max(
            (r for r in rows if r.output_throughput is not None),
            key=lambda r: (r.output_throughput, -r.compile_minutes),
        )
        tuned.rows, tuned.chosen = rows, rows.index(chosen)
        tuned.neuron_config = _config_of(chosen, setup.carried)
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


def _with_throughput(
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
