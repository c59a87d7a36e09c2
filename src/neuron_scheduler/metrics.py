"""What padding costs, per bucket and per state: the scheduler's metrics.

``SchedulerMetrics`` accumulates every ``StepRecord``: actual vs padded
prefill tokens per token bucket, actual vs padded decode slots per batch
bucket, steps and seconds in each ``SchedulerState``, and admission
refusals per ``AdmissionRule``. ``snapshot()`` is the plain-JSON form the
Prometheus collector (``stat_logger``) exports; ``log_line()`` the periodic
INFO line.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from neuron_scheduler.admission import AdmissionRule
from neuron_scheduler.step import (
    BucketDimension,
    LargestBucketOnly,
    SchedulerState,
    StepKind,
    StepRecord,
)

#: Upper bounds of the per-step padding histograms (tokens or slots).
PADDING_HISTOGRAM_BOUNDS = (0, 1, 4, 16, 64, 256, 1024, 4096, 16384)


def padding_ratio(actual: float, padded: float) -> float:
    """Padding / padded total (0 when nothing was padded or run)."""
    return (padded - actual) / padded if padded else 0.0


@dataclass
class BucketTally:
    """Steps that ran in one bucket, their real and padded units, and a
    histogram of each step's padding (cumulative counts per bound)."""

    steps: int = 0
    actual: int = 0
    padded: int = 0
    padding_histogram: list[int] = field(
        default_factory=lambda: [0] * len(PADDING_HISTOGRAM_BOUNDS)
    )

    def add(self, actual: int, padded: int) -> None:
        self.steps += 1
        self.actual += actual
        self.padded += padded
        padding = padded - actual
        for i, bound in enumerate(PADDING_HISTOGRAM_BOUNDS):
            if padding <= bound:
                self.padding_histogram[i] += 1


def _tally(tallies: dict[int, BucketTally], bucket: int) -> BucketTally:
    """The tally of ``bucket``, made on first use (not one per call, as
    ``setdefault`` would: this runs every step)."""
    tally = tallies.get(bucket)
    if tally is None:
        tally = tallies[bucket] = BucketTally()
    return tally


@dataclass
class SchedulerMetrics:
    """Cumulative since start. Time in a state runs from the step that
    entered it to the next ``schedule()`` call."""

    prefill: dict[int, BucketTally] = field(default_factory=dict)
    decode: dict[int, BucketTally] = field(default_factory=dict)
    steps: dict[StepKind, int] = field(
        default_factory=lambda: dict.fromkeys(StepKind, 0)
    )
    state_seconds: dict[SchedulerState, float] = field(
        default_factory=lambda: dict.fromkeys(SchedulerState, 0.0)
    )
    refusals: Counter[AdmissionRule] = field(default_factory=Counter)
    #: Where only the largest bucket fits (``None``: not counted).
    largest_only: LargestBucketOnly | None = None
    #: Steps that fell to the largest bucket of a list, by list.
    steps_at_largest: Counter[BucketDimension] = field(default_factory=Counter)
    _state: SchedulerState = SchedulerState.IDLE
    _since: float | None = None

    def add(self, record: StepRecord, now: float | None = None) -> None:
        """Count one step (``now``: monotonic seconds, for state time)."""
        self.steps[record.kind] += 1
        if record.kind is StepKind.PREFILL:
            bucket = record.total_padded
            _tally(self.prefill, bucket).add(record.total_actual, bucket)
        elif record.kind is StepKind.DECODE:
            padded = record.num_seqs_padded
            _tally(self.decode, padded).add(record.num_seqs, padded)
        if self.largest_only is not None:
            self.steps_at_largest.update(self.largest_only.dimensions(record))
        if now is not None:
            if self._since is not None:
                self.state_seconds[self._state] += now - self._since
            self._since = now
        self._state = record.state

    # Totals -------------------------------------------------------------

    @property
    def prefill_tokens(self) -> int:
        return sum(t.actual for t in self.prefill.values())

    @property
    def prefill_tokens_padded(self) -> int:
        return sum(t.padded for t in self.prefill.values())

    @property
    def decode_slots(self) -> int:
        return sum(t.actual for t in self.decode.values())

    @property
    def decode_slots_padded(self) -> int:
        return sum(t.padded for t in self.decode.values())

    @property
    def prefill_padding_ratio(self) -> float:
        """Padding tokens / padded prefill tokens (0 when none)."""
        return padding_ratio(self.prefill_tokens, self.prefill_tokens_padded)

    @property
    def decode_padding_ratio(self) -> float:
        """Padding slots / padded decode slots (0 when none)."""
        return padding_ratio(self.decode_slots, self.decode_slots_padded)

    # Export -------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Plain JSON: everything above, keyed by strings."""

        def tallies(by_bucket: dict[int, BucketTally]) -> dict[str, Any]:
            return {
                str(bucket): {
                    "steps": t.steps,
                    "actual": t.actual,
                    "padded": t.padded,
                    "padding_histogram": list(t.padding_histogram),
                }
                for bucket, t in sorted(by_bucket.items())
            }

        return {
            "prefill": tallies(self.prefill),
            "decode": tallies(self.decode),
            "state_steps": {
                kind.state.value: count for kind, count in self.steps.items()
            },
            "state_seconds": {s.value: t for s, t in self.state_seconds.items()},
            "refusals": {rule.value: self.refusals[rule] for rule in AdmissionRule},
            "steps_at_largest_bucket": {
                d.value: self.steps_at_largest[d] for d in BucketDimension
            },
            "padding_histogram_bounds": list(PADDING_HISTOGRAM_BOUNDS),
        }

    def log_line(self) -> str:
        """One INFO line, in the style of vLLM's periodic stats."""
        refused = ", ".join(
            f"{rule.value}={count}" for rule, count in self.refusals.items() if count
        )
        total_seconds = sum(self.state_seconds.values()) or 1.0
        occupancy = ", ".join(
            f"{state.value} {100 * seconds / total_seconds:.1f}%"
            for state, seconds in self.state_seconds.items()
        )
        return (
            f"Prefill padding: {100 * self.prefill_padding_ratio:.1f}% "
            f"({self.prefill_tokens_padded - self.prefill_tokens} of "
            f"{self.prefill_tokens_padded} tokens), decode padding: "
            f"{100 * self.decode_padding_ratio:.1f}% "
            f"({self.decode_slots_padded - self.decode_slots} of "
            f"{self.decode_slots_padded} slots), steps prefill/decode/idle: "
            f"{self.steps[StepKind.PREFILL]}/{self.steps[StepKind.DECODE]}/"
            f"{self.steps[StepKind.EMPTY]}, time: {occupancy}, "
            f"admissions refused: {refused or 'none'}"
        )
