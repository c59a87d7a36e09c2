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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from neuron_scheduler.bench.simulate import RequestRecord, RunResult
from neuron_scheduler.metrics import padding_ratio

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class GoodputSLO:
    """Latency limits in milliseconds; ``None`` = not checked."""

    ttft_ms: float | None = 2000.0
    tpot_ms: float | None = 100.0
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: Iterable[str]) -> GoodputSLO:
        """From ``["ttft:2000", "tpot:100"]`` (vLLM's ``--goodput`` syntax)."""
        limits: dict[str, float | None] = dict.fromkeys(SLO_KEYS)
        for item in items:
            key, sep, value = item.partition(":")
            if not sep or key not in SLO_KEYS:
                raise ValueError(
                    f"--goodput item {item!r} must be KEY:MS with KEY in {SLO_KEYS}"
                )
            try:
                limits[key] = float(value)
            except ValueError:
                raise ValueError(
                    f"--goodput {item!r}: {value!r} is not a number"
                ) from None
            if limits[key] is not None and limits[key] <= 0:  # type: ignore[operator]
                raise ValueError(f"--goodput {item!r}: limit must be positive")
        return cls(limits["ttft"], limits["tpot"], limits["e2el"])

    def met(self, ttft_ms: float, tpot_ms: float, e2el_ms: float) -> bool:
        return (
            (self.ttft_ms is None or ttft_ms <= self.ttft_ms)
            and (self.tpot_ms is None or tpot_ms <= self.tpot_ms)
            and (self.e2el_ms is None or e2el_ms <= self.e2el_ms)
        )


def latency_stats(prefix: str, values_ms: list[float] | np.ndarray) -> dict[str, float]:
    """Mean, median and p99 of ``values_ms`` as ``mean_{prefix}_ms``, ..."""
    values = np.asarray(values_ms, dtype=float)
    if values.size == 0:
        return {
            f"mean_{prefix}_ms": 0.0,
            f"median_{prefix}_ms": 0.0,
            f"p99_{prefix}_ms": 0.0,
        }
    return {
        f"mean_{prefix}_ms": float(values.mean()),
        f"median_{prefix}_ms": float(np.median(values)),
        f"p99_{prefix}_ms": float(np.percentile(values, 99)),
    }


@dataclass(frozen=True)
class RequestLatencies:
    """Per completed request, in milliseconds, aligned by index. ``tpot_ms``
    is 0 for one-token requests (it has no defined value there)."""

    completed: list[RequestRecord]
    ttft_ms: list[float]
    tpot_ms: list[float]
    e2el_ms: list[float]

    @property
    def defined_tpot_ms(self) -> list[float]:
        """TPOT of the requests with more than one token (vLLM's TPOT set)."""
        return [
            tpot
            for record, tpot in zip(self.completed, self.tpot_ms, strict=True)
            if record.num_tokens > 1
        ]


def request_latencies(result: RunResult) -> RequestLatencies:
    """TTFT, TPOT and E2EL of every request that generated all its tokens."""
    done = [
        r for r in result.records if r.finish_s >= 0 and r.num_tokens == r.output_len
    ]
    ttft = [(r.first_token_s - r.arrival_s) * 1e3 for r in done]
    e2el = [(r.finish_s - r.arrival_s) * 1e3 for r in done]
    tpot = [
        (e - t) / (r.num_tokens - 1) if r.num_tokens > 1 else 0.0
        for r, t, e in zip(done, ttft, e2el, strict=True)
    ]
    return RequestLatencies(done, ttft, tpot, e2el)


def compute_metrics(result: RunResult, slo: GoodputSLO) -> dict[str, Any]:
    """The JSON-ready metrics of one run."""
    latencies = request_latencies(result)
    done = latencies.completed
    duration = result.duration_s or 1e-9
    good = sum(
        slo.met(t, p, e)
        for t, p, e in zip(
            latencies.ttft_ms, latencies.tpot_ms, latencies.e2el_ms, strict=True
        )
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
        "goodput_slo_ms": {
            "ttft": slo.ttft_ms,
            "tpot": slo.tpot_ms,
            "e2el": slo.e2el_ms,
        },
    }
    metrics.update(latency_stats("ttft", latencies.ttft_ms))
    metrics.update(latency_stats("tpot", latencies.defined_tpot_ms))
    metrics.update(latency_stats("itl", np.frombuffer(result.itl_s, dtype=float) * 1e3))
    metrics.update(latency_stats("e2el", latencies.e2el_ms))
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
    return metrics


def padding_by_bucket(buckets: Mapping[int, list[int]]) -> dict[int, float]:
    return {bucket: padding_ratio(a, p) for bucket, (a, p) in sorted(buckets.items())}
