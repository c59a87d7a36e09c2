"""vLLM's own scheduler tests, unedited, with NeuronScheduler: every test
the stock scheduler passes here passes with ours, or is in the exclusion
list with the design rule it asserts against (and no entry is stale).

Also the report's bookkeeping on hand-made outcomes."""

import os
from pathlib import Path

import pytest

from helpers import SUMMARY
from neuron_scheduler.conformance.runner import (
    EXCLUDED,
    FAILED,
    NOT_COMPARABLE,
    PASSED,
    ConformanceReport,
    default_tests_dir,
    run_conformance,
)

pytestmark = pytest.mark.matrix

ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = Path(os.environ.get("NEURON_CONFORMANCE_TESTS", ROOT / default_tests_dir()))


def test_report_verdicts_and_stale_exclusions():
    stock = {"a": "passed", "b": "passed", "c": "passed", "d": "failed"}
    ours = {"a": "passed", "b": "failed", "c": "preempted", "d": "failed"}
    report = ConformanceReport(
        stock, ours, {"c": "preempts", "zzz*": "nothing"}, packed={"y*": "packs"}
    )
    assert report.verdicts == {
        "a": PASSED,
        "b": FAILED,
        "c": EXCLUDED,
        "d": NOT_COMPARABLE,
    }
    assert report.failures() == ["b"]
    assert report.stale_exclusions == ["zzz*", "y*"] and not report.ok
    assert "FAILED b (stock passes, ours: failed)" in report.format()


def test_a_module_stock_cannot_import_fails_the_report_unless_known():
    outcomes = {"m.py": "error", "k.py": "error", "m.py::t": "passed"}
    report = ConformanceReport(
        outcomes, outcomes, {}, not_importable={"k.py": "needs more", "j.py": "x"}
    )
    assert report.uncollected() == ["m.py"] and not report.ok
    assert "UNCOLLECTED m.py" in report.format()
    assert report.stale_exclusions == ["j.py"]  # imports fine: no longer known


@pytest.mark.slow
def test_vllm_scheduler_suite_passes_with_neuron_scheduler(record_property):
    if not (TESTS_DIR / "tests" / "v1" / "core").is_dir():
        pytest.skip(f"vLLM's scheduler tests not found at {TESTS_DIR}")
    report = run_conformance(TESTS_DIR)
    record_property(SUMMARY, report.format())  # the table goes to the log
    assert report.uncollected() == []  # the whole suite ran, with both
    # Exclusions stay a small minority of what stock passes.
    assert report.count(PASSED) >= 0.9 * (report.count(PASSED) + report.count(EXCLUDED))
    assert report.failures() == []
    assert report.stale_exclusions == []


def test_each_version_has_its_own_tables():
    from neuron_scheduler.conformance.exclusions import (
        Listed,
        exclusions_for,
        packed_for,
    )

    old, new = packed_for("0.29.0"), packed_for("0.32.0+cpu")
    preempt = "tests/v1/core/test_async_scheduler.py::test_preempt"
    active = "tests/v1/core/test_scheduler.py::test_max_num_active_seqs_caps_admission"
    assert preempt in old and preempt not in new  # gone from 0.31's suite
    assert active in new and active not in old  # new in 0.31's suite
    assert set(exclusions_for("0.29.0")) < set(exclusions_for("0.31.0"))
    with pytest.raises(ValueError, match="0.28.0"):
        exclusions_for("0.28.0")
    with pytest.raises(ValueError, match="0.28.0"):
        Listed("reason", ("0.28.0",))
