"""The shapes a simulated step is charged for, by how the policy executes
it (padded, dynamic, a graph per phase), and the padding counters each
kind of step adds to a run."""

from __future__ import annotations

from neuron_scheduler.sim.cost_model import StepShape
from neuron_scheduler.sim.records import RunResult
from neuron_scheduler.step import (
    LargestBucketOnly,
    ScheduledRequest,
    StepKind,
    StepRecord,
)


def static_shape(record: StepRecord, step: list[ScheduledRequest]) -> StepShape:
    """The compiled graph a static step runs: the prefill's chunks with the
    padding on the last one (and its real tokens), or the padded decode rows
    at the context bucket (and the real rows' mean context)."""
    if record.kind is StepKind.PREFILL:
        return StepShape(
            tuple(
                (record.padded_tokens[r.request_id], r.num_computed_before)
                for r in step
            ),
            prefill_tokens_actual=record.total_actual,
        )
    actual = sum(r.num_computed_before + r.num_scheduled for r in step) / len(step)
    return StepShape(
        (), record.num_seqs_padded, record.context_len_padded, True, actual, len(step)
    )


def dynamic_shape(step: list[ScheduledRequest]) -> StepShape:
    """A dynamic-shape step, unpadded: prompt chunks, and rows of one
    position each (decodes and prompt ends) at their mean context."""
    chunks = tuple(
        (r.num_scheduled, r.num_computed_before) for r in step if r.is_prefill
    )
    contexts = [r.num_computed_before + 1 for r in step if not r.is_prefill]
    mean = sum(contexts) / len(contexts) if contexts else 0.0
    return StepShape(chunks, len(contexts), mean, static=False)


def power_of_two_bucket(n: int, max_model_len: int, smallest: int = 128) -> int:
    """NxD Inference's automatic bucket for ``n`` tokens: the smallest power
    of two from ``smallest`` up that holds it, at most ``max_model_len``."""
    bucket = smallest
    while bucket < n:
        bucket *= 2
    return min(bucket, max_model_len)


def graph_per_phase_shapes(
    step: list[ScheduledRequest], batch_size: int, max_model_len: int
) -> list[StepShape]:
    """The graphs ``Execution.GRAPH_PER_PHASE`` runs for ``step``: the
    decode graph (if any row decodes), then each prompt's own."""
    shapes = []
    contexts = [r.num_computed_before + 1 for r in step if not r.is_prefill]
    if contexts:
        context = power_of_two_bucket(max(contexts), max_model_len)
        shapes.append(StepShape((), batch_size, context))
    for r in step:
        if r.is_prefill:
            padded = power_of_two_bucket(r.num_scheduled, max_model_len)
            shapes.append(StepShape(((padded, r.num_computed_before),)))
    return shapes


def count_graph_step(
    result: RunResult, shapes: list[StepShape], step: list[ScheduledRequest]
) -> None:
    for shape in shapes:
        if shape.decode_rows:
            result.decode_steps += 1
            result.decode_slots_padded += shape.decode_rows
        else:
            result.prefill_steps += 1
            result.prefill_tokens_padded += shape.prefill_tokens
    for r in step:
        if r.is_prefill:
            result.prefill_tokens += r.num_scheduled
        else:
            result.decode_slots += 1


def count_static_step(
    result: RunResult, record: StepRecord, largest_only: LargestBucketOnly
) -> None:
    """Add a static step's padding, and whether it fell to a largest
    bucket, to ``result``'s counters."""
    for dimension in largest_only.dimensions(record):
        name = f"{dimension.value.removesuffix('_tokens')}_steps_at_largest"
        setattr(result, name, getattr(result, name) + 1)
    if record.kind is StepKind.PREFILL:
        bucket = result.prefill_buckets.setdefault(record.total_padded, [0, 0])
        bucket[0] += record.total_actual
        bucket[1] += record.total_padded
        result.prefill_steps += 1
        result.prefill_tokens += record.total_actual
        result.prefill_tokens_padded += record.total_padded
        return
    bucket = result.decode_buckets.setdefault(record.num_seqs_padded, [0, 0])
    bucket[0] += record.num_seqs
    bucket[1] += record.num_seqs_padded
    result.decode_steps += 1
    result.decode_slots += record.num_seqs
    result.decode_slots_padded += record.num_seqs_padded
    result.decode_context_read += record.num_seqs_padded * record.context_len_padded
    result.decode_context_needed += record.num_seqs * record.context_len


def count_dynamic_step(result: RunResult, shape: StepShape) -> None:
    prefill_tokens = shape.prefill_tokens
    result.prefill_tokens += prefill_tokens
    result.prefill_tokens_padded += prefill_tokens
    result.decode_slots += shape.decode_rows
    result.decode_slots_padded += shape.decode_rows
    if prefill_tokens and shape.decode_rows:
        result.mixed_steps += 1
    elif prefill_tokens:
        result.prefill_steps += 1
    else:
        result.decode_steps += 1
