"""Admission rules: when may a waiting request start its prefill?

All rules live here, as pure functions of small value objects, so the
scheduler subclass only gathers facts and applies the verdict.
The contract mirrors ``KVCacheManager.allocate_slots``: a refusal (``None``
means "admit") leaves the request waiting, in order, for a later step.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class AdmissionRule(enum.Enum):
    """Why a waiting request was not admitted this step."""

    #: The running queue is at ``max_num_seqs`` (or vLLM's active-request cap).
    MAX_NUM_SEQS = "max_num_seqs"
    #: A running request is still in a chunked prefill; it runs alone.
    PREFILL_IN_PROGRESS = "prefill_in_progress"
    #: This step already holds ``max_prefills_per_batch`` new prefills.
    MAX_PREFILLS_PER_BATCH = "max_prefills_per_batch"
    #: Admitting would exceed the requests the KV cache holds at
    #: ``max_model_len`` each, so a later step might need preemption.
    KV_CAPACITY = "kv_capacity"


@dataclass(frozen=True)
class AdmissionLimits:
    """Fixed per engine: the caps admission enforces."""

    max_running: int
    max_prefills_per_batch: int
    max_kv_concurrent: int


@dataclass(frozen=True)
class StepOccupancy:
    """What the step being planned already holds."""

    num_running: int
    num_admitted: int
    prefill_in_progress: bool


def admission_refusal(
    limits: AdmissionLimits, occupancy: StepOccupancy
) -> AdmissionRule | None:
    """The first rule that refuses one more admission, or ``None`` to admit."""
    total = occupancy.num_running + occupancy.num_admitted
    if total >= limits.max_running:
        return AdmissionRule.MAX_NUM_SEQS
    if occupancy.prefill_in_progress:
        return AdmissionRule.PREFILL_IN_PROGRESS
    if occupancy.num_admitted >= limits.max_prefills_per_batch:
        return AdmissionRule.MAX_PREFILLS_PER_BATCH
    if total >= limits.max_kv_concurrent:
        return AdmissionRule.KV_CAPACITY
    return None


def max_kv_concurrency(
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    vllm_estimate: float | None,
) -> int:
    """How many requests fit in the KV cache at ``max_model_len`` each.

    Uses vLLM's own estimate (``get_max_concurrency_for_kv_cache_config``)
    when available, else ``num_blocks * block_size // max_model_len``. Either
    is capped by the blocks really allocatable: the block pool keeps block 0
    as its null block, so ``num_blocks - 1`` are usable. Falls back to
    ``max_num_seqs`` when the result would be 0 (a cache smaller than one
    full-length request: admission then relies on vLLM's own allocation
    check and requests that cannot fit are rejected by vLLM).
    """
    blocks_per_request = math.ceil(max_model_len / block_size)
    usable = (num_blocks - 1) // blocks_per_request
    if vllm_estimate is not None:
        estimate = int(vllm_estimate)
    else:
        estimate = num_blocks * block_size // max_model_len
    concurrency = min(estimate, usable)
    return concurrency if concurrency > 0 else max_num_seqs
