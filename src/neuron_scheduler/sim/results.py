"""Metric definitions, matching ``vllm bench serve`` where it has them.

* TTFT: first token time - arrival.
* TPOT: (E2EL - TTFT) / (output tokens - 1), requests with > 1 token only:
  the first token is excluded.
* ITL: every gap between consecutive tokens of a request, all requests
  flattened into one list.
* E2EL: finish time - arrival.
* Goodput: completed requests meeting every given SLO, per second.
Percentiles use numpy's default (linear) interpolation; times are reported
in milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from neuron_scheduler.metrics import padding_ratio
from neuron_scheduler.sim import time_breakdown
from neuron_scheduler.sim.records import RequestRecord, RunResult
from neuron_scheduler.sim.slo import (
    DEFAULT_GOODPUT,
    SLO,
    goodput_limits,
    percentile_key,
)


def latency_stats(
    prefix: str,
    values_ms: list[float] | np.ndarray,
    percentiles: tuple[float, ...] = (),
) -> dict[str, float]:
    """Mean, median and p99 of ``values_ms`` as ``mean_{prefix}_ms``, ...,
    and ``p{NN}_{prefix}_ms`` for each of ``percentiles``."""
    values = np.asarray(values_ms, dtype=float)
    stats = {f"mean_{prefix}_ms": 0.0, f"median_{prefix}_ms": 0.0}
    for percentile in (99.0, *percentiles):
        stats[f"{percentile_key(percentile)}_{prefix}_ms"] = 0.0
    if values.size == 0:
        return stats
    stats[f"mean_{prefix}_ms"] = float(values.mean())
    stats[f"median_{prefix}_ms"] = float(np.median(values))
    for percentile in (99.0, *percentiles):
        key = f"{percentile_key(percentile)}_{prefix}_ms"
        stats[key] = float(np.percentile(values, percentile))
    return stats


@dataclass(frozen=True)
class RequestLatencies:
    """Per completed request, in milliseconds, aligned by index. ``tpot_ms``
    is 0 for one-token requests (it has no defined value there)."""

    completed: list[RequestRecord]
    ttft_ms: list[float]
    tpot_ms: list[float]
    e2el_ms: list[float]
    #: Each request's ``RequestRecord.latencies_ms`` (what SLOs judge).
    each_ms: list[dict[str, float]]

    @property
    def defined_tpot_ms(self) -> list[float]:
        """TPOT of the requests with more than one token (vLLM's TPOT set)."""
        return [
            tpot
            for record, tpot in zip(self.completed, self.tpot_ms, strict=True)
            if record.num_tokens > 1
        ]


def _completed(record: RequestRecord) -> bool:
    """Whether ``record``'s request generated all its tokens."""
    return record.finish_s >= 0 and record.num_tokens == record.output_len


def request_latencies(result: RunResult) -> RequestLatencies:
    """TTFT, TPOT and E2EL of every request that generated all its tokens."""
    done = [r for r in result.records if _completed(r)]
    each = [r.latencies_ms() for r in done]
    return RequestLatencies(
        done,
        [values["ttft"] for values in each],
        [values.get("tpot", 0.0) for values in each],
        [values["e2el"] for values in each],
        each,
    )


def latencies_by_request(result: RunResult) -> list[dict[str, float] | None]:
    """Each request's ``RequestRecord.latencies_ms``, in the order of the
    run's records (its requests'); ``None`` where it did not complete."""
    return [r.latencies_ms() if _completed(r) else None for r in result.records]


def compute_metrics(
    result: RunResult,
    goodput: Sequence[SLO] = DEFAULT_GOODPUT,
    percentiles: tuple[float, ...] = (),
) -> dict[str, Any]:
    """The JSON-ready metrics of one run (``goodput``: the per-request SLOs
    a good request meets; ``percentiles``: extra ``pNN_*_ms`` keys; a fleet
    run adds ``replicas``, each engine's load)."""
    latencies = request_latencies(result)
    done = latencies.completed
    duration = result.duration_s or 1e-9
    good = sum(
        all(slo.met_by(values) for slo in goodput) for values in latencies.each_ms
    )
    input_tokens = sum(r.input_len for r in done)
    output_tokens = sum(r.num_tokens for r in done)
    metrics: dict[str, Any] = {
        "label": result.label,
        "completed": len(done),
        "failed": sum(r.failed for r in result.records),
        "num_requests": len(result.records),
        "duration": result.duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "request_goodput": good / duration,
        "goodput_slo_ms": goodput_limits(goodput),
    }
    itl_ms = np.frombuffer(result.itl_s, dtype=float) * 1e3
    metrics.update(latency_stats("ttft", latencies.ttft_ms, percentiles))
    metrics.update(latency_stats("tpot", latencies.defined_tpot_ms, percentiles))
    metrics.update(latency_stats("itl", itl_ms, percentiles))
    metrics.update(latency_stats("e2el", latencies.e2el_ms, percentiles))
    metrics.update(
        {
            "prefill_padding_ratio": padding_ratio(
                result.prefill_tokens, result.prefill_tokens_padded
            ),
            "decode_padding_ratio": padding_ratio(
                result.decode_slots, result.decode_slots_padded
            ),
            "decode_kv_read_padding_ratio": padding_ratio(
                result.decode_context_needed, result.decode_context_read
            ),
            "num_preemptions": sum(r.num_preemptions for r in result.records),
            "max_running": result.max_running,
            "mean_running": result.running_time_integral / duration,
            "prefill_steps": result.prefill_steps,
            "decode_steps": result.decode_steps,
            "mixed_steps": result.mixed_steps,
            "buckets_used": {
                "prefill": sorted(result.prefill_buckets),
                "decode": sorted(result.decode_buckets),
            },
            "wall_seconds": result.wall_seconds,
            "simulated_requests_per_wall_second": len(result.records)
            / max(result.wall_seconds, 1e-9),
        }
    )
    metrics["steps_at_largest_bucket"] = steps_at_largest_bucket(result)
    metrics["time_breakdown"] = time_breakdown_of(result)
    if result.replicas:
        metrics["replicas"] = [replica_load(r, duration) for r in result.replicas]
    return metrics


def replica_load(replica: RunResult, duration: float) -> dict[str, Any]:
    """One engine's share of a fleet run."""
    return {
        "requests": replica.routed,
        "mean_running": replica.running_time_integral / duration,
        "max_running": replica.max_running,
        "prefill_padding_ratio": padding_ratio(
            replica.prefill_tokens, replica.prefill_tokens_padded
        ),
        "decode_padding_ratio": padding_ratio(
            replica.decode_slots, replica.decode_slots_padded
        ),
        "prefill_steps": replica.prefill_steps,
        "decode_steps": replica.decode_steps,
        "steps_at_largest_bucket": steps_at_largest_bucket(replica),
    }


def time_breakdown_of(result: RunResult) -> dict[str, float]:
    """Engine seconds by part (``time_breakdown.PARTS``), summed over a
    fleet's engines, each engine idle from its last step to the run's end;
    ``engine_seconds``: the duration times the engines, what the top-level
    parts add up to."""
    engines = result.replicas or [result]
    parts = time_breakdown.empty()
    for engine in engines:
        for part, seconds in engine.time_s.items():
            parts[part] += seconds
        parts["idle"] += max(0.0, result.duration_s - engine.clock_s)
    return {"engine_seconds": result.duration_s * len(engines), **parts}


def steps_at_largest_bucket(result: RunResult) -> dict[str, dict[str, float]]:
    """Per bucket list, the static steps padded to its largest bucket
    because no smaller one fits, and their share of the steps of that kind
    (prefill tokens of prefill steps; decode batch and context of decode
    steps): a config meeting traffic beyond its range."""
    counts = (
        ("prefill_tokens", result.prefill_steps_at_largest, result.prefill_steps),
        ("decode_batch", result.decode_batch_steps_at_largest, result.decode_steps),
        (
            "decode_context",
            result.decode_context_steps_at_largest,
            result.decode_steps,
        ),
    )
    return {
        name: {"steps": steps, "share": steps / total if total else 0.0}
        for name, steps, total in counts
    }


def padding_by_bucket(buckets: Mapping[int, list[int]]) -> dict[int, float]:
    return {bucket: padding_ratio(a, p) for bucket, (a, p) in sorted(buckets.items())}
