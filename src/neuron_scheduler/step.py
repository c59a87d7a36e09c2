"""What one scheduled step is, in static-shape terms.

``describe_step`` reads a ``SchedulerOutput`` (using the pre-step
``num_computed_tokens`` it records, never the mutated request objects) and
returns a ``StepRecord``: the batch kind, the actual and padded token counts
and the resulting state. Pure apart from reading the output.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from neuron_scheduler.buckets import smallest_bucket

if TYPE_CHECKING:  # pure module: vLLM only for the type
    from vllm.v1.core.sched.output import SchedulerOutput


class SchedulerState(enum.Enum):
    """What the accelerator is doing in the current step."""

    IDLE = "idle"
    ACTIVE_PREFILL = "active_prefill"
    ACTIVE_DECODE = "active_decode"


class StepKind(enum.Enum):
    EMPTY = "empty"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def state(self) -> SchedulerState:
        return _STATE_OF_KIND[self]


_STATE_OF_KIND = {
    StepKind.EMPTY: SchedulerState.IDLE,
    StepKind.PREFILL: SchedulerState.ACTIVE_PREFILL,
    StepKind.DECODE: SchedulerState.ACTIVE_DECODE,
}


class MixedBatchError(RuntimeError):
    """A step held both prefill and decode requests."""


@dataclass(frozen=True)
class StepRecord:
    """One step, as a golden trace line.

    ``actual_tokens`` / ``padded_tokens`` map request id to its scheduled and
    padded token counts (in a prefill step the prompts are concatenated and
    the padding goes after the last one, so only the last request's count
    grows); ``num_seqs`` / ``num_seqs_padded`` are the batch size before and
    after padding; ``context_len`` / ``context_len_padded`` (decode steps) the
    longest context in the batch and the context bucket it pads to.
    """

    kind: StepKind
    request_ids: tuple[str, ...]
    actual_tokens: Mapping[str, int] = field(default_factory=dict)
    padded_tokens: Mapping[str, int] = field(default_factory=dict)
    num_seqs: int = 0
    num_seqs_padded: int = 0
    context_len: int = 0
    context_len_padded: int = 0

    @property
    def state(self) -> SchedulerState:
        return self.kind.state

    @property
    def total_actual(self) -> int:
        return sum(self.actual_tokens.values())

    @property
    def total_padded(self) -> int:
        """Tokens the compiled graph runs: the padded prefill total, or the
        decode tokens plus one per dummy row."""
        return sum(self.padded_tokens.values()) + self.num_seqs_padded - self.num_seqs

    def summary(self) -> str:
        """One log line: state, kind, requests, actual -> padded tokens."""
        if self.kind is StepKind.EMPTY:
            return f"{self.state.name:<14} empty"
        ids = ",".join(self.request_ids)
        if self.kind is StepKind.DECODE:
            return (
                f"{self.state.name:<14} decode  reqs=[{ids}] batch "
                f"{self.num_seqs} -> {self.num_seqs_padded} context "
                f"{self.context_len} -> {self.context_len_padded}"
            )
        return (
            f"{self.state.name:<14} prefill reqs=[{ids}] tokens "
            f"{self.total_actual} -> {self.total_padded}"
        )


class BucketDimension(enum.Enum):
    """The three bucket lists a step is padded along."""

    PREFILL_TOKENS = "prefill_tokens"
    DECODE_BATCH = "decode_batch"
    DECODE_CONTEXT = "decode_context"


@dataclass(frozen=True)
class LargestBucketOnly:
    """Per bucket list, the size above which only its largest bucket fits
    (the second largest; 0 for a single bucket): a step past it fell to the
    largest bucket because no smaller one fits, the mark of traffic beyond
    the range a config was tuned for."""

    prefill_tokens: int
    decode_batch: int
    decode_context: int

    @classmethod
    def of(
        cls,
        token_buckets: tuple[int, ...],
        seq_buckets: tuple[int, ...],
        context_buckets: tuple[int, ...],
    ) -> LargestBucketOnly:
        def below_largest(buckets: tuple[int, ...]) -> int:
            return buckets[-2] if len(buckets) > 1 else 0

        return cls(
            below_largest(token_buckets),
            below_largest(seq_buckets),
            below_largest(context_buckets),
        )

    def dimensions(self, record: StepRecord) -> list[BucketDimension]:
        """The bucket lists along which ``record`` fits only the largest."""
        if record.kind is StepKind.PREFILL:
            if record.total_actual > self.prefill_tokens:
                return [BucketDimension.PREFILL_TOKENS]
            return []
        if record.kind is StepKind.EMPTY:
            return []
        found = []
        if record.num_seqs > self.decode_batch:
            found.append(BucketDimension.DECODE_BATCH)
        if record.context_len > self.decode_context:
            found.append(BucketDimension.DECODE_CONTEXT)
        return found


class ScheduledRequest(NamedTuple):
    """A request in a step: its id, the tokens it computed before the step,
    its prompt length and the tokens scheduled for it. (A named tuple: one
    is built per scheduled request per step, so it must be cheap.)

    Three shapes: a **prefill** chunk computes prompt tokens other than just
    the last one; a **decode** computes one generated position (plus
    speculative drafts); a **prompt end** computes only its prompt's last
    token (plus draft placeholders): what is left after a complete KV
    transfer or a full prefix-cache hit. A prompt end is one query token over
    cached context, exactly a decode row, so it may run in either kind of
    step (as a one-token chunk of a prefill step, or as a decode row).
    """

    request_id: str
    num_computed_before: int
    num_prompt_tokens: int
    num_scheduled: int

    @property
    def is_prefill(self) -> bool:
        """A prompt chunk of more than the last prompt token."""
        return self.num_computed_before < self.num_prompt_tokens - 1

    @property
    def is_decode(self) -> bool:
        """A generated position (the prompt is done)."""
        return self.num_computed_before >= self.num_prompt_tokens


def scheduled_requests(
    output: SchedulerOutput, prompt_len_of: Callable[[str], int]
) -> list[ScheduledRequest]:
    """List the requests of a ``SchedulerOutput`` with their pre-step state."""
    num_scheduled: Mapping[str, int] = output.num_scheduled_tokens
    result = [
        ScheduledRequest(
            new.req_id,
            new.num_computed_tokens,
            len(new.prompt_token_ids)
            if new.prompt_token_ids is not None
            else prompt_len_of(new.req_id),
            num_scheduled[new.req_id],
        )
        for new in output.scheduled_new_reqs
    ]
    cached = output.scheduled_cached_reqs
    result.extend(
        ScheduledRequest(req_id, computed, prompt_len_of(req_id), num_scheduled[req_id])
        for req_id, computed in zip(
            cached.req_ids, cached.num_computed_tokens, strict=True
        )
    )
    return result


def computed_before(output: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's computed tokens before the step (its
    prefix-cache hit included, for a new request), by request id."""
    before = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
    cached = output.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return before


def describe_step(
    requests: list[ScheduledRequest],
    token_buckets: tuple[int, ...],
    seq_buckets: tuple[int, ...],
    context_buckets: tuple[int, ...] | None = None,
    prompt_end_slack: int = 1,
) -> StepRecord:
    """Classify and pad one step.

    A step with a prefill chunk is a prefill step: its chunks (prompt ends
    included, one token each), concatenated, pad to the smallest token bucket
    >= their total (the padding is recorded on the last request). Otherwise
    it is a decode step: every request is one row (decodes and prompt ends
    keep their actual count, 1 + spec tokens); the batch pads to the
    smallest ``seq_buckets`` entry >= the number of rows and the longest
    context (tokens attended, the new one included) to the smallest
    ``context_buckets`` entry (``None``: no context padding).
    With ``prompt_end_slack=0`` (``NeuronConfig.strict_prefill``) a prompt
    end is a prefill too, and a step holds at most one prefill.
    Raises ``MixedBatchError`` if a step holds a prefill chunk and a decode
    (or, strictly, two prefills).
    """
    if not requests:
        return StepRecord(StepKind.EMPTY, ())
    # Inline shape tests (ScheduledRequest.is_prefill / is_decode): hot path.
    num_prefills = sum(
        1
        for r in requests
        if r.num_computed_before < r.num_prompt_tokens - prompt_end_slack
    )
    if num_prefills:
        num_decodes = sum(
            1 for r in requests if r.num_computed_before >= r.num_prompt_tokens
        )
        if num_decodes:
            raise MixedBatchError(
                f"mixed batch: {num_prefills} prefill and {num_decodes} decode "
                f"requests in one step ({[r.request_id for r in requests]})"
            )
        if not prompt_end_slack and len(requests) > 1:
            raise MixedBatchError(
                f"strict prefill: {len(requests)} requests in one prefill step "
                f"({[r.request_id for r in requests]})"
            )
    actual = {r.request_id: r.num_scheduled for r in requests}
    ids = tuple(actual)
    if num_prefills:
        total = sum(actual.values())
        padded = dict(actual)
        padded[ids[-1]] += smallest_bucket(token_buckets, total) - total
        return StepRecord(StepKind.PREFILL, ids, actual, padded, len(ids), len(ids))
    context = max(r.num_computed_before + r.num_scheduled for r in requests)
    return StepRecord(
        StepKind.DECODE,
        ids,
        actual,
        dict(actual),
        len(ids),
        smallest_bucket(seq_buckets, len(ids)),
        context,
        smallest_bucket(context_buckets, context) if context_buckets else context,
    )


class HasPromptLength(Protocol):
    """What ``describe_output`` reads of a request (vLLM's ``Request``)."""

    num_prompt_tokens: int


def describe_output(
    output: SchedulerOutput,
    requests: Mapping[str, HasPromptLength],
    token_buckets: tuple[int, ...],
    seq_buckets: tuple[int, ...],
    context_buckets: tuple[int, ...] | None = None,
    prompt_end_slack: int = 1,
) -> StepRecord:
    """``describe_step`` of a ``SchedulerOutput``, the same record, with a
    fast path for the common step: no new request and no prefill chunk (a
    decode step, or an empty one). It reads the output's lists in one loop
    and shares ``output.num_scheduled_tokens`` (not copied, not to be
    changed) as the record's actual and padded counts. ``requests``: the
    scheduler's requests by id."""
    cached = output.scheduled_cached_reqs
    shapes = (token_buckets, seq_buckets, context_buckets, prompt_end_slack)
    if output.scheduled_new_reqs or not cached.req_ids:
        return _describe_slowly(output, requests, *shapes)
    num_scheduled = output.num_scheduled_tokens
    context = 0
    for req_id, computed in zip(
        cached.req_ids, cached.num_computed_tokens, strict=True
    ):
        if computed < requests[req_id].num_prompt_tokens - prompt_end_slack:
            return _describe_slowly(output, requests, *shapes)  # a prefill
        end = computed + num_scheduled[req_id]
        if end > context:
            context = end
    rows = len(cached.req_ids)
    return StepRecord(
        StepKind.DECODE,
        tuple(cached.req_ids),
        num_scheduled,
        num_scheduled,
        rows,
        smallest_bucket(seq_buckets, rows),
        context,
        smallest_bucket(context_buckets, context) if context_buckets else context,
    )


def _describe_slowly(
    output: SchedulerOutput,
    requests: Mapping[str, HasPromptLength],
    token_buckets: tuple[int, ...],
    seq_buckets: tuple[int, ...],
    context_buckets: tuple[int, ...] | None,
    prompt_end_slack: int,
) -> StepRecord:
    return describe_step(
        scheduled_requests(output, lambda rid: requests[rid].num_prompt_tokens),
        token_buckets,
        seq_buckets,
        context_buckets,
        prompt_end_slack,
    )
