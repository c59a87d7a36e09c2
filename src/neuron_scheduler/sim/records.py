"""What a simulated run records: each request's life on the virtual clock
(``RequestRecord``) and the run's counters (``RunResult``)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from neuron_scheduler.sim import time_breakdown
from neuron_scheduler.sim.workload import RequestSpec


@dataclass
class RequestRecord:
    """One request's life on the virtual clock. ``arrival_s`` is when it was
    sent (later than the workload says when ``max_concurrency`` held it
    back, as ``vllm bench serve`` measures); ``failed``: the server would
    reject it."""

    arrival_s: float
    input_len: int
    output_len: int
    first_token_s: float = -1.0
    finish_s: float = -1.0
    num_tokens: int = 0
    num_preemptions: int = 0
    failed: bool = False

    def latencies_ms(self) -> dict[str, float]:
        """TTFT and E2EL in milliseconds, and TPOT (excluding the first
        token) where there is more than one token: ``vllm bench serve``'s
        definitions, for a request that has finished."""
        ttft = (self.first_token_s - self.arrival_s) * 1e3
        e2el = (self.finish_s - self.arrival_s) * 1e3
        values = {"ttft": ttft, "e2el": e2el}
        if self.num_tokens > 1:
            values["tpot"] = (e2el - ttft) / (self.num_tokens - 1)
        return values


@dataclass
class RunResult:
    """Everything a run measured, before metric definitions are applied."""

    label: str
    records: list[RequestRecord]
    itl_s: array = field(default_factory=lambda: array("d"))
    duration_s: float = 0.0
    prefill_tokens: int = 0
    prefill_tokens_padded: int = 0
    decode_slots: int = 0
    decode_slots_padded: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
    #: KV positions decode steps read (padded batch x context bucket) and the
    #: positions the real rows needed (batch x longest context).
    decode_context_read: int = 0
    decode_context_needed: int = 0
    #: Static steps padded to a list's largest bucket because no smaller
    #: one fits (``step.LargestBucketOnly``), by list.
    prefill_steps_at_largest: int = 0
    decode_batch_steps_at_largest: int = 0
    decode_context_steps_at_largest: int = 0
    max_running: int = 0
    running_time_integral: float = 0.0
    prefill_buckets: dict[int, list[int]] = field(default_factory=dict)
    decode_buckets: dict[int, list[int]] = field(default_factory=dict)
    running_timeline: list[tuple[float, int]] = field(default_factory=list)
    wall_seconds: float = 0.0
    #: Each engine's own counters, in a run of several (``simulate``).
    replicas: list[RunResult] = field(default_factory=list)
    #: Requests routed to this engine (an engine's own counters).
    routed: int = 0
    #: ``stop_when`` ended the run before every request finished.
    stopped_early: bool = False
    #: Seconds by what they were spent on (``time_breakdown.PARTS``), kept
    #: per engine: a fleet's are its engines' (``replicas``).
    time_s: dict[str, float] = field(default_factory=time_breakdown.empty)
    #: The engine's clock when the run ended (per engine, as ``time_s``).
    clock_s: float = 0.0


def unstarted_run(label: str, specs: list[RequestSpec]) -> RunResult:
    """A run of ``specs`` before its first event: one record per request,
    those the server rejects already failed."""
    return RunResult(
        label,
        [
            RequestRecord(s.arrival_s, s.input_len, s.output_len, failed=s.rejected)
            for s in specs
        ],
    )
