"""Metrics of an xPyD run: the user's view (``vllm bench serve``'s, as any
run's) and each pool's: utilisation, queueing, the transfer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from neuron_scheduler.sim.disaggregated import DisaggregatedRun, Handoff
from neuron_scheduler.sim.records import RunResult
from neuron_scheduler.sim.results import compute_metrics, latency_stats
from neuron_scheduler.sim.slo import DEFAULT_GOODPUT, SLO

#: ``RunResult`` counters that add up over the two pools.
_SUMMED = tuple(
    f.name
    for f in fields(RunResult)
    if f.type in ("int", "float")
    and f.name not in ("duration_s", "wall_seconds", "max_running", "routed", "clock_s")
)


def combined_result(run: DisaggregatedRun) -> RunResult:
    """The user's run: the decode pool's records and token gaps (the
    tokens users see), both pools' step counters, every engine a replica
    (prefill engines first)."""
    prefill, decode = run.prefill, run.decode
    combined = replace(decode, replicas=[*prefill.replicas, *decode.replicas])
    for name in _SUMMED:
        setattr(combined, name, getattr(prefill, name) + getattr(decode, name))
    for name in ("prefill_buckets", "decode_buckets"):
        merged = {k: list(v) for k, v in getattr(decode, name).items()}
        for bucket, counts in getattr(prefill, name).items():
            mine = merged.setdefault(bucket, [0] * len(counts))
            merged[bucket] = [a + b for a, b in zip(mine, counts, strict=True)]
        setattr(combined, name, merged)
    return combined


def _busy_share(pool: RunResult) -> float:
    """Mean share of the run each of ``pool``'s engines spent in steps."""
    engines = pool.replicas or [pool]
    busy = sum(
        e.time_s["prefill"] + e.time_s["decode"] + e.time_s["mixed"] for e in engines
    )
    return busy / ((pool.duration_s or 1e-9) * len(engines))


def _ms(pairs: Sequence[tuple[float, float]]) -> list[float]:
    return [(end - start) * 1e3 for start, end in pairs]


def pool_metrics(run: DisaggregatedRun) -> dict[str, Any]:
    """Per pool and for the transfer, over the requests that finished
    with their first token (not failed):
    prefill queueing (sent to first prefill step) and latency (to the
    prompt's end), the decode engine's wait for room (received to
    transfer start), the transfer (start to done) and the decode engine's
    first token after it."""
    records = run.decode.records
    done: list[tuple[Handoff, float, float]] = [
        (h, r.arrival_s, r.first_token_s)
        for h, r in zip(run.handoffs, records, strict=True)
        if r.finish_s >= 0 and r.first_token_s >= 0 and h.transfer_done_s >= 0
    ]
    prefill = {
        "engines": run.sizes.prefill,
        "utilisation": _busy_share(run.prefill),
        **latency_stats(
            "queue", _ms([(a, h.prefill_first_step_s) for h, a, _ in done])
        ),
        **latency_stats("prefill", _ms([(a, h.prefill_done_s) for h, a, _ in done])),
    }
    transfer = {
        "mode": run.transfer.mode.value,
        "link_bytes_per_s": run.transfer.link_bytes_per_s,
        "latency_s": run.transfer.latency_s,
        "mean_bytes": (
            sum(h.transfer_bytes for h, _, _ in done) / len(done) if done else 0.0
        ),
        **latency_stats(
            "transfer",
            _ms([(h.transfer_start_s, h.transfer_done_s) for h, _, _ in done]),
        ),
        **latency_stats(
            "wait_for_slot", _ms([(h.sent_s, h.transfer_start_s) for h, _, _ in done])
        ),
    }
    decode = {
        "engines": run.sizes.decode,
        "utilisation": _busy_share(run.decode),
        **latency_stats(
            "first_token_after_transfer",
            _ms([(h.transfer_done_s, first) for h, _, first in done]),
        ),
    }
    return {
        "pools": str(run.sizes),
        "prefill": prefill,
        "transfer": transfer,
        "decode": decode,
    }


def disaggregated_metrics(
    run: DisaggregatedRun,
    goodput: Sequence[SLO] = DEFAULT_GOODPUT,
    percentiles: tuple[float, ...] = (),
) -> dict[str, Any]:
    """``compute_metrics`` of the user's run, with ``disaggregated``: the
    pools' own figures (``pool_metrics``)."""
    combined = combined_result(run)
    combined.wall_seconds = run.wall_seconds
    metrics = compute_metrics(combined, goodput, percentiles)
    metrics["disaggregated"] = pool_metrics(run)
    return metrics
