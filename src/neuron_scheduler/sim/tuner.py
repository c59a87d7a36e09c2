"""The bucket tuner: bucket lists for the shapes a run produced.

The shapes come from one simulated run of the real scheduler with the given
``neuron_config`` (``tuning``; so chunking at ``max_num_batched_tokens``,
prefix-cache hits, packing and the decode batches the admission rule allows
are all as they would be): the total tokens of every prefill step, the batch
size of every decode step, and every decode step's longest context. Each
bucket list is chosen for the traffic the sample stands for
(``robust_buckets``, the default) or as the sample's exact optimum
(``buckets.optimal_buckets``), weighing:

* prefill: padded tokens, each step weighted 1;
* decode batch: padded slots, each step weighted 1;
* decode context: KV positions read, each step weighted by its padded batch
  under the tuned batch buckets (every padded row reads the whole bucket).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
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
from neuron_scheduler.config import EngineLimits
from neuron_scheduler.sim.robust_buckets import robust_buckets
from neuron_scheduler.step import StepKind, StepRecord

DEFAULT_MAX_CONTEXT_BUCKETS = 8


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
