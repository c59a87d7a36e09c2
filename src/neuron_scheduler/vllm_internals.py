"""Every vLLM internal neuron-scheduler relies on, in one place.

vLLM's public scheduler contract (``SchedulerInterface``) says nothing about
how a pass scans its queues, so a scheduler that reshapes what the parent
sees must lean on how vLLM 0.32's ``Scheduler`` is written. Each such
reliance is an ``Internal`` here, with a ``check`` that reads the installed
vLLM and says what changed (``None``: as expected). ``check_internals()``
runs them all; the test suite runs each by name, so an upgrade that breaks
one fails loudly, naming it. The accessors below are the only code that
touches these internals; the hooks the scheduler and worker override are
named here and checked for the signature they rely on.

Public APIs are used wherever they exist and cost no more than the
internal (``pause_state``, ``get_request_counts``, ``get_computed_blocks``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

#: The parent's limits a pass lowers while running requests are hidden; its
#: ``schedule()`` must read them from the instance on every call.
LOWERED_LIMITS = (
    "max_num_running_reqs",
    "max_num_active_reqs",
    "max_num_scheduled_tokens",
)

#: Other state ``Scheduler.schedule()`` reads that the plan depends on.
SCHEDULE_READS = (
    "waiting",
    "kv_holding_waiting",
    "deferred_waiting",
    "prefill_capacity_bound",
    "adaptive_long_prefill_threshold",
    "get_request_counts",
    "_make_cached_request_data",
)

#: The hook where an empty pass is dropped (``NeuronScheduler``): called once
#: the parent's scans are over and before it builds the output.
EMPTY_PASS_HOOK = "_make_cached_request_data"


# --------------------------------------------------------------- accessors


def is_ready_to_schedule(scheduler: Scheduler, request: Request) -> bool:
    """False for a waiting request in a blocked state that is still blocked
    (the parent passes it over); promotes one whose wait is over, as the
    parent does (idempotent)."""
    return not scheduler._is_blocked_waiting_status(  # noqa: SLF001
        request.status
    ) or scheduler._handle_blocked_waiting_request(request)  # noqa: SLF001


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


def _read_by_schedule(*names: str) -> str | None:
    source = _schedule_source()
    missing = [n for n in names if f"self.{n}" not in source]
    return f"Scheduler.schedule no longer reads {missing}" if missing else None


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


def internals() -> tuple[Internal, ...]:
    """Every vLLM internal the package relies on (see the module docstring)."""
    return (
        Internal(
            "Scheduler._is_blocked_waiting_status / _handle_blocked_waiting_request",
            "admission passes over a blocked waiting request as the parent "
            "does (grammar compiling, KV loading, streaming input)",
            lambda: (
                _method(
                    Scheduler, "_handle_blocked_waiting_request", ["self", "request"]
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
            "Scheduler.schedule reads " + ", ".join(LOWERED_LIMITS),
            "decodes hidden during a prefill pass: the parent's running "
            "limits and token budget are lowered to match",
            lambda: _read_by_schedule(*LOWERED_LIMITS),
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


def _block_pool_methods() -> str | None:
    from vllm.v1.core.block_pool import BlockPool

    return _method(
        BlockPool, "get_cached_block", ["self", "block_hash", "kv_cache_group_ids"]
    ) or _method(BlockPool, "get_num_free_blocks", ["self"])


def _blocks_held_readable() -> str | None:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    for owner, attribute in (
        (KVCacheManager, "self.coordinator"),
        (KVCacheCoordinator, "self.single_type_managers"),
        (SingleTypeKVCacheManager, "self.req_to_blocks"),
    ):
        # An assignment, annotated or not: "self.x =" or "self.x: T = ".
        assigned = rf"{re.escape(attribute)}\s*(:[^=\n]*)?="
        if not re.search(assigned, inspect.getsource(owner.__init__)):
            return f"{owner.__name__}.__init__ no longer sets {attribute}"
    return None


def check_internals() -> list[str]:
    """``"name: what changed"`` for every internal that is not as expected."""
    problems = []
    for internal in internals():
        problem = internal.check()
        if problem is not None:
            problems.append(f"{internal.name}: {problem}")
    return problems
