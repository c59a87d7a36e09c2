"""Prometheus export of ``SchedulerMetrics`` through vLLM's stat-logger
plugin mechanism.

The scheduler runs in vLLM's engine-core process, ``/metrics`` is served by
the API-server process, and ``SchedulerStats`` cannot carry extra fields
across that boundary (it is decoded as a fixed msgspec type). So the
scheduler, when vLLM's stats are on, writes its ``snapshot()`` (a few
hundred bytes of JSON, atomically, at most once a second) to
``snapshot_path(vllm_config, engine_index)``; ``NeuronStatLogger``, loaded
by vLLM from the ``vllm.stat_logger_plugins`` entry point in the API-server
process, registers a Prometheus collector that reads those files at scrape
time. Names follow vLLM's (``neuron_scheduler:...``, ``engine`` label).

Exported (``engine`` label on all; counters get Prometheus' ``_total``):
* ``neuron_scheduler:prefill_tokens`` / ``prefill_padded_tokens`` /
  ``prefill_steps`` (counters, label ``bucket``);
* ``neuron_scheduler:prefill_padding_tokens`` (histogram of each step's
  padding tokens, label ``bucket``);
* ``neuron_scheduler:decode_slots`` / ``decode_padded_slots`` /
  ``decode_steps`` and the ``decode_padding_slots`` histogram (label
  ``bucket``: the batch-size bucket);
* ``neuron_scheduler:steps`` and ``neuron_scheduler:state_seconds``
  (counters, label ``state``);
* ``neuron_scheduler:admission_refusals`` (counter, label ``rule``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from neuron_scheduler.snapshots import read_snapshot, remove_snapshots, snapshot_path
from neuron_scheduler.vllm_internals import unregister_collector

PREFIX = "neuron_scheduler:"


class SnapshotCollector(Collector):
    """Yields the metric families of every engine's latest snapshot."""

    def __init__(self, paths: dict[str, Path]) -> None:
        self.paths = paths

    def collect(self) -> Iterator[Any]:
        snapshots = {
            engine: snapshot
            for engine, path in self.paths.items()
            if (snapshot := read_snapshot(path)) is not None
        }
        yield from families(snapshots)

    def describe(self) -> Iterator[Any]:
        yield from families({})


def families(snapshots: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """Prometheus metric families for ``{engine label: snapshot}``."""
    for kind, unit in (("prefill", "tokens"), ("decode", "slots")):
        # (family, snapshot field) for the three counters by bucket.
        counters = [
            (
                CounterMetricFamily(
                    f"{PREFIX}{kind}_{name}", doc, labels=["engine", "bucket"]
                ),
                field,
            )
            for name, doc, field in (
                (unit, f"Real {kind} {unit} scheduled, by padded bucket.", "actual"),
                (
                    f"padded_{unit}",
                    f"{kind.capitalize()} {unit} after padding.",
                    "padded",
                ),
                ("steps", f"{kind.capitalize()} steps, by bucket.", "steps"),
            )
        ]
        padding = HistogramMetricFamily(
            f"{PREFIX}{kind}_padding_{unit}",
            f"Padding {unit} per {kind} step, by bucket.",
            labels=["engine", "bucket"],
        )
        for engine, snapshot in snapshots.items():
            bounds = snapshot["padding_histogram_bounds"]
            for bucket, tally in snapshot[kind].items():
                labels = [engine, bucket]
                for family, field in counters:
                    family.add_metric(labels, tally[field])
                cumulative = [
                    (str(bound), count)
                    for bound, count in zip(
                        bounds, tally["padding_histogram"], strict=True
                    )
                ]
                cumulative.append(("+Inf", tally["steps"]))
                padding.add_metric(
                    labels, cumulative, sum_value=tally["padded"] - tally["actual"]
                )
        yield from (family for family, _ in counters)
        yield padding
    state_steps = CounterMetricFamily(
        f"{PREFIX}steps", "Scheduler steps, by state.", labels=["engine", "state"]
    )
    state_seconds = CounterMetricFamily(
        f"{PREFIX}state_seconds",
        "Seconds spent in each scheduler state.",
        labels=["engine", "state"],
    )
    refusals = CounterMetricFamily(
        f"{PREFIX}admission_refusals",
        "Waiting requests not admitted, by the admission rule that refused.",
        labels=["engine", "rule"],
    )
    at_largest = CounterMetricFamily(
        f"{PREFIX}steps_at_largest_bucket",
        "Steps padded to a bucket list's largest bucket because no smaller "
        "one fits, by list (prefill_tokens, decode_batch, decode_context).",
        labels=["engine", "dimension"],
    )
    for engine, snapshot in snapshots.items():
        for dimension, count in snapshot.get("steps_at_largest_bucket", {}).items():
            at_largest.add_metric([engine, dimension], count)
        for state, count in snapshot["state_steps"].items():
            state_steps.add_metric([engine, state], count)
        for state, seconds in snapshot["state_seconds"].items():
            state_seconds.add_metric([engine, state], seconds)
        for rule, count in snapshot["refusals"].items():
            refusals.add_metric([engine, rule], count)
    yield from (state_steps, state_seconds, refusals, at_largest)


class NeuronStatLogger(AggregateStatLoggerBase):
    """vLLM stat-logger plugin: exposes the NeuronScheduler snapshots of the
    engines in ``engine_indexes`` on vLLM's ``/metrics``. A no-op for engines
    not running ``NeuronScheduler`` (no snapshot file, no samples)."""

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int]) -> None:
        paths = {str(i): snapshot_path(vllm_config, i) for i in engine_indexes}
        self.collector = SnapshotCollector(paths)
        _unregister_previous()
        REGISTRY.register(self.collector)
        # On SIGTERM the server stops its engine cores without letting their
        # schedulers clean up; this process outlives them and removes their
        # snapshots when it exits (or when this logger goes away).
        weakref.finalize(self, remove_snapshots, tuple(paths.values()))

    def record(
        self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0
    ):  # type: ignore[no-untyped-def]
        """Nothing per step: the collector reads the snapshots at scrape time."""

    def log_engine_initialized(self) -> None:
        """The scheduler logs its own configuration at start."""


def _unregister_previous() -> None:
    """Drop a collector left by an earlier engine in this process (tests,
    engine restarts): Prometheus refuses duplicate metric names."""
    unregister_collector(REGISTRY, f"{PREFIX}steps_total")
