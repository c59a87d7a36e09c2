"""Where a simulated run's time goes (``bench``'s ``time_breakdown``).

Each engine's time is idle (no step running: waiting for a request), or a
step's: a prefill step's, a decode step's, or (dynamic shapes only) a mixed
step's. Within a step the cost model says what the padding cost: a prefill
step's time less its actual chunks' time is padding; a decode step's time
less the time of its real rows at the same context bucket is unfilled
rows, and that less the real rows at their own mean context is KV-read
padding. A prefill step that runs while running requests wait to decode
also counts as time decodes wait behind prefills. The counterfactual times
come from ``CostModel.estimate`` (no step is charged for them).

Parts add up per engine: idle + prefill + decode + mixed is the run's
duration, for a fleet each engine's (``RunResult.time_s``).
"""

from __future__ import annotations

from collections.abc import Sequence

from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.sim.cost_model import CostModel, StepShape
from neuron_scheduler.sim.workload import RequestSpec
from neuron_scheduler.step import ScheduledRequest

#: The parts, as ``bench --json`` names them (seconds).
PARTS = (
    "idle",
    "prefill",
    "prefill_padding",
    "prefill_with_decodes_waiting",
    "decode",
    "decode_unfilled_rows",
    "decode_kv_read_padding",
    "mixed",
)
#: The parts that add up to the run's duration.
TOP_LEVEL = ("idle", "prefill", "decode", "mixed")


def empty() -> dict[str, float]:
    return dict.fromkeys(PARTS, 0.0)


def add_step(
    times: dict[str, float],
    shapes: Sequence[StepShape],
    seconds: Sequence[float],
    actual: Sequence[StepShape],
    cost: CostModel,
    decodes_waiting: bool,
) -> None:
    """Count one step run as ``shapes`` (each taking its ``seconds``; each
    with the ``actual`` shape of the work it does, see ``actual_shapes``);
    ``decodes_waiting``: running requests wait to decode while it runs."""
    for shape, dt, real in zip(shapes, seconds, actual, strict=True):
        if shape.prefill_chunks and shape.decode_rows:
            times["mixed"] += dt
        elif shape.prefill_chunks:
            times["prefill"] += dt
            times["prefill_padding"] += dt - cost.estimate(real)
            if decodes_waiting:
                times["prefill_with_decodes_waiting"] += dt
        elif shape.decode_rows:
            times["decode"] += dt
            at_bucket = StepShape(
                (), real.decode_rows, shape.decode_context, shape.static,
                real.decode_context, real.decode_rows,
            )  # fmt: skip
            filled = cost.estimate(at_bucket)
            times["decode_unfilled_rows"] += dt - filled
            times["decode_kv_read_padding"] += filled - cost.estimate(real)


def actual_shapes(
    shapes: Sequence[StepShape],
    step: Sequence[ScheduledRequest],
) -> list[StepShape]:
    """For each shape a step ran as, the work it really does: a padded
    prefill graph's chunks (one graph per prompt when there are several
    prefill shapes), a decode graph's real rows at their own mean context;
    a dynamic shape is its own."""
    prompts = [r for r in step if r.is_prefill]
    rows = [r for r in step if not r.is_prefill]
    graphs = sum(1 for s in shapes if s.prefill_chunks and not s.decode_rows)
    # A graph per prompt beside a decode graph, or one graph for the step.
    per_prompt = graphs > 1 or any(
        s.decode_rows and not s.prefill_chunks for s in shapes
    )
    actual: list[StepShape] = []
    for shape in shapes:
        if not shape.static:
            actual.append(shape)
        elif shape.prefill_chunks:
            chunks = [(r.num_scheduled, r.num_computed_before) for r in step]
            if per_prompt:
                r = prompts[sum(1 for a in actual if a.prefill_chunks)]
                chunks = [(r.num_scheduled, r.num_computed_before)]
            actual.append(StepShape(tuple(chunks)))
        else:
            count = len(rows) or shape.decode_rows
            context = shape.decode_context_actual or (
                sum(r.num_computed_before + r.num_scheduled for r in rows) / len(rows)
                if rows
                else shape.decode_context
            )
            actual.append(StepShape((), count, context, True, context, count))
    return actual


def never_mix_lower_bound(
    specs: Sequence[RequestSpec],
    settings: EngineSettings,
    cost: CostModel,
    engines: int = 1,
) -> float:
    """Seconds no schedule that never mixes prefill and decode can beat on
    ``engines`` engines of ``settings`` for ``specs`` (rejected ones apart;
    the work shared evenly between the engines), on the
    assumptions that a step's time per token falls as it holds more (prefill
    tokens up to ``max_num_batched_tokens``, decode rows up to
    ``max_num_seqs``) and rises with context: every prompt token in full
    prefill steps at context 0, every generated token but the first in full
    decode steps at context 1 (or, if longer, the longest output one row a
    step), one after the other; and no sooner than the last request's
    arrival plus its own work alone."""
    served = [s for s in specs if not s.rejected]
    if not served:
        return 0.0
    tokens, rows = settings.max_num_batched_tokens, settings.max_num_seqs
    per_token = cost.estimate(StepShape(((tokens, 0),))) / tokens
    full_decode = cost.estimate(StepShape((), rows, 1.0, True, 1.0, rows))
    one_row = cost.estimate(StepShape((), 1, 1.0, True, 1.0, 1))
    prefill = per_token * sum(s.input_len for s in served)
    decode = max(
        full_decode * sum(s.output_len - 1 for s in served) / rows,
        one_row * max(s.output_len - 1 for s in served),
    )
    last = max(served, key=lambda s: s.arrival_s)
    alone = (
        last.arrival_s + per_token * last.input_len + one_row * (last.output_len - 1)
    )
    return max((prefill + decode) / engines, alone)
