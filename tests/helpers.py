"""Shared test helpers: build schedulers, run them, render golden traces."""

from __future__ import annotations

from typing import Any

from neuron_scheduler import NeuronScheduler
from neuron_scheduler.harness import EngineSettings, OfflineEngine, build_scheduler
from neuron_scheduler.step import StepRecord

TraceLine = tuple[str, tuple[str, ...], int, int, str]


def neuron_engine(
    scheduler_cls: type = NeuronScheduler, pipelined: bool = False, **settings: Any
) -> OfflineEngine:
    return OfflineEngine(
        build_scheduler(scheduler_cls, EngineSettings(**settings)), pipelined=pipelined
    )


def trace_line(record: StepRecord) -> TraceLine:
    """(kind, requests, actual, padded, state): tokens for prefill steps,
    batch size for decode steps."""
    if record.kind.value == "decode":
        actual, padded = record.num_seqs, record.num_seqs_padded
    else:
        actual, padded = record.total_actual, record.total_padded
    return (
        record.kind.value,
        tuple(sorted(record.request_ids)),
        actual,
        padded,
        record.state.name,
    )


def run_trace(engine: OfflineEngine, max_steps: int = 1000) -> list[TraceLine]:
    """Step until idle, returning one golden line per scheduled step.

    Empty steps are left out only when no request is unfinished (vLLM runs
    one to flush finished ids); an empty step with work pending is a stall
    and stays in the trace."""
    lines = []
    for _ in range(max_steps):
        if not engine.has_work():
            return lines
        scheduled, _ = engine.step()
        if scheduled is not None:
            record = engine.scheduler.last_step  # type: ignore[attr-defined]
            idle = engine.scheduler.get_num_unfinished_requests() == 0
            if record.kind.value != "empty" or not idle:
                lines.append(trace_line(record))
    raise AssertionError(f"no completion after {max_steps} steps: {lines[-5:]}")


def prompt(n: int, offset: int = 0) -> list[int]:
    """n distinct-ish token ids (offset keeps prompts from sharing prefixes)."""
    return [(offset * 7919 + i) % 31000 + 1 for i in range(n)]
