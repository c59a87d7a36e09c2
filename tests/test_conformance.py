"""vLLM's own scheduler tests, unedited, with NeuronScheduler: every test
the stock scheduler passes here passes with ours, or is in the exclusion
list with the design rule it asserts against (and no entry is stale).

Also the report's bookkeeping on hand-made outcomes."""

import os
from pathlib import Path

import pytest

from neuron_scheduler.conformance.runner import (
    DEFAULT_TESTS_DIR,
    EXCLUDED,
    FAILED,
    NOT_COMPARABLE,
    PASSED,
    ConformanceReport,
    run_conformance,
)

ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = Path(os.environ.get("NEURON_CONFORMANCE_TESTS", ROOT / DEFAULT_TESTS_DIR))


def test_report_verdicts_and_stale_exclusions():
    stock = {"a": "passed", "b": "passed", "c": "passed", "d": "failed"}
    ours = {"a": "passed", "b": "failed", "c": "preempted", "d": "failed"}
    report = ConformanceReport(stock, ours, {"c": "preempts", "zzz*": "nothing"})
    assert report.verdicts == {
        "a": PASSED,
        "b": FAILED,
        "c": EXCLUDED,
        "d": NOT_COMPARABLE,
    }
    assert report.failures() == ["b"]
    assert "zzz*" in report.stale_exclusions and not report.ok
    assert "FAILED b (stock passes, ours: failed)" in report.format()


@pytest.mark.slow
def test_vllm_scheduler_suite_passes_with_neuron_scheduler():
    if not (TESTS_DIR / "tests" / "v1" / "core").is_dir():
        pytest.skip(f"vLLM's scheduler tests not found at {TESTS_DIR}")
    report = run_conformance(TESTS_DIR)
    print("\n" + report.format())
    assert report.count(PASSED) > 800  # the suite really ran with ours
    assert report.failures() == []
    assert report.stale_exclusions == []
