"""SchedulerMetrics: padding per bucket, state occupancy, refusals, the
periodic INFO line, and the snapshot the Prometheus collector exports."""

import json
import logging
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from helpers import prompt
from neuron_scheduler import NeuronScheduler
from neuron_scheduler.admission import AdmissionRule
from neuron_scheduler.metrics import SchedulerMetrics
from neuron_scheduler.offline.engine import (
    EngineSettings,
    OfflineEngine,
    build_scheduler,
)
from neuron_scheduler.snapshots import read_snapshot
from neuron_scheduler.stat_logger import SnapshotCollector
from neuron_scheduler.step import SchedulerState, StepKind, StepRecord


def _engine(log_stats=False, **settings):
    scheduler = build_scheduler(
        NeuronScheduler, EngineSettings(**settings), log_stats=log_stats
    )
    return OfflineEngine(scheduler)


def test_padding_is_counted_per_bucket_and_refusals_per_rule():
    engine = _engine(max_num_seqs=2)
    engine.add("a", prompt(200, 1), max_tokens=3)  # 256 bucket
    engine.add("b", prompt(100, 2), max_tokens=3)  # 128 bucket
    engine.add("c", prompt(300, 3), max_tokens=2)  # waits: max_num_seqs
    engine.run()
    metrics = engine.scheduler.metrics
    assert {b: (t.steps, t.actual, t.padded) for b, t in metrics.prefill.items()} == {
        256: (1, 200, 256),
        128: (1, 100, 128),
        512: (1, 300, 512),
    }
    # decodes: a+b twice (batch 2), then c once (batch 1)
    assert {b: (t.steps, t.actual, t.padded) for b, t in metrics.decode.items()} == {
        2: (2, 4, 4),
        1: (1, 1, 1),
    }
    assert metrics.prefill_tokens == 600 and metrics.prefill_tokens_padded == 896
    assert metrics.refusals[AdmissionRule.MAX_NUM_SEQS] >= 1
    assert metrics.refusals[AdmissionRule.PREFILL_IN_PROGRESS] == 0
    assert metrics.steps[StepKind.PREFILL] == 3 and metrics.steps[StepKind.DECODE] == 3


def test_time_in_state_runs_until_the_next_step():
    metrics = SchedulerMetrics()
    prefill = StepRecord(StepKind.PREFILL, ("a",), {"a": 10}, {"a": 16}, 1, 1)
    decode = StepRecord(StepKind.DECODE, ("a",), {"a": 1}, {"a": 1}, 1, 2)
    empty = StepRecord(StepKind.EMPTY, ())
    metrics.add(prefill, now=10.0)
    metrics.add(decode, now=10.5)
    metrics.add(decode, now=10.7)
    metrics.add(empty, now=11.0)
    seconds = metrics.state_seconds
    assert seconds[SchedulerState.ACTIVE_PREFILL] == 0.5
    assert abs(seconds[SchedulerState.ACTIVE_DECODE] - 0.5) < 1e-9
    assert seconds[SchedulerState.IDLE] == 0.0
    histogram = metrics.prefill[16].padding_histogram  # padding 6 per step
    assert histogram == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert "Prefill padding: 37.5% (6 of 16 tokens)" in metrics.log_line()
    assert "decode padding: 50.0% (2 of 4 slots)" in metrics.log_line()


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_stats_on_logs_periodically_and_publishes_a_snapshot(monkeypatch):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.001")
    engine = _engine(log_stats=True)
    scheduler = engine.scheduler
    path = scheduler._snapshot_path
    engine.add("a", prompt(200, 1), max_tokens=4)
    handler = _Lines()
    scheduler_logger = logging.getLogger("vllm.neuron_scheduler.scheduler")
    scheduler_logger.addHandler(handler)
    level = scheduler_logger.level
    scheduler_logger.setLevel(logging.INFO)  # vLLM's level may be WARNING here
    # The steps of a model-less engine can all fit in one interval (they did
    # on a fast machine): the first one comes after an interval has passed.
    time.sleep(0.002)
    try:
        engine.run()
    finally:
        scheduler_logger.removeHandler(handler)
        scheduler_logger.setLevel(level)
    assert any("NeuronScheduler: Prefill padding" in line for line in handler.lines)
    snapshot = read_snapshot(path)  # published when the engine went idle
    assert snapshot["prefill"]["256"]["actual"] == 200
    assert snapshot["decode"]["1"]["actual"] == 3
    # What /metrics would show, through the collector vLLM's plugin registers.
    registry = CollectorRegistry()
    registry.register(SnapshotCollector({"0": path}))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    key = (("bucket", "256"), ("engine", "0"))
    assert samples[("neuron_scheduler:prefill_tokens_total", key)] == 200
    assert samples[("neuron_scheduler:prefill_padded_tokens_total", key)] == 256
    assert samples[("neuron_scheduler:prefill_padding_tokens_sum", key)] == 56
    assert samples[("neuron_scheduler:prefill_padding_tokens_count", key)] == 1
    state = (("engine", "0"), ("state", "active_decode"))
    assert samples[("neuron_scheduler:steps_total", state)] == 3
    scheduler.shutdown()
    assert not path.exists()


def test_stats_off_publishes_nothing():
    engine = _engine(log_stats=False)
    assert engine.scheduler._snapshot_path is None


def test_dashboard_queries_only_metrics_the_collector_exports():
    from helpers import DASHBOARD, dashboard_metrics, exposed_metrics

    dashboard = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in dashboard["templating"]["list"]] == [
        "DS_PROMETHEUS",
        "engine",
    ]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'engine=~"$engine"' in target["expr"], panel["title"]
    queried = dashboard_metrics()
    assert len(queried) >= 9
    registry = CollectorRegistry()
    registry.register(SnapshotCollector({}))  # no engine yet: families only
    assert queried - exposed_metrics(generate_latest(registry).decode()) == set()


def test_steps_that_fit_only_the_largest_bucket_are_counted_per_list(tmp_path):
    from neuron_scheduler.snapshots import write_snapshot
    from neuron_scheduler.step import BucketDimension, LargestBucketOnly

    largest_only = LargestBucketOnly.of((128, 256, 512), (1, 2, 4), (1024, 2048))
    assert largest_only == LargestBucketOnly(256, 2, 1024)
    metrics = SchedulerMetrics(largest_only=largest_only)
    for total in (200, 256, 300, 512):  # the last two fit only 512
        metrics.add(StepRecord(StepKind.PREFILL, ("a",), {"a": total}, {"a": 512}))
    # (rows, longest context): 3 rows fit only 4; 1500 fits only 2048.
    for rows, context in ((2, 1000), (3, 1000), (2, 1500), (4, 2048)):
        ids = tuple(str(i) for i in range(rows))
        ones = dict.fromkeys(ids, 1)
        metrics.add(
            StepRecord(StepKind.DECODE, ids, ones, ones, rows, 4, context, 2048)
        )
    metrics.add(StepRecord(StepKind.EMPTY, ()))
    assert metrics.steps_at_largest == {
        BucketDimension.PREFILL_TOKENS: 2,
        BucketDimension.DECODE_BATCH: 2,
        BucketDimension.DECODE_CONTEXT: 2,
    }
    # One bucket: every step of that kind is at its largest.
    single = LargestBucketOnly.of((512,), (1, 8), (2048,))
    record = StepRecord(StepKind.DECODE, ("a",), {"a": 1}, {"a": 1}, 1, 1, 10, 2048)
    assert single.dimensions(record) == [BucketDimension.DECODE_CONTEXT]
    # Exported per engine and list on /metrics.
    path = tmp_path / "engine-0.json"
    write_snapshot(path, metrics.snapshot())
    registry = CollectorRegistry()
    registry.register(SnapshotCollector({"0": path}))
    samples = {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
        if s.name == "neuron_scheduler:steps_at_largest_bucket_total"
    }
    assert samples == {
        (("dimension", d.value), ("engine", "0")): 2.0 for d in BucketDimension
    }
