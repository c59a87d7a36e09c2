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

from neuron_scheduler.bench.engines import (
    RequestRecord,
    RunResult,
)
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


def percentile_key(percentile: float) -> str:
    """``p99``, ``p99.9``: ``vllm bench serve``'s names."""
    return f"p{int(percentile) if percentile == int(percentile) else percentile}"


def parse_percentile(item: str, where: str) -> float:
    """``"90"`` (or ``"p90"``) -> ``90.0``; ``ValueError`` starting with
    ``where`` and naming ``item`` when it is not a number in (0, 100]."""
    try:
        value = float(item.removeprefix("p"))
    except ValueError:
        raise ValueError(f"{where}: {item!r} is not a number") from None
    if not 0 < value <= 100:
        raise ValueError(f"{where}: {item!r} is not in (0, 100]")
    return value


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,99"`` -> ``(50.0, 90.0, 99.0)``; ``ValueError`` naming the
    offending value when one is not a number in (0, 100]."""
    where = f"--metric-percentiles {text!r}"
    return tuple(parse_percentile(item, where) for item in text.split(","))


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


def compute_metrics(
    result: RunResult, slo: GoodputSLO, percentiles: tuple[float, ...] = ()
) -> dict[str, Any]:
    """The JSON-ready metrics of one run (``percentiles``: extra
    ``pNN_*_ms`` keys; a fleet run adds ``replicas``, each engine's load)."""
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
    }


def padding_by_bucket(buckets: Mapping[int, list[int]]) -> dict[int, float]:
    return {bucket: padding_ratio(a, p) for bucket, (a, p) in sorted(buckets.items())}
