"""Every vLLM internal the package relies on is as the installed vLLM (one
of the supported versions) has it; a vLLM that changed one fails here, by
name (see ``vllm_internals``)."""

import re
from pathlib import Path

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from neuron_scheduler import vllm_internals
from neuron_scheduler.vllm_internals import check_internals, internals

pytestmark = pytest.mark.matrix

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("internal", internals(), ids=lambda i: i.name)
def test_internal_is_as_expected(internal):
    problem = internal.check()
    assert problem is None, f"vLLM internal changed: {internal.name}: {problem}"


def _named(problems, fragment):
    return [p for p in problems if fragment in p]


def test_a_removed_hook_is_named(monkeypatch):
    hook = vllm_internals.scheduler_features().promotes_blocked_by
    monkeypatch.delattr(Scheduler, hook)
    (problem,) = check_internals()
    assert problem.startswith("Scheduler._is_blocked_waiting_status")
    assert f"Scheduler.{hook} is gone" in problem


def test_a_changed_signature_is_named(monkeypatch):
    def _preprocess(self, output, num_tokens):  # renamed parameters
        raise AssertionError

    monkeypatch.setattr(GPUModelRunner, "_preprocess", _preprocess)
    monkeypatch.setattr(BlockPool, "get_num_free_blocks", property(lambda s: 0))
    problems = check_internals()
    assert len(problems) == 2
    (runner,) = _named(problems, "GPUModelRunner._preprocess parameters are")
    assert "['self', 'output', 'num_tokens']" in runner
    assert _named(problems, "KVCacheManager.block_pool")


def test_a_limit_the_parent_stopped_reading_is_named(monkeypatch):
    source = vllm_internals._schedule_source()
    monkeypatch.setattr(
        vllm_internals,
        "_schedule_source",
        lambda: source.replace("self.max_num_running_reqs", "self.limits.running"),
    )
    (problem,) = check_internals()
    assert "no longer reads ['max_num_running_reqs']" in problem


def test_the_upgrade_checklist_lists_every_internal():
    checklist = (ROOT / "docs" / "vllm-internals.md").read_text()
    missing = [i.name for i in internals() if f"`{i.name}`" not in checklist]
    assert missing == []


#: Parent and cache-manager state only ``vllm_internals`` reads or writes.
INTERNAL_NAMES = (
    "current_step", "num_waiting_for_streaming_input", "num_lookahead_tokens",
    "enable_kv_cache_events", "watermark_blocks", "deferred_waiting",
    "skipped_waiting", "kv_holding_waiting", "_is_blocked_waiting_status",
    "req_to_blocks", "single_type_managers", "block_pool", "_names_to_collectors",
    "finished_recving_kv_req_ids",
)  # fmt: skip


def test_no_other_module_touches_the_internals_by_name():
    package = ROOT / "src" / "neuron_scheduler"
    pattern = re.compile(r"\.(" + "|".join(INTERNAL_NAMES) + r")\b")
    touching = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "vllm_internals.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert touching == []
