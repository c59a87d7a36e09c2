"""``NeuronScheduler``: vLLM's v1 ``Scheduler`` made safe for static shapes.

The subclass is thin: it reshapes the queues the parent sees for one step,
lets the parent schedule, restores the queues, then describes and pads the
step. Admission rules live in ``admission``, bucket math in ``buckets``,
step classification in ``step``.

Contract of one ``schedule()`` call:

* waiting requests (``waiting`` and ``kv_holding_waiting``) are moved to a
  holdback queue; only those that pass admission are restored, in queue
  order, stopping at the first refusal;
* a step is either prefill or decode, never both: while a prefill runs the
  running decodes are hidden from the parent, and the parent's running
  limits are lowered by the number hidden;
* everything is restored in ``finally``: an exception in the parent loses no
  request and leaves no limit changed;
* the output carries ``num_scheduled_tokens_padded`` (request id -> padded
  count) and ``num_seqs_padded``; ``num_scheduled_tokens`` stays the actual
  count that drives vLLM's token accounting;
* a step that mixes prefill and decode raises ``RuntimeError``
  (``MixedBatchError``).

Options (``neuron_config``, see ``config``): ``kv_admission="reserve"``
admits by each request's worst-case KV blocks; ``max_prefills_per_batch``
packs prompts into one prefill step; ``max_consecutive_prefill_steps`` gives
waiting decodes a turn (hiding running prefills instead);
``max_prefill_tokens_with_decodes_waiting`` lowers the parent's token budget
while decodes wait; ``decode_context_length_buckets`` pads decode contexts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vllm import envs
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import RequestQueue, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from neuron_scheduler.admission import (
    AdmissionLimits,
    Candidate,
    KvAdmission,
    StepOccupancy,
    admission_refusal,
    blocks_for,
    max_kv_concurrency,
    max_request_len,
)
from neuron_scheduler.config import NEURON_CONFIG_KEY, EngineLimits, NeuronConfig
from neuron_scheduler.metrics import SchedulerMetrics
from neuron_scheduler.stat_logger import snapshot_path, write_snapshot
from neuron_scheduler.step import (
    SchedulerState,
    StepKind,
    StepRecord,
    describe_step,
    scheduled_requests,
)

# Under the "vllm" logger so vLLM's handlers and levels apply.
logger = init_logger(f"vllm.{__name__}")


class NeuronScheduler(Scheduler):
    """vLLM v1 scheduler for static-shape accelerators (see module docstring).

    Readable state: ``state`` (``SchedulerState`` of the last step),
    ``last_step`` (its ``StepRecord``), ``metrics`` (``SchedulerMetrics``:
    padding per bucket, time per state, refusals per ``AdmissionRule``),
    ``neuron_config`` and ``admission_limits``. ``step_listeners`` receive
    every ``StepRecord``. With vLLM's stats on (``log_stats``) the metrics
    are logged every ``VLLM_LOG_STATS_INTERVAL`` seconds and published for
    ``/metrics`` (see ``stat_logger``).
    """

    #: Seconds between metric snapshots published for Prometheus.
    SNAPSHOT_INTERVAL_S = 1.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.neuron_config = NeuronConfig.from_dict(
            _raw_neuron_config(self.vllm_config.additional_config),
            EngineLimits(
                max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                max_num_seqs=self.scheduler_config.max_num_seqs,
            ),
        )
        if (
            self.neuron_config.kv_admission is KvAdmission.RESERVE
            and len(self.kv_cache_config.kv_cache_groups) != 1
        ):
            raise ValueError(
                "neuron_config['kv_admission'] = 'reserve' needs one KV cache group "
                f"(full attention), this model has "
                f"{len(self.kv_cache_config.kv_cache_groups)}"
            )
        self.admission_limits = AdmissionLimits(
            max_running=min(self.max_num_running_reqs, self.max_num_active_reqs),
            max_prefills_per_batch=self.neuron_config.max_prefills_per_batch,
            max_kv_concurrent=self._max_kv_concurrent(),
            kv_admission=self.neuron_config.kv_admission,
            # Block 0 is the block pool's null block.
            usable_kv_blocks=self.kv_cache_config.num_blocks - 1,
            max_prefill_tokens=self.neuron_config.num_batched_tokens_buckets[-1],
        )
        if (
            self.neuron_config.max_prefill_tokens_with_decodes_waiting is not None
            and not self.scheduler_config.enable_chunked_prefill
        ):
            raise ValueError(
                "neuron_config['max_prefill_tokens_with_decodes_waiting'] needs "
                "chunked prefill (enable_chunked_prefill=True): without it a "
                "longer prompt could never be scheduled while decodes run"
            )
        # Blocks per request id of the (single) KV cache group.
        managers = self.kv_cache_manager.coordinator.single_type_managers
        self._req_to_blocks = managers[0].req_to_blocks if managers else {}
        #: Prefill steps in a row while decodes waited (the stall bound's count).
        self.prefill_streak = 0
        self.state = SchedulerState.IDLE
        self.last_step: StepRecord | None = None
        self.metrics = SchedulerMetrics()
        self._snapshot_path = (
            snapshot_path(
                self.vllm_config, self.vllm_config.parallel_config.data_parallel_rank
            )
            if self.log_stats
            else None
        )
        self._last_snapshot = self._last_log = time.monotonic()
        #: Called with each step's ``StepRecord`` (demo logs, metrics).
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        logger.info(
            "NeuronScheduler: token buckets %s, batch buckets %s, "
            "max %d requests in KV at max_model_len=%d",
            list(self.neuron_config.num_batched_tokens_buckets),
            list(self.neuron_config.num_seqs_buckets),
            self.admission_limits.max_kv_concurrent,
            self.max_model_len,
        )

    # ------------------------------------------------------------------ hooks

    def _call_base_schedule(self, throttle_prefills: bool) -> SchedulerOutput:
        """Run the parent's scheduling pass on the reshaped queues."""
        return super().schedule(throttle_prefills)

    # --------------------------------------------------------------- schedule

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        held_waiting = self.waiting
        held_kv_holding = self.kv_holding_waiting
        self.waiting = create_request_queue(self.policy)
        self.kv_holding_waiting = create_request_queue(self.policy)
        saved_limits = (
            self.max_num_running_reqs,
            self.max_num_active_reqs,
            self.max_num_scheduled_tokens,
        )
        all_running = self.running
        hidden: list[Request] = []
        try:
            running_prefills = [
                r for r in all_running if r.num_computed_tokens < r.num_prompt_tokens
            ]
            has_decodes = len(running_prefills) < len(all_running)
            bound = self.neuron_config.max_consecutive_prefill_steps
            decode_turn = (
                bound is not None and has_decodes and self.prefill_streak >= bound
            )
            token_cap = self.neuron_config.max_prefill_tokens_with_decodes_waiting or 0
            if not has_decodes or decode_turn:
                token_cap = 0
            self._admit(
                held_kv_holding,
                held_waiting,
                bool(running_prefills),
                decode_turn,
                token_cap,
            )
            hidden = self._hide(running_prefills, decode_turn)
            if token_cap and hidden:
                # Decodes wait behind this prefill step: keep the stall short.
                self.max_num_scheduled_tokens = min(
                    self.max_num_scheduled_tokens, token_cap
                )
            self.max_num_running_reqs -= len(hidden)
            self.max_num_active_reqs -= len(hidden)
            output = self._call_base_schedule(throttle_prefills)
        finally:
            (
                self.max_num_running_reqs,
                self.max_num_active_reqs,
                self.max_num_scheduled_tokens,
            ) = saved_limits
            if hidden:
                self.running = _restore_running(all_running, hidden, self.running)
            self.waiting = _merge_back(self.waiting, held_waiting)
            self.kv_holding_waiting = _merge_back(
                self.kv_holding_waiting, held_kv_holding
            )
        record = self._record_step(output)
        if record.kind is StepKind.PREFILL and has_decodes:
            self.prefill_streak += 1
        elif record.kind is not StepKind.EMPTY or not has_decodes:
            self.prefill_streak = 0
        return output

    # ---------------------------------------------------------------- helpers

    def _candidate(self, request: Request, holds_blocks: bool) -> Candidate:
        """``request`` as admission sees it: its worst-case KV growth only
        under ``reserve``, and only if it holds no blocks yet (a holder's
        blocks and growth are already in the committed count)."""
        prefill_tokens = request.num_tokens - request.num_computed_tokens
        if (
            holds_blocks
            or self.admission_limits.kv_admission is not KvAdmission.RESERVE
        ):
            return Candidate(prefill_tokens)
        return Candidate(prefill_tokens, self._kv_growth(request, new=True))

    def _kv_growth(self, request: Request, new: bool = False) -> int:
        """Blocks ``request`` can still take from the free pool before it
        finishes. A ``new`` request holds none yet but reuses the cached
        prefix blocks that running requests hold (those are already in use)."""
        need = blocks_for(
            max_request_len(
                request.num_prompt_tokens, request.max_tokens, self.max_model_len
            ),
            self.block_size,
        )
        if not new:
            return max(0, need - len(self._req_to_blocks.get(request.request_id, ())))
        if self.cache_config.enable_prefix_caching and request.block_hashes:
            pool = self.kv_cache_manager.block_pool
            max_hits = (request.num_tokens - 1) // self.block_size
            for block_hash in request.block_hashes[:max_hits]:
                cached = pool.get_cached_block(block_hash, [0])
                if cached is None or cached[0].ref_cnt == 0:
                    break
                need -= 1
        # A cache smaller than one request's worst case (only possible below
        # vLLM's own start-up check) would otherwise never admit it.
        return min(need, self.admission_limits.usable_kv_blocks)

    def _kv_blocks_committed(self, held_kv_holding: RequestQueue) -> int:
        """Blocks in use now plus what every block holder can still grow by."""
        if self.admission_limits.kv_admission is not KvAdmission.RESERVE:
            return 0
        pool = self.kv_cache_manager.block_pool
        used = self.admission_limits.usable_kv_blocks - pool.get_num_free_blocks()
        growth = sum(self._kv_growth(r) for r in self.running)
        growth += sum(self._kv_growth(r) for r in held_kv_holding)
        return used + growth

    def _admit(
        self,
        held_kv_holding: RequestQueue,
        held_waiting: RequestQueue,
        prefill_in_progress: bool,
        decode_turn: bool,
        prefill_token_cap: int,
    ) -> None:
        """Restore admissible requests from the holdback queues, in order.

        Requests holding KV blocks go first, as in the parent. A request in a
        blocked state (grammar compiling, remote KV loading) that is not ready
        keeps its place and is passed over, as vLLM itself passes it over;
        the first capacity refusal ends admission for this step.
        """
        if self._pause_state == PauseState.PAUSED_ALL:
            return
        sources = [(held_kv_holding, self.kv_holding_waiting)]
        if self._pause_state == PauseState.UNPAUSED:
            sources.append((held_waiting, self.waiting))
        if not (held_kv_holding or (len(sources) > 1 and held_waiting)):
            return
        occupancy = StepOccupancy(
            num_running=len(self.running) + self.num_waiting_for_streaming_input,
            num_admitted=0,
            prefill_in_progress=prefill_in_progress,
            kv_blocks_committed=self._kv_blocks_committed(held_kv_holding),
            decode_turn=decode_turn,
            prefill_token_cap=prefill_token_cap,
        )
        for held, restored in sources:
            passed_over: list[Request] = []
            refused = False
            while held:
                request = held.peek_request()
                if self._is_blocked_waiting_status(
                    request.status
                ) and not self._handle_blocked_waiting_request(request):
                    passed_over.append(held.pop_request())
                    continue
                candidate = self._candidate(
                    request, holds_blocks=restored is self.kv_holding_waiting
                )
                refusal = admission_refusal(self.admission_limits, occupancy, candidate)
                if refusal is not None:
                    self.metrics.refusals[refusal] += 1
                    refused = True
                    break
                restored.add_request(held.pop_request())
                occupancy = replace(
                    occupancy,
                    num_admitted=occupancy.num_admitted + 1,
                    admitted_tokens=occupancy.admitted_tokens
                    + candidate.prefill_tokens,
                    kv_blocks_committed=occupancy.kv_blocks_committed
                    + candidate.kv_blocks_needed,
                )
            if passed_over:
                held.prepend_requests(reversed(passed_over))
            if refused:
                return

    def _hide(
        self, running_prefills: list[Request], decode_turn: bool
    ) -> list[Request]:
        """Leave the parent one kind of work; return the running requests
        hidden from it. On a decode turn the running prefills are hidden;
        otherwise decodes are hidden while any prefill can run."""
        if decode_turn or running_prefills:
            if not running_prefills or len(running_prefills) == len(self.running):
                return []
            prefill_set = set(running_prefills)
            decodes = [r for r in self.running if r not in prefill_set]
            if decode_turn:
                self.running = decodes
                return running_prefills
            self.running = running_prefills
            return decodes
        if self.waiting or self.kv_holding_waiting:
            hidden = self.running
            self.running = []
            return hidden
        return []

    def _record_step(self, output: SchedulerOutput) -> StepRecord:
        requests = self.requests
        config = self.neuron_config
        record = describe_step(
            scheduled_requests(output, lambda rid: requests[rid].num_prompt_tokens),
            config.num_batched_tokens_buckets,
            config.num_seqs_buckets,
            config.decode_context_length_buckets,
        )
        output.num_scheduled_tokens_padded = dict(record.padded_tokens)  # type: ignore[attr-defined]
        output.total_num_scheduled_tokens_padded = record.total_padded  # type: ignore[attr-defined]
        output.num_seqs_padded = record.num_seqs_padded  # type: ignore[attr-defined]
        output.decode_context_len_padded = (  # type: ignore[attr-defined]
            record.context_len_padded if record.kind is StepKind.DECODE else None
        )
        now = time.monotonic()
        self.metrics.add(record, now)
        if self._snapshot_path is not None:
            # Publish on the interval, and always when the engine goes idle
            # (it stops calling schedule(): the last numbers must be out).
            idle = record.kind is StepKind.EMPTY and not self.has_unfinished_requests()
            self._publish_metrics(now, force=idle)
        self.state = record.state
        self.last_step = record
        for listener in self.step_listeners:
            listener(record)
        logger.debug("NeuronScheduler step: %s", record.summary())
        return record

    def _publish_metrics(self, now: float, force: bool) -> None:
        if force or now - self._last_snapshot >= self.SNAPSHOT_INTERVAL_S:
            self._last_snapshot = now
            assert self._snapshot_path is not None
            write_snapshot(self._snapshot_path, self.metrics.snapshot())
        if now - self._last_log >= envs.VLLM_LOG_STATS_INTERVAL:
            self._last_log = now
            logger.info("NeuronScheduler: %s", self.metrics.log_line())

    def shutdown(self) -> None:
        if self._snapshot_path is not None:
            self._snapshot_path.unlink(missing_ok=True)
        super().shutdown()

    def _max_kv_concurrent(self) -> int:
        try:
            estimate: float | None = get_max_concurrency_for_kv_cache_config(
                self.vllm_config, self.kv_cache_config
            )
        except Exception:  # noqa: BLE001 - exotic KV specs: use the plain formula
            estimate = None
        return max_kv_concurrency(
            num_blocks=self.kv_cache_config.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.scheduler_config.max_num_seqs,
            vllm_estimate=estimate,
        )


def _restore_running(
    before: list[Request], hidden: list[Request], visible_after: list[Request]
) -> list[Request]:
    """The running list after a step that hid ``hidden``: the requests of
    ``before`` still running, in their old order, then those the parent
    added."""
    if not visible_after:
        return hidden
    kept = set(visible_after)
    kept.update(hidden)
    restored = [r for r in before if r in kept]
    if len(restored) < len(kept):
        seen = set(before)
        restored.extend(r for r in visible_after if r not in seen)
    return restored


def _merge_back(leftover: RequestQueue, held: RequestQueue) -> RequestQueue:
    """Put requests the parent left unscheduled back in front of the held
    queue, keeping their order, and return the combined queue."""
    if leftover:
        held.prepend_requests(reversed(list(leftover)))
    return held


def _raw_neuron_config(additional_config: object) -> object:
    if additional_config is None:
        return {}
    if not isinstance(additional_config, dict):
        get = getattr(additional_config, "get", None)
        return get(NEURON_CONFIG_KEY, {}) if callable(get) else {}
    return additional_config.get(NEURON_CONFIG_KEY, {})
