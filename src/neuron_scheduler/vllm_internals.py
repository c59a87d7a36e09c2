"""Every vLLM internal neuron-scheduler relies on, in one place.

vLLM's public scheduler contract (``SchedulerInterface``) says nothing about
how a pass scans its queues, so a scheduler that reshapes what the parent
sees must lean on how vLLM's ``Scheduler`` is written. Each such reliance is
an ``Internal`` here, with a ``check`` that reads the installed vLLM and
says what changed (``None``: as expected). ``check_internals()`` runs them
all; the test suite runs each by name, so an upgrade that breaks one fails
loudly, naming it. The accessors below are the only code that touches these
internals; the hooks the scheduler and worker override are named here and
checked for the signature they rely on.

Where the supported vLLMs (``vllm_compat.SUPPORTED_VLLM``) differ, the
difference is detected by feature, once, in ``scheduler_features()``: a
name the parent reads, a method it has. Each feature has a known form per
version and a check that the installed vLLM has one of them.

Public APIs are used wherever they exist and cost no more than the
internal (``pause_state``, ``get_request_counts``, ``get_computed_blocks``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

#: The parent's limits a pass lowers while running requests are hidden; its
#: ``schedule()`` must read them from the instance on every call.
#: (``max_num_active_reqs`` only where ``SchedulerFeatures.active_limit``.)
LOWERED_LIMITS = (
    "max_num_running_reqs",
    "max_num_active_reqs",
    "max_num_scheduled_tokens",
)

#: Other state ``Scheduler.schedule()`` of every supported vLLM reads that
#: the plan depends on.
SCHEDULE_READS = (
    "waiting",
    "prefill_capacity_bound",
    "_make_cached_request_data",
)

#: vLLM 0.31 and later: waiting requests that hold KV blocks in a queue of
#: their own, drained first; requests the scan passed over in a set.
HOLDER_QUEUE_READS = (
    "kv_holding_waiting",
    "deferred_waiting",
    "adaptive_long_prefill_threshold",
    "get_request_counts",
)
#: vLLM 0.29 and 0.30: blocked and passed-over requests in one more queue,
#: drained first (by priority: the better head of the two).
SKIPPED_QUEUE_READS = ("skipped_waiting", "_select_waiting_queue_for_scheduling")

#: The hook where an empty pass is dropped (``NeuronScheduler``): called once
#: the parent's scans are over and before it builds the output.
EMPTY_PASS_HOOK = "_make_cached_request_data"


# ---------------------------------------------------------------- features


@dataclass(frozen=True)
class WaitingQueue:
    """One of the parent's waiting queues: its attribute on the scheduler,
    and whether its requests hold KV blocks (``True``: all, ``False``: none,
    ``None``: either, ask ``holds_kv_blocks``)."""

    attribute: str
    holds_kv: bool | None
    #: Still drained while the scheduler is paused for new requests
    #: (``PauseState.PAUSED_NEW``).
    drained_when_paused_new: bool = False


@dataclass(frozen=True)
class SchedulerFeatures:
    """How the installed vLLM's ``Scheduler`` does what differs between the
    supported versions (see ``scheduler_features``)."""

    #: The waiting queues, in the order the parent drains them (FCFS).
    waiting_queues: tuple[WaitingQueue, ...]
    #: The parent asks every waiting queue whether it is empty before it
    #: picks one (``self.waiting or self.skipped_waiting``), then takes the
    #: first non-empty one or, under the priority policy, the better head
    #: (0.29, 0.30); later versions drain the queues in order.
    picks_across_queues: bool
    #: Requests the scan passed over are kept in ``deferred_waiting`` (0.31+).
    deferred_set: bool
    #: ``max_num_active_reqs`` caps admission apart from the runner's slots.
    active_limit: bool
    #: ``long_prefill_token_threshold`` caps a prefill only while another
    #: request is eligible, floored at a fair share when adaptive (0.31+).
    long_prefill_threshold_with_others: bool
    #: The blocked-request method: ``_handle_blocked_waiting_request``
    #: (0.31+) or ``_try_promote_blocked_waiting_request``.
    promotes_blocked_by: str
    #: After a release step the parent sets ``prefill_capacity_bound`` from
    #: ``bool(self.waiting)`` (0.29, 0.30), which a gated queue would answer.
    capacity_bound_from_waiting_queue: bool
    #: The local prefill cadence: ``prefill_schedule_interval`` applied
    #: without data parallelism (0.33).
    local_prefill_interval: bool
    #: ``KVCacheManager.truncate_computed_blocks`` cuts a prefix-cache hit
    #: back (0.29+; ``kv_segment_size_buckets`` needs it).
    truncates_prefix_hits: bool = True
    #: ``KVCacheManager.get_computed_blocks`` records the lookup in the prefix
    #: cache's stats itself (0.24; later vLLMs record it apart).
    lookup_records_stats: bool = False


_CAPACITY_FROM_QUEUE = "self.prefill_capacity_bound = bool(self.waiting)"
_PAUSED_NEW_DRAINS = "not preempted_reqs and self._pause_state != PauseState.PAUSED_ALL"
_PAUSED_NEW_STOPS = "not preempted_reqs and self._pause_state == PauseState.UNPAUSED"


@cache
def scheduler_features() -> SchedulerFeatures:
    """The installed vLLM's ``SchedulerFeatures``, read from its
    ``Scheduler`` (the names ``schedule()`` reads, the methods it has)."""
    source = _schedule_source_flat()
    holder_queue = "self.kv_holding_waiting" in source
    queues: tuple[WaitingQueue, ...]
    if holder_queue:
        queues = (
            WaitingQueue(
                "kv_holding_waiting",
                True,
                drained_when_paused_new=_PAUSED_NEW_DRAINS in source,
            ),
            WaitingQueue("waiting", False),
        )
    else:
        queues = (WaitingQueue("skipped_waiting", None), WaitingQueue("waiting", None))
    return SchedulerFeatures(
        waiting_queues=queues,
        picks_across_queues=not holder_queue,
        deferred_set="self.deferred_waiting" in source,
        active_limit="self.max_num_active_reqs" in source,
        long_prefill_threshold_with_others=(
            "self.adaptive_long_prefill_threshold" in source
        ),
        promotes_blocked_by=(
            "_handle_blocked_waiting_request"
            if hasattr(Scheduler, "_handle_blocked_waiting_request")
            else "_try_promote_blocked_waiting_request"
        ),
        capacity_bound_from_waiting_queue=_CAPACITY_FROM_QUEUE in source,
        local_prefill_interval="self.local_prefill_interval" in source,
        truncates_prefix_hits=hasattr(KVCacheManager, "truncate_computed_blocks"),
        lookup_records_stats="prefix_cache_stats"
        in inspect.getsource(KVCacheManager.get_computed_blocks),
    )


def _features_known() -> str | None:
    """``None`` when the installed vLLM has one of the known forms of each
    feature, else what is unknown."""
    source = _schedule_source_flat()
    features = scheduler_features()
    problems = []
    layout = HOLDER_QUEUE_READS if features.deferred_set else SKIPPED_QUEUE_READS
    if problem := _read_by_schedule(*layout):
        problems.append(problem)
    if (_PAUSED_NEW_DRAINS in source) == (_PAUSED_NEW_STOPS in source):
        problems.append(
            "Scheduler.schedule's pause-state condition for the waiting scan "
            "is neither known form"
        )
    if not features.deferred_set and not features.capacity_bound_from_waiting_queue:
        problems.append(
            "Scheduler.schedule without deferred_waiting no longer sets "
            f"{_CAPACITY_FROM_QUEUE!r}"
        )
    if features.local_prefill_interval:
        problems += [
            p
            for p in (
                _read_by_schedule("num_executed_steps", "last_prefill_step"),
                None
                if "is_prefill_chunk" in source
                else "the local prefill cadence no longer reads is_prefill_chunk",
            )
            if p
        ]
    return "; ".join(problems) if problems else None


# --------------------------------------------------------------- accessors


def holds_kv_blocks(manager: KVCacheManager, request: Request) -> bool:
    """Whether a waiting ``request`` holds KV blocks now (KV cache group 0):
    asked per request where one queue holds both kinds (vLLM 0.29, 0.30).
    Exact where vLLM's own status-based guess (0.31's ``_holds_kv_blocks``)
    is not: a finished load of a whole prompt resets its computed tokens to
    0 and keeps its blocks."""
    return bool(blocks_held(manager).get(request.request_id))


def prefix_hit_tokens(manager: KVCacheManager, request: Request) -> int:
    """Tokens of ``request`` the local prefix cache holds now, as the
    parent's lookup will find them, without counting a query in the cache's
    stats (0.24's lookup counts one unless its ``log_stats`` is off)."""
    if not (scheduler_features().lookup_records_stats and manager.log_stats):
        return int(manager.get_computed_blocks(request)[1])
    manager.log_stats = False
    try:
        return int(manager.get_computed_blocks(request)[1])
    finally:
        manager.log_stats = True


def align_prefix_hits(manager: KVCacheManager, segment: int) -> None:
    """Make ``manager``'s prefix-cache lookups (``get_computed_blocks``: the
    parent's and admission's) end on a multiple of ``segment`` tokens: a
    longer hit is cut back with ``truncate_computed_blocks``."""
    lookup = manager.get_computed_blocks

    def aligned_lookup(request: Request, *args: Any, **kwargs: Any) -> Any:
        blocks, num_tokens, *rest = lookup(request, *args, **kwargs)
        aligned = num_tokens - num_tokens % segment
        if aligned != num_tokens:
            blocks = manager.truncate_computed_blocks(blocks, aligned)
        return (blocks, aligned, *rest)

    manager.get_computed_blocks = aligned_lookup  # type: ignore[method-assign]


def _prefix_lookup_alignable() -> str | None:
    problem = _method(KVCacheManager, "get_computed_blocks", ["self", "request"])
    if not problem and scheduler_features().lookup_records_stats:
        problem = _attributes_set(KVCacheManager, "self.log_stats")
    if problem or not scheduler_features().truncates_prefix_hits:
        return problem  # without truncation, segments are refused at start
    return _method(
        KVCacheManager,
        "truncate_computed_blocks",
        ["self", "blocks", "num_computed_tokens"],
    )


def prefill_interval_holds(scheduler: Scheduler) -> bool:
    """Whether vLLM 0.33's local prefill cadence holds prefills this step
    (``SchedulerFeatures.local_prefill_interval``), as its ``schedule()``
    decides it before its scans: an interval > 1, the last release not
    capacity-bound, fewer executed steps since the last prefill-carrying one
    than the interval, and a decode running."""
    interval: int = getattr(scheduler, "local_prefill_interval", 1)
    if interval <= 1 or scheduler.prefill_capacity_bound:
        return False
    executed: int = getattr(scheduler, "num_executed_steps")  # noqa: B009 (0.33)
    last_prefill: int = getattr(scheduler, "last_prefill_step")  # noqa: B009
    return executed + 1 - last_prefill < interval and any(
        not r.is_prefill_chunk for r in scheduler.running
    )


def max_active_requests(scheduler: Scheduler) -> int:
    """The most requests the parent admits into running: its
    ``max_num_active_reqs`` where it has one, else its runner slots."""
    return min(
        scheduler.max_num_running_reqs,
        getattr(scheduler, "max_num_active_reqs", scheduler.max_num_running_reqs),
    )


def is_ready_to_schedule(scheduler: Scheduler, request: Request) -> bool:
    """False for a waiting request in a blocked state that is still blocked
    (the parent passes it over); promotes one whose wait is over, as the
    parent does (idempotent)."""
    if not scheduler._is_blocked_waiting_status(request.status):  # noqa: SLF001
        return True
    promote = getattr(scheduler, scheduler_features().promotes_blocked_by)
    return bool(promote(request))


def mark_deferred(scheduler: Scheduler, requests: Iterable[Request]) -> None:
    """Count ``requests`` as the parent counts the waiting requests its scan
    passed over, where it keeps them in a set (``deferred_set``)."""
    if scheduler_features().deferred_set:
        scheduler.deferred_waiting.update(requests)


def undo_step_count(scheduler: Scheduler) -> None:
    """Take back the step the parent counted (``current_step``) for a pass
    that is dropped and run again: one step, counted once (the parent
    compares it with ``next_decode_eligible_step``)."""
    scheduler.current_step -= 1


def waiting_for_streaming_input(scheduler: Scheduler) -> int:
    """Requests parked for their next streaming input: the parent counts
    them against its running limit."""
    return int(scheduler.num_waiting_for_streaming_input)


def lookahead_tokens(scheduler: Scheduler) -> int:
    """Slots the parent allocates per request beyond its tokens
    (speculative decoding's lookahead)."""
    return int(scheduler.num_lookahead_tokens)


def kv_events_enabled(scheduler: Scheduler) -> bool:
    """Whether the parent publishes KV cache events: its prefix lookups
    then emit events, so they are no read-only look."""
    return bool(scheduler.enable_kv_cache_events)


def watermark_blocks(manager: KVCacheManager) -> int:
    """Blocks vLLM keeps free while requests run (its watermark)."""
    return int(manager.watermark_blocks)


def blocks_held(manager: KVCacheManager) -> Mapping[str, Sized]:
    """Request id -> the blocks it holds in KV cache group 0 (the group
    manager's ``req_to_blocks``). ``KVCacheManager.get_blocks`` is the public
    view of one request, but builds an object per call: over every running
    request every step it costs ten times the lookup."""
    return manager.coordinator.single_type_managers[0].req_to_blocks


def num_free_blocks(manager: KVCacheManager) -> int:
    """Free blocks in the KV block pool (``usage`` is the public, rounded
    view of the same count)."""
    return manager.block_pool.get_num_free_blocks()


def prefix_block_in_use(manager: KVCacheManager, block_hash: Any) -> bool:
    """Whether the prefix cache holds ``block_hash`` in a block some request
    uses now (KV cache group 0), without touching the cache's LRU order."""
    cached = manager.block_pool.get_cached_block(block_hash, [0])
    return cached is not None and cached[0].ref_cnt > 0


def loading_requests(scheduler: Scheduler) -> list[str]:
    """Requests waiting for an async KV load the worker has not reported
    finished (a reported one waits only to be promoted)."""
    received = scheduler.finished_recving_kv_req_ids
    return [
        request_id
        for request_id, request in scheduler.requests.items()
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        and request_id not in received
    ]


def count_load_received(scheduler: Scheduler, request_id: str) -> None:
    """Count a load as reported, so that finishing its request frees its
    blocks at once (``finish_requests`` keeps them until the report)."""
    scheduler.finished_recving_kv_req_ids.add(request_id)


def unregister_collector(registry: CollectorRegistry, metric_name: str) -> None:
    """Drop the collector that registered ``metric_name``, if any
    (prometheus_client has no public lookup by name)."""
    existing: Collector | None = registry._names_to_collectors.get(  # noqa: SLF001
        metric_name
    )
    if existing is not None:
        registry.unregister(existing)


# ------------------------------------------------------------------ checks


@dataclass(frozen=True)
class Internal:
    """One reliance on vLLM internals: ``name`` (what an upgrade must
    check), ``used_for`` (what breaks without it), and ``check`` returning
    what changed, or ``None``."""

    name: str
    used_for: str
    check: Callable[[], str | None]


def _method(owner: type, name: str, expected: list[str]) -> str | None:
    """What differs in ``owner.name``: gone, or its first parameters."""
    function = getattr(owner, name, None)
    if not callable(function):
        return f"{owner.__name__}.{name} is gone"
    names = list(inspect.signature(function).parameters)
    if names[: len(expected)] != expected:
        return (
            f"{owner.__name__}.{name} parameters are {names}, expected to "
            f"start with {expected}"
        )
    return None


@cache
def _schedule_source() -> str:
    return inspect.getsource(Scheduler.schedule)


@cache
def _schedule_source_flat() -> str:
    """``Scheduler.schedule``'s source with each run of whitespace one
    space (its forms are matched across line breaks)."""
    return " ".join(_schedule_source().split())


def _read_by_schedule(*names: str) -> str | None:
    source = _schedule_source()
    missing = [n for n in names if f"self.{n}" not in source]
    return f"Scheduler.schedule no longer reads {missing}" if missing else None


def _attributes_set(owner: type, attribute: str) -> str | None:
    """``None`` if ``owner.__init__`` assigns ``attribute`` (``self.x``),
    annotated or not: ``self.x =`` or ``self.x: T =``."""
    assigned = rf"{re.escape(attribute)}\s*(:[^=\n]*)?="
    if re.search(assigned, inspect.getsource(owner.__init__)):  # type: ignore[misc]
        return None
    return f"{owner.__name__}.__init__ no longer sets {attribute}"


def _attributes(owner: type, *names: str) -> str | None:
    missing = [n for n in names if not hasattr(owner, n)]
    return f"{owner.__name__} lacks {missing}" if missing else None


def _output_adoptable() -> str | None:
    if not is_dataclass(SchedulerOutput) or hasattr(SchedulerOutput, "__slots__"):
        return "SchedulerOutput is no longer a plain dataclass"
    needed = {"num_scheduled_tokens", "scheduled_new_reqs", "scheduled_cached_reqs"}
    missing = needed - {f.name for f in fields(SchedulerOutput)}
    return f"SchedulerOutput lacks {sorted(missing)}" if missing else None


def _queue_abstracts() -> str | None:
    from neuron_scheduler.gate import AdmissionGate

    left = sorted(getattr(AdmissionGate, "__abstractmethods__", ()))
    abstract = sorted(RequestQueue.__abstractmethods__)
    if left:
        return f"RequestQueue has new abstract methods {left} (all: {abstract})"
    return None


def _model_runner_hooks() -> str | None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    problems = [
        _method(GPUModelRunner, "_determine_batch_execution_and_padding",
                ["self", "num_tokens"]),
        _method(GPUModelRunner, "_preprocess",
                ["self", "scheduler_output", "num_input_tokens",
                 "intermediate_tensors"]),
        _method(GPUModelRunner, "_dummy_run", ["self", "num_tokens"]),
    ]  # fmt: skip
    if "uniform_decode" not in inspect.signature(GPUModelRunner._dummy_run).parameters:
        problems.append("GPUModelRunner._dummy_run lost uniform_decode")
    found = [p for p in problems if p]
    return "; ".join(found) if found else None


def _padding_descriptor() -> str | None:
    from vllm.forward_context import BatchDescriptor

    if not is_dataclass(BatchDescriptor) and not hasattr(BatchDescriptor, "_replace"):
        return "BatchDescriptor is neither a dataclass nor a namedtuple"
    names = (
        {f.name for f in fields(BatchDescriptor)}
        if is_dataclass(BatchDescriptor)
        else set(BatchDescriptor._fields)
    )
    return None if "num_tokens" in names else "BatchDescriptor lacks num_tokens"


def lowered_limits() -> tuple[str, ...]:
    """The ``LOWERED_LIMITS`` the installed vLLM has."""
    if scheduler_features().active_limit:
        return LOWERED_LIMITS
    return tuple(n for n in LOWERED_LIMITS if n != "max_num_active_reqs")


def internals() -> tuple[Internal, ...]:
    """Every vLLM internal the package relies on (see the module docstring)."""
    return (
        Internal(
            "Scheduler features that differ between the supported vLLMs "
            "(waiting queues, pause states, limits, prefill cadence)",
            "the plan and admission follow the installed vLLM's rules",
            _features_known,
        ),
        Internal(
            "Scheduler._is_blocked_waiting_status / _handle_blocked_waiting_request "
            "(before 0.31: _try_promote_blocked_waiting_request)",
            "admission passes over a blocked waiting request as the parent "
            "does (grammar compiling, KV loading, streaming input)",
            lambda: (
                _method(
                    Scheduler,
                    scheduler_features().promotes_blocked_by,
                    ["self", "request"],
                )
                or _method(Scheduler, "_is_blocked_waiting_status", ["status"])
            ),
        ),  # fmt: skip
        Internal(
            f"Scheduler.{EMPTY_PASS_HOOK}",
            "a pass that computes nothing is dropped before it builds output "
            "(no empty step while decodes wait)",
            lambda: (
                _method(
                    Scheduler,
                    EMPTY_PASS_HOOK,
                    ["self", "running_reqs", "resumed_reqs", "num_scheduled_tokens"],
                )
                or _read_by_schedule(EMPTY_PASS_HOOK)
            ),
        ),  # fmt: skip
        Internal(
            "Scheduler.schedule reads "
            + ", ".join(LOWERED_LIMITS)
            + " (before 0.31: no max_num_active_reqs)",
            "decodes hidden during a prefill pass: the parent's running "
            "limits and token budget are lowered to match",
            lambda: _read_by_schedule(*lowered_limits()),
        ),
        Internal(
            "Scheduler.schedule reads " + ", ".join(SCHEDULE_READS[:-1]),
            "the waiting queues are gated in place; the DP throttle and the "
            "long-prefill threshold see the true counts",
            lambda: _read_by_schedule(*SCHEDULE_READS),
        ),
        Internal(
            "RequestQueue abstract methods",
            "AdmissionGate stands in for the waiting queues during a pass",
            _queue_abstracts,
        ),
        Internal(
            "KVCacheManager.coordinator.single_type_managers[0].req_to_blocks",
            "kv_admission='reserve' counts the blocks each holder has, every step",
            _blocks_held_readable,
        ),
        Internal(
            "KVCacheManager.block_pool (get_num_free_blocks, get_cached_block)",
            "kv_admission='reserve' counts blocks in use and shared prefixes",
            lambda: (
                _attributes(KVCacheManager, "get_blocks", "get_computed_blocks")
                or _block_pool_methods()
            ),
        ),
        Internal(
            "KVCacheManager.get_computed_blocks / truncate_computed_blocks "
            "(0.24: log_stats)",
            "admission looks up prefix hits without counting them in the "
            "cache's stats; kv_segment_size_buckets cuts hits back to a segment",
            _prefix_lookup_alignable,
        ),
        Internal(
            "Scheduler.__init__ sets current_step, "
            "num_waiting_for_streaming_input, num_lookahead_tokens, "
            "enable_kv_cache_events; KVCacheManager.watermark_blocks",
            "a rerun pass counts one step; admission counts streaming "
            "waiters as running, lookahead slots and vLLM's watermark, and "
            "does no prefix lookup of its own while KV events are on",
            _scheduler_counters,
        ),
        Internal(
            "Scheduler.finished_recving_kv_req_ids (finish_requests frees a "
            "loading request's blocks at once when its id is in it; "
            "_update_from_kv_xfer_finished looks each reported id up)",
            "kv_load_timeout_s fails a lost load and frees its blocks, and "
            "drops the load's late report",
            _load_reports_readable,
        ),
        Internal(
            "SchedulerOutput is a plain dataclass",
            "NeuronSchedulerOutput adopts the parent's output and adds the "
            "padded counts as declared fields",
            _output_adoptable,
        ),
        Internal(
            "GPUModelRunner._determine_batch_execution_and_padding / "
            "_preprocess / _dummy_run",
            "StaticShapeWorker runs each step at its padded shape through "
            "vLLM's CUDA-graph padding path, and runs each bucket at start",
            _model_runner_hooks,
        ),
        Internal(
            "BatchDescriptor.num_tokens",
            "StaticShapeWorker replaces the padded token count",
            _padding_descriptor,
        ),
        Internal(
            "prometheus_client CollectorRegistry._names_to_collectors",
            "a restarted engine in the same process replaces its collector on /metrics",
            lambda: (
                None
                if hasattr(CollectorRegistry(), "_names_to_collectors")
                else "CollectorRegistry lacks _names_to_collectors"
            ),
        ),
    )


def _scheduler_counters() -> str | None:
    problem = _first_unset(
        (Scheduler, "self.current_step"),
        (Scheduler, "self.num_waiting_for_streaming_input"),
        (Scheduler, "self.num_lookahead_tokens"),
        (Scheduler, "self.enable_kv_cache_events"),
        (KVCacheManager, "self.watermark_blocks"),
    )
    if problem is None and "self.current_step += 1" not in _schedule_source():
        return "Scheduler.schedule no longer counts current_step"
    return problem


def _first_unset(*places: tuple[type, str]) -> str | None:
    """What ``_attributes_set`` says of the first ``(owner, attribute)``
    whose ``__init__`` no longer sets it, or ``None``."""
    for owner, attribute in places:
        if problem := _attributes_set(owner, attribute):
            return problem
    return None


def _load_reports_readable() -> str | None:
    problem = _attributes_set(Scheduler, "self.finished_recving_kv_req_ids")
    if problem:
        return problem
    finish = " ".join(inspect.getsource(Scheduler.finish_requests).split())
    if "not in self.finished_recving_kv_req_ids" not in finish:
        return (
            "Scheduler.finish_requests no longer decides on "
            "finished_recving_kv_req_ids when a loading request's blocks are freed"
        )
    update = inspect.getsource(Scheduler._update_from_kv_xfer_finished)  # noqa: SLF001
    if "finished_recving" not in update:
        return (
            "Scheduler._update_from_kv_xfer_finished no longer reads finished_recving"
        )
    return None


def _block_pool_methods() -> str | None:
    from vllm.v1.core.block_pool import BlockPool

    return _method(
        BlockPool, "get_cached_block", ["self", "block_hash", "kv_cache_group_ids"]
    ) or _method(BlockPool, "get_num_free_blocks", ["self"])


def _blocks_held_readable() -> str | None:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    return _first_unset(
        (KVCacheManager, "self.coordinator"),
        (KVCacheCoordinator, "self.single_type_managers"),
        (SingleTypeKVCacheManager, "self.req_to_blocks"),
    )


def check_internals() -> list[str]:
    """``"name: what changed"`` for every internal that is not as expected."""
    problems = []
    for internal in internals():
        problem = internal.check()
        if problem is not None:
            problems.append(f"{internal.name}: {problem}")
    return problems
