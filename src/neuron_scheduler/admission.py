"""Admission rules: when may a waiting request start its prefill?

All rules live here, as pure functions of small value objects, so the
scheduler subclass only gathers facts and applies the verdict.
The contract mirrors ``KVCacheManager.allocate_slots``: a refusal (``None``
means "admit") leaves the request waiting, in order, for a later step.

Two KV rules exist (``KvAdmission``); both guarantee that an admitted request
never needs preemption:

* ``max_model_len`` (the design's): at most as many requests hold KV blocks
  (running, loading KV, waiting with blocks, finished but still sending) as
  the cache holds at ``max_model_len`` tokens each;
* ``reserve``: the blocks already in use, plus the blocks every running
  request can still allocate before it finishes, plus the new request's own
  worst case, fit in the cache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class KvAdmission(enum.Enum):
    """How the KV cache limits admission (``neuron_config["kv_admission"]``)."""

    #: Every request is assumed to grow to ``max_model_len`` tokens.
    MAX_MODEL_LEN = "max_model_len"
    #: Each request reserves the blocks it can ever need:
    #: ``ceil(min(prompt + max_tokens, max_model_len) / block_size)``,
    #: less prefix blocks it shares with running requests.
    RESERVE = "reserve"


class AdmissionRule(enum.Enum):
    """Why a waiting request was not admitted this step."""

    #: The running queue is at ``max_num_seqs`` (or vLLM's active-request cap).
    MAX_NUM_SEQS = "max_num_seqs"
    #: A running request is still in a chunked prefill; it runs alone.
    PREFILL_IN_PROGRESS = "prefill_in_progress"
    #: This step already holds ``max_prefills_per_batch`` new prefills.
    MAX_PREFILLS_PER_BATCH = "max_prefills_per_batch"
    #: A packed prefill step is full: this prompt would overflow the largest
    #: token bucket next to the prompts already packed.
    PACKED_TOKENS = "packed_tokens"
    #: ``max_consecutive_prefill_steps`` reached: this step belongs to the
    #: waiting decodes.
    DECODE_TURN = "decode_turn"
    #: vLLM's data-parallel prefill balancing (``schedule(throttle_prefills=
    #: True)``) defers prefills to protect running decodes this step.
    DP_THROTTLE = "dp_throttle"
    #: vLLM's local prefill cadence (``prefill_schedule_interval`` > 1
    #: without data parallelism, vLLM 0.33) holds prefills while decodes run.
    PREFILL_INTERVAL = "prefill_interval"
    #: Admitting could make a later step need preemption (see ``KvAdmission``).
    KV_CAPACITY = "kv_capacity"


@dataclass(frozen=True)
class AdmissionLimits:
    """Fixed per engine: the caps admission enforces.

    ``max_kv_concurrent`` is used by ``KvAdmission.MAX_MODEL_LEN``,
    ``usable_kv_blocks`` (the block pool less its null block) and
    ``reserved_kv_blocks`` (vLLM's ``watermark``, kept free) by
    ``KvAdmission.RESERVE``; ``max_prefill_tokens`` is the largest prefill
    token bucket (a packed step must fit it).
    """

    max_running: int
    max_prefills_per_batch: int
    max_kv_concurrent: int
    kv_admission: KvAdmission = KvAdmission.MAX_MODEL_LEN
    usable_kv_blocks: int = 0
    reserved_kv_blocks: int = 0
    max_prefill_tokens: int = 0
    #: Requests loading (or holding loaded) KV while waiting take run slots
    #: (``neuron_config["kv_loads_take_slots"]``).
    kv_loads_take_slots: bool = False


@dataclass(frozen=True)
class StepOccupancy:
    """What the step being planned already holds.

    ``num_running`` counts requests in vLLM's run slots, ``num_admitted``
    the requests started from the waiting queues this step, ``num_prefills``
    those of them that are prefill chunks (not prompt ends) and
    ``admitted_tokens`` the tokens they compute (upper bound). ``kv_holders``
    counts every request holding KV blocks (running, loading KV, waiting with
    blocks, finished while its blocks are still being sent), including those
    that became holders this step; ``kv_blocks_committed`` is the blocks in
    use plus every holder's remaining worst-case growth. ``decode_turn`` is
    set when the stall bound gives this step to decodes, ``throttled`` when
    vLLM's data-parallel prefill balancing does, ``interval_hold`` when its
    local prefill cadence does. ``num_loading`` counts the waiting requests
    holding KV blocks (loading from a connector, or loaded and not yet
    running), those whose loads started this step included.
    """

    num_running: int
    num_admitted: int
    prefill_in_progress: bool
    num_prefills: int = 0
    admitted_tokens: int = 0
    kv_holders: int = 0
    kv_blocks_committed: int = 0
    decode_turn: bool = False
    throttled: bool = False
    interval_hold: bool = False
    #: The step's prefill token budget when lower than the largest bucket
    #: (decodes are waiting and ``max_prefill_tokens_with_decodes_waiting``
    #: caps the stall); 0 = no cap.
    prefill_token_cap: int = 0
    num_loading: int = 0


@dataclass(frozen=True)
class Candidate:
    """A waiting request, as admission sees it.

    ``prefill_tokens``: tokens its prefill can compute this step at most
    (cache hits and a later KV load only lower it). ``kv_blocks_needed``:
    free blocks it can consume before it finishes (``reserve`` mode).
    ``holds_kv``: it already holds KV blocks (a finished KV load, a resumed
    request), so it is counted among the holders and its growth among the
    committed blocks already. ``prompt_end``: only its prompt's last token
    is left (a complete KV transfer, a full prefix-cache hit): one query
    token, a decode row, so it joins any step and is no prefill.
    """

    prefill_tokens: int
    kv_blocks_needed: int = 0
    holds_kv: bool = False
    prompt_end: bool = False


def admission_refusal(
    limits: AdmissionLimits, occupancy: StepOccupancy, candidate: Candidate
) -> AdmissionRule | None:
    """The first rule that refuses ``candidate``, or ``None`` to admit it.

    A prompt end is held only by the run-slot and KV rules: it computes one
    decode row, in whatever step it joins.
    """
    prefill = not candidate.prompt_end
    if prefill and occupancy.throttled:
        return AdmissionRule.DP_THROTTLE
    if prefill and occupancy.interval_hold:
        return AdmissionRule.PREFILL_INTERVAL
    if prefill and occupancy.decode_turn:
        return AdmissionRule.DECODE_TURN
    slots_taken = occupancy.num_running + occupancy.num_admitted
    if limits.kv_loads_take_slots and not candidate.holds_kv:
        # A holder is among the loading already: it needs no further slot.
        slots_taken += occupancy.num_loading
    if slots_taken >= limits.max_running:
        return AdmissionRule.MAX_NUM_SEQS
    if prefill:
        if occupancy.prefill_in_progress:
            return AdmissionRule.PREFILL_IN_PROGRESS
        if occupancy.num_prefills >= limits.max_prefills_per_batch:
            return AdmissionRule.MAX_PREFILLS_PER_BATCH
        token_limit = limits.max_prefill_tokens
        if occupancy.prefill_token_cap:
            token_limit = min(token_limit, occupancy.prefill_token_cap)
        if (
            occupancy.num_prefills > 0
            and occupancy.admitted_tokens + candidate.prefill_tokens > token_limit
        ):
            # The first prompt of a step may be chunked by vLLM; packed ones
            # join only whole, so a packed step never splits a follower.
            return AdmissionRule.PACKED_TOKENS
    if limits.kv_admission is KvAdmission.MAX_MODEL_LEN:
        if not candidate.holds_kv and occupancy.kv_holders >= limits.max_kv_concurrent:
            return AdmissionRule.KV_CAPACITY
    elif (
        occupancy.kv_blocks_committed + candidate.kv_blocks_needed
        > limits.usable_kv_blocks - limits.reserved_kv_blocks
    ):
        return AdmissionRule.KV_CAPACITY
    return None


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks holding ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def max_request_len(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """Most tokens a request can ever hold KV for."""
    return min(num_prompt_tokens + max_tokens, max_model_len)


def max_kv_concurrency(
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    vllm_estimate: float | None,
    reserved_blocks: int = 0,
) -> int:
    """How many requests fit in the KV cache at ``max_model_len`` each.

    Uses vLLM's own estimate (``get_max_concurrency_for_kv_cache_config``)
    when available, else ``num_blocks * block_size // max_model_len``.
    Either is capped by the blocks really allocatable: the block pool keeps
    block 0 as its null block, so ``num_blocks - 1`` are usable, less
    ``reserved_blocks`` (vLLM's watermark). 0 when the cache holds no request
    at ``max_model_len``.
    """
    blocks_per_request = blocks_for(max_model_len, block_size)
    usable = (num_blocks - 1 - reserved_blocks) // blocks_per_request
    if vllm_estimate is not None:
        estimate = int(vllm_estimate)
    else:
        estimate = num_blocks * block_size // max_model_len
    return max(0, min(estimate, usable))
