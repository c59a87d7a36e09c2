"""How vLLM's scheduler tests are run with NeuronScheduler, and which may fail.

Two tables, keyed by test id patterns (``fnmatch``, relative to the suite's
root), each entry for every supported vLLM unless it names its versions
(``Listed``): each version's own suite has its own tests, so each version
has its own list (``packed_for``, ``exclusions_for``):

* ``PACKED``: tests that differ from the design's default only in how many
  prompts one prefill step holds. They run with packing (``packing``: every
  prompt that fits joins the step's prefill, ``max_prefills_per_batch =
  max_num_seqs``) and must pass.
* ``EXCLUSIONS``: tests that assert what the static-shape design forbids
  (a preemption, a second prefill still in progress); each entry names the
  rule in one line. The conformance run fails on an entry that no longer
  matches a failing test, so the list cannot outgrow the design.

A test that passes although our scheduler preempted a request counts as a
failure (the plugin records it), whatever the test asserts.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from neuron_scheduler.vllm_compat import SUPPORTED_VLLM, base_version


@dataclass(frozen=True)
class Listed:
    """A table entry that holds only for some vLLM ``versions``."""

    reason: str
    versions: tuple[str, ...]

    def __post_init__(self) -> None:
        unknown = [v for v in self.versions if v not in SUPPORTED_VLLM]
        if unknown:
            raise ValueError(f"Listed for unsupported vLLM versions {unknown}")


Entry = str | Listed

#: Versions an entry holds for: those whose suite has the test.
SINCE_0_29 = ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
SINCE_0_30 = ("0.30.0", "0.31.0", "0.32.0", "0.33.0")
SINCE_0_31 = ("0.31.0", "0.32.0", "0.33.0")
BEFORE_0_31 = ("0.24.0", "0.29.0", "0.30.0")
ONLY_0_33 = ("0.33.0",)

_SCHED = "tests/v1/core/test_scheduler.py::"
_ASYNC = "tests/v1/core/test_async_scheduler.py::"
_DEFER = "tests/v1/core/test_deferred_block_free.py::"
_PRIO = "tests/v1/core/test_priority_preemption_bug.py::"

#: pattern -> what the test counts (several prompts prefilled in one step).
PACKED: dict[str, Entry] = {
    f"{_ASYNC}test_abort": "10 prompts start together; abort order = tokens made",
    f"{_ASYNC}test_preempt": Listed(
        "10 prompts start together; abort order = tokens made", BEFORE_0_31
    ),
    f"{_ASYNC}test_prefix_caching_for_multi_turn": "5 next turns in one step",
    f"{_ASYNC}test_prefix_caching_for_prefill_dedup": "2 equal prompts in one step",
    f"{_DEFER}test_multiple_deferred_frees_drain_in_order": "2 prompts in one step",
    f"{_SCHED}test_block_drafters_cap_requests_instead_of_draft_slots[[]*": Listed(
        "4 or 5 prompts in one step", ONLY_0_33
    ),
    f"{_SCHED}test_external_prefix_cache_metrics[[]False-False[]]": (
        "2 prompts with connector hits in one step"
    ),
    f"{_SCHED}test_kv_connector_basic[*": "2 prompts with connector hits in one step",
    f"{_SCHED}test_kv_connector_honors_skip_reading_prefix_cache": Listed(
        "2 prompts in one step", SINCE_0_31
    ),
    f"{_SCHED}test_long_prefill_threshold_applies_with_other_requests": Listed(
        "a capped long prompt and a short one in one step", SINCE_0_31
    ),
    f"{_SCHED}test_long_prefill_threshold_floored_by_fair_share": Listed(
        "a capped long prompt and a short one in one step", SINCE_0_31
    ),
    f"{_SCHED}test_max_num_active_seqs_caps_admission": Listed(
        "3 prompts in one step", SINCE_0_31
    ),
    f"{_SCHED}test_priority_scheduling_arrival_time_tiebreaker": (
        "3 prompts in one step, in priority order"
    ),
    f"{_SCHED}test_priority_scheduling_basic_ordering": (
        "3 prompts in one step, in priority order"
    ),
    f"{_SCHED}test_priority_scheduling_fcfs_fallback": (
        "4 prompts in one step, in priority order"
    ),
    f"{_SCHED}test_priority_scheduling_mixed_priority_and_arrival": (
        "4 prompts in one step, in priority order"
    ),
    f"{_SCHED}test_priority_scheduling_no_preemption_when_space_available": (
        "2 prompts in one step"
    ),
    f"{_SCHED}test_priority_scheduling_with_limited_slots": "2 prompts in one step",
    f"{_SCHED}test_schedule[[]*": "10 prompts in one step",
    f"{_SCHED}test_schedule_skip_tokenizer_init": "5 prompts in one step",
    f"{_SCHED}test_scheduler_stats_waiting_queues": "2 prompts in one step",
    f"{_SCHED}test_variable_length_cross_attn_block_allocation": (
        "3 encoder-decoder prompts in one step"
    ),
}

_PREEMPTS = "asserts a preemption (static-shape hardware keeps KV in place)"
_FORCED = (
    "preempts by an explicit call (the test's own _preempt_request, "
    "reset_prefix_cache(reset_running_requests=True) or "
    "release_kv_cache_memory): ours lets vLLM do it, and a preemption counts "
    "against conformance"
)
_WS = "tests/v1/core/test_worker_slot_overflow.py::"

#: pattern -> the design rule the test contradicts.
EXCLUSIONS: dict[str, Entry] = {
    f"{_ASYNC}test_kv_pressure_preempt_mid_handoff[[]*": Listed(_PREEMPTS, SINCE_0_29),
    f"{_ASYNC}test_kv_pressure_preemption_with_inflight_output[[]*": Listed(
        _PREEMPTS, SINCE_0_29
    ),
    f"{_ASYNC}test_reset_prefix_cache_with_inflight_output_under_kv_pressure[[]*": (
        Listed(_FORCED, SINCE_0_29)
    ),
    f"{_DEFER}test_preempt_defers_free_and_clears_bookkeeping": _FORCED,
    f"{_DEFER}test_allocation_retry_waits_for_fence_then_succeeds[[]*": Listed(
        _PREEMPTS, SINCE_0_30
    ),
    f"{_PRIO}test_priority_scheduler_preempt_skipped_request": Listed(
        _PREEMPTS, SINCE_0_29
    ),
    f"{_SCHED}test_kv_connector_handles_preemption[[]*": _PREEMPTS,
    f"{_SCHED}test_kv_cache_release_after_keep_pause_preserves_requests": Listed(
        _FORCED, SINCE_0_31
    ),
    f"{_SCHED}test_preempt_during_execution": _PREEMPTS,
    f"{_SCHED}test_preemption_processes_stale_aux_output": Listed(_FORCED, SINCE_0_31),
    f"{_SCHED}test_preemption_re_records_prefix_cache_query": Listed(
        _FORCED, SINCE_0_29
    ),
    f"{_SCHED}test_priority_scheduling_preemption": _PREEMPTS,
    f"{_SCHED}test_priority_scheduling_preemption_and_resumption_when_out_of_kv[[]*": (
        _PREEMPTS
    ),
    f"{_SCHED}test_scheduler_reset_prefix_cache": _FORCED,
    f"{_WS}test_reset_prefix_cache_priority_does_not_over_admit_worker_slot": Listed(
        _FORCED, SINCE_0_29
    ),
    f"{_WS}test_reset_prefix_cache_same_step_resume_purges_then_re_adds": Listed(
        _FORCED, SINCE_0_29
    ),
    f"{_SCHED}test_schedule_concurrent_partial_requests[[]*": (
        "admits prompts while a chunked prefill is in progress (three in flight)"
    ),
    f"{_SCHED}test_schedule_order[[]True]": (
        "admits a second long prompt while the first is still in its chunked prefill"
    ),
    f"{_SCHED}test_diffusion_scheduler_is_selected_by_default[[]*": Listed(
        "compares vLLM's default scheduler class with the test module's name "
        "Scheduler, which the conformance plugin points at ours",
        ("0.31.0",),
    ),
    f"{_SCHED}test_max_loras_counts_running_request_skipped_for_encoder_budget": Listed(
        "chunks two prompts in one step (a prefill in progress runs alone)",
        ONLY_0_33,
    ),
    f"{_SCHED}test_draft_slots_budgeted_per_scheduled_request": Listed(
        "cuts a packed follower into a chunk (packed prompts join whole)",
        SINCE_0_29,
    ),
    f"{_SCHED}test_throttle_prefills_excludes_remote_kv_resume": Listed(
        "schedules the rest of a prompt after a partial KV load beside a "
        "decode (prefill and decode never share a step)",
        ("0.24.0",),
    ),
}


def _for_version(table: dict[str, Entry], version: str) -> dict[str, str]:
    """The entries of ``table`` that hold for vLLM ``version``, pattern ->
    reason."""
    version = base_version(version)
    if version not in SUPPORTED_VLLM:
        raise ValueError(
            f"no conformance tables for vLLM {version}; supported: {SUPPORTED_VLLM}"
        )
    chosen = {}
    for pattern, entry in table.items():
        if isinstance(entry, str):
            chosen[pattern] = entry
        elif version in entry.versions:
            chosen[pattern] = entry.reason
    return chosen


def packed_for(version: str) -> dict[str, str]:
    """``PACKED`` for vLLM ``version``."""
    return _for_version(PACKED, version)


def exclusions_for(version: str) -> dict[str, str]:
    """``EXCLUSIONS`` for vLLM ``version``."""
    return _for_version(EXCLUSIONS, version)


#: Test modules of the copy that cannot be imported here, for both
#: schedulers alike: they need more of vLLM's test tree than the copy holds.
NOT_IMPORTABLE: dict[str, Entry] = {
    "tests/v1/core/prefix_cache/test_hybrid_prefix_cache_hit_rate.py": Listed(
        "imports vLLM's tests/utils.py (an OpenAI server harness), not in the copy",
        SINCE_0_31,
    ),
}


def not_importable_for(version: str) -> dict[str, str]:
    """``NOT_IMPORTABLE`` for vLLM ``version``."""
    return _for_version(NOT_IMPORTABLE, version)


def packing(vllm_config: Any) -> dict[str, Any]:
    """The ``neuron_config`` tests in ``PACKED`` run with: every prompt that
    fits may join the step's prefill (``max_prefills_per_batch`` at its
    maximum, ``max_num_seqs``)."""
    return {"max_prefills_per_batch": vllm_config.scheduler_config.max_num_seqs}


def packed_by(test_id: str, packed: dict[str, str]) -> str | None:
    """The pattern of ``packed`` (a ``packed_for`` table) covering
    ``test_id``, if any."""
    return next((p for p in packed if fnmatch.fnmatchcase(test_id, p)), None)
