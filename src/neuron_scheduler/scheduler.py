"""``NeuronScheduler``: vLLM's v1 ``Scheduler`` made safe for static shapes.

The subclass is thin: it decides which kind of work the parent sees in a
step, lets the parent schedule, restores what it changed, then describes and
pads the step. Admission rules live in ``admission``, their application
inside the parent's scan in ``gate``, bucket math in ``buckets``, step
classification in ``step``.

Contract of one ``schedule()`` call:

* waiting requests stay in the parent's waiting queues (``waiting`` and
  ``kv_holding_waiting``; before vLLM 0.31 ``skipped_waiting``); the parent
  scans them through an ``AdmissionGate`` that shows it a request only while
  admission accepts it, in queue order, stopping at the first refusal.
  Starting an async KV load is not a prefill: a burst of remote-KV arrivals
  starts all its loads in one step (within the KV rule);
* a step is either prefill or decode, never both: for a prefill the running
  decodes are hidden from the parent (its running limits lowered to match);
  if the parent then computes nothing (a KV load started, a connector lookup
  not ready, an allocation failed), that pass is dropped before it builds
  any output and the step runs the decodes instead, so no step is empty
  while decodes wait;
* admission counts every request that holds or is loading KV blocks;
  vLLM's long-prefill threshold and data-parallel prefill throttle see the
  true queues (the throttle gives the step to the decodes);
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
while decodes wait; ``decode_context_length_buckets`` pads decode contexts;
``decode_split_break_even_positions`` splits a decode batch in two by
context where that reads less KV (``decode_groups``); ``kv_load_timeout_s``
fails a request whose KV load is never reported (``kv_load_timeout``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_scheduler.vllm_compat import check_vllm_version

# Before any vLLM internal is imported: another vLLM fails here, by name.
check_vllm_version()

from vllm import envs
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from neuron_scheduler.admission import (
    AdmissionLimits,
    AdmissionRule,
    Candidate,
    KvAdmission,
    StepOccupancy,
    blocks_for,
    max_kv_concurrency,
    max_request_len,
)
from neuron_scheduler.config import NEURON_CONFIG_KEY, EngineLimits, NeuronConfig
from neuron_scheduler.decode_groups import shorter_group_size
from neuron_scheduler.gate import AdmissionGate, GateGroup, StepAdmission
from neuron_scheduler.kv_load_timeout import KvLoadWatch
from neuron_scheduler.metrics import SchedulerMetrics
from neuron_scheduler.output import NeuronSchedulerOutput
from neuron_scheduler.snapshots import remove_stale, snapshot_path, write_snapshot
from neuron_scheduler.step import (
    LargestBucketOnly,
    SchedulerState,
    StepKind,
    StepRecord,
    describe_output,
    scheduled_requests,
)
from neuron_scheduler.step_log import StepLog
from neuron_scheduler.vllm_internals import (
    align_prefix_hits,
    blocks_held,
    count_load_received,
    holds_kv_blocks,
    is_ready_to_schedule,
    kv_events_enabled,
    loading_requests,
    lookahead_tokens,
    lowered_limits,
    mark_deferred,
    max_active_requests,
    num_free_blocks,
    prefill_interval_holds,
    prefix_block_in_use,
    prefix_hit_tokens,
    scheduler_features,
    undo_step_count,
    waiting_for_streaming_input,
    watermark_blocks,
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
    #: The KV loads under way and since when (``kv_load_timeout_s``; set in
    #: ``__init__``, ``None`` here for an instance built without it, as
    #: vLLM's own tests build some).
    kv_load_watch: KvLoadWatch | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: Running requests hidden from the parent during a pass.
        self._hidden: list[Request] = []
        #: Whether the pass under way is dropped if it schedules nothing.
        self._abandon_if_empty = False
        #: How the installed vLLM's scheduler does what differs by version.
        self._features = scheduler_features()
        self._lowered_limits = lowered_limits()
        super().__init__(*args, **kwargs)
        self.neuron_config = NeuronConfig.from_dict(
            _raw_neuron_config(self.vllm_config.additional_config),
            EngineLimits(
                max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                max_num_seqs=self.scheduler_config.max_num_seqs,
                block_size=self.block_size,
            ),
        )
        #: Prompt tokens left at which a request still runs as a decode row.
        self._prompt_end_slack = self.neuron_config.prompt_end_slack
        if self.neuron_config.kv_segment_size is not None:
            self._align_to_segments(self.neuron_config.kv_segment_size)
        self.admission_limits = self._admission_limits()
        if (
            self.neuron_config.max_prefill_tokens_with_decodes_waiting is not None
            and not self.scheduler_config.enable_chunked_prefill
        ):
            raise ValueError(
                "neuron_config['max_prefill_tokens_with_decodes_waiting'] needs "
                "chunked prefill (enable_chunked_prefill=True): without it a "
                "longer prompt could never be scheduled while decodes run"
            )
        speculative = self.vllm_config.speculative_config
        #: Input slots vLLM takes per scheduled request for parallel drafting.
        self._draft_slots = (
            speculative.max_num_new_slots_for_drafting if speculative else 0
        )
        #: The parent takes the better head of its waiting queues (0.29, 0.30).
        self._by_priority = (
            self._features.picks_across_queues
            and self.policy == SchedulingPolicy.PRIORITY
        )
        #: Prefill steps in a row while decodes waited (the stall bound's count).
        self.prefill_streak = 0
        #: Ids decoded in the decode cycle under way (``decode_groups``).
        self._decoded_in_cycle: frozenset[str] = frozenset()
        self.state = SchedulerState.IDLE
        self.last_step: StepRecord | None = None
        config = self.neuron_config
        self.metrics = SchedulerMetrics(
            largest_only=LargestBucketOnly.of(
                config.num_batched_tokens_buckets,
                config.num_seqs_buckets,
                config.decode_context_length_buckets,
            )
        )
        self._snapshot_path: Path | None = None
        if self.log_stats:
            # The DP index, not the rank: vLLM resets each dense-model DP
            # rank to 0 (independent engines), the index keeps it.
            engine = self.vllm_config.parallel_config.data_parallel_index
            self._snapshot_path = snapshot_path(self.vllm_config, engine)
            remove_stale(self._snapshot_path.parent)
        self._last_snapshot = self._last_log = time.monotonic()
        #: Called with each step's ``StepRecord`` (demo logs, metrics).
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        #: Each step's shape and start time, if the environment asks for it.
        self._step_log = StepLog.from_environment()
        if self.neuron_config.kv_load_timeout_s is not None:
            self.kv_load_watch = KvLoadWatch(self.neuron_config.kv_load_timeout_s)
        logger.info(
            "NeuronScheduler: token buckets %s, batch buckets %s, "
            "max %d requests in KV at max_model_len=%d",
            list(self.neuron_config.num_batched_tokens_buckets),
            list(self.neuron_config.num_seqs_buckets),
            self.admission_limits.max_kv_concurrent,
            self.max_model_len,
        )

    def _admission_limits(self) -> AdmissionLimits:
        """What admission enforces: ``neuron_config``'s rule over this KV
        cache (``max_model_len`` falls back to ``reserve`` when the cache
        holds no request at ``max_model_len``), vLLM's running cap and
        watermark, the largest prefill."""
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        kv_admission = self.neuron_config.kv_admission
        if kv_admission is KvAdmission.RESERVE and num_groups != 1:
            raise ValueError(
                "neuron_config['kv_admission'] = 'reserve' needs one KV cache group "
                f"(full attention), this model has {num_groups}"
            )
        max_kv_concurrent = self._max_kv_concurrent()
        if max_kv_concurrent == 0 and kv_admission is KvAdmission.MAX_MODEL_LEN:
            # The cache holds no request at max_model_len (vLLM's engine
            # refuses such a cache at start; offline schedulers can have one).
            if num_groups == 1:
                kv_admission = KvAdmission.RESERVE
                logger.warning(
                    "NeuronScheduler: the KV cache (%d blocks) holds no request "
                    "at max_model_len=%d; admitting by each request's own "
                    "worst case (kv_admission='reserve') so none needs preemption",
                    self.kv_cache_config.num_blocks,
                    self.max_model_len,
                )
            else:
                max_kv_concurrent = self.scheduler_config.max_num_seqs
                logger.warning(
                    "NeuronScheduler: the KV cache (%d blocks) holds no request "
                    "at max_model_len=%d and this model has %d KV cache groups: "
                    "admission is bounded by max_num_seqs only and vLLM may "
                    "have to preempt",
                    self.kv_cache_config.num_blocks,
                    self.max_model_len,
                    num_groups,
                )
        return AdmissionLimits(
            max_running=max_active_requests(self),
            max_prefills_per_batch=self.neuron_config.max_prefills_per_batch,
            max_kv_concurrent=max_kv_concurrent,
            kv_admission=kv_admission,
            # Block 0 is the block pool's null block.
            usable_kv_blocks=self.kv_cache_config.num_blocks - 1,
            # vLLM applies its watermark only while something runs, which a
            # prefill pass with hidden decodes hides: admission keeps it.
            reserved_kv_blocks=watermark_blocks(self.kv_cache_manager),
            max_prefill_tokens=self.neuron_config.num_batched_tokens_buckets[-1],
            kv_loads_take_slots=self.neuron_config.kv_loads_take_slots,
        )

    # ------------------------------------------------------------------ hooks

    def _call_base_schedule(self, throttle_prefills: bool) -> SchedulerOutput:
        """Run the parent's scheduling pass on the queues as reshaped."""
        return super().schedule(throttle_prefills)

    # --------------------------------------------------------------- schedule

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        started = time.monotonic()
        counts = self.get_request_counts() if self._step_log is not None else (0, 0)
        plan = self._plan(throttle_prefills)
        try:
            output = self._run_pass(plan, throttle_prefills)
        except _NothingScheduled:
            # The parent computed nothing for the kind planned (it started a
            # KV load instead, a connector lookup deferred, an allocation
            # failed, ...): the step goes to the requests it hid.
            undo_step_count(self)
            assert plan.fallback is not None
            plan = plan.fallback
            output = self._run_pass(plan, throttle_prefills)
        if plan.decode_cycle is not None:
            self._decoded_in_cycle = plan.decode_cycle
        record = self._record_step(output)
        if self._step_log is not None:
            step = scheduled_requests(
                output, lambda rid: self.requests[rid].num_prompt_tokens
            )
            self._step_log.write(started, counts, record, step)
        if record.kind is StepKind.PREFILL and plan.has_decodes:
            self.prefill_streak += 1
        elif record.kind is not StepKind.EMPTY or not plan.has_decodes:
            self.prefill_streak = 0
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """The parent's update; with ``kv_load_timeout_s``, late reports of
        loads given up on are dropped first, and loads past the timeout
        fail after it (their outputs added to the parent's)."""
        watch = self.kv_load_watch
        if watch is not None and model_runner_output.kv_connector_output:
            dropped = watch.drop_late_reports(model_runner_output.kv_connector_output)
            if dropped:
                logger.warning(
                    "NeuronScheduler: dropped the late KV load report of %s "
                    "(failed by kv_load_timeout_s)", sorted(dropped)
                )  # fmt: skip
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if watch is not None:
            self._fail_lost_loads(watch, outputs)
        return outputs

    def _fail_lost_loads(
        self, watch: KvLoadWatch, outputs: dict[int, EngineCoreOutputs]
    ) -> None:
        """Fail the requests loading for ``kv_load_timeout_s`` or more, their
        blocks freed at once, each with an error output for its client."""
        expired = watch.expired(loading_requests(self))
        if not expired:
            return
        logger.error(
            "NeuronScheduler: failing %d request(s) whose KV load was not "
            "reported within kv_load_timeout_s=%s: %s",
            len(expired), watch.timeout_s, expired,
        )  # fmt: skip
        failed = [self.requests[request_id] for request_id in expired]
        for request_id in expired:
            count_load_received(self, request_id)
        # What finish_requests returns differs (0.24: ids and clients).
        self.finish_requests(expired, RequestStatus.FINISHED_ERROR)
        for request in failed:
            client = outputs.setdefault(request.client_index, EngineCoreOutputs())
            client.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                )
            )

    def get_request_counts(self) -> tuple[int, int]:
        """``(running, waiting)``; during a pass, requests hidden from the
        parent still count as running (vLLM's long-prefill threshold and
        data-parallel throttle are decided on these counts)."""
        num_running, num_waiting = super().get_request_counts()
        return num_running + len(self._hidden), num_waiting

    def _make_cached_request_data(self, *args: Any, **kwargs: Any) -> Any:
        # EMPTY_PASS_HOOK (vllm_internals): the parent calls it once its
        # scans are over and before it builds the output or drains any
        # per-step state (connector metadata, freed ids): the last moment at
        # which a pass can be dropped as if it had not run, apart from KV
        # loads it started and requests it passed over.
        if self._abandon_if_empty and not args[2]:  # num_scheduled_tokens
            raise _NothingScheduled
        return super()._make_cached_request_data(*args, **kwargs)

    # ---------------------------------------------------------------- helpers

    def _plan(self, throttle_prefills: bool) -> StepPlan:
        """Decide which kind of work the parent sees this step.

        A prefill step when a chunked prefill runs, or when the first ready
        waiting request is a prefill that admission accepts (decodes hidden);
        otherwise a decode step, which only prompt ends may join. On a decode
        turn (the stall bound, or vLLM's DP throttle while decodes run) the
        running prefills are hidden. With nothing running, the waiting
        requests decide (a prefill step takes prompt ends too).
        """
        running = self.running
        # A request with only its last prompt token left runs as a decode row
        # (unless strict_prefill: then _prompt_end_slack is 0).
        slack = self._prompt_end_slack
        running_prefills = [
            r for r in running if r.num_computed_tokens < r.num_prompt_tokens - slack
        ]
        has_decodes = len(running_prefills) < len(running)
        # vLLM's DP prefill balancing, decided as the parent would on the
        # whole running queue.
        throttled = (
            has_decodes and throttle_prefills and not self.prefill_capacity_bound
        )
        # vLLM 0.33's local cadence holds prefills as its DP throttle does.
        interval_hold = (
            has_decodes
            and not throttled
            and self._features.local_prefill_interval
            and prefill_interval_holds(self)
        )
        bound = self.neuron_config.max_consecutive_prefill_steps
        stall_turn = has_decodes and bound is not None and self.prefill_streak >= bound
        held = throttled or interval_hold
        token_cap = 0
        if has_decodes and not (held or stall_turn):
            token_cap = self.neuron_config.max_prefill_tokens_with_decodes_waiting or 0
        admission = self._step_admission(
            bool(running_prefills), stall_turn, throttled, interval_hold, token_cap
        )
        if not running:
            return StepPlan(False, [], admission)
        queues = self._admission_queues()
        if held or stall_turn:
            if admission is not None:
                admission.decode_only = True
                first = admission.first_ready(queues, self._by_priority)
                if first is not None:
                    admission.allows(*first)  # counts the turn's refusal
            # A stall turn the decodes cannot use goes back to the prefills;
            # under the DP throttle or the cadence they wait, as in vLLM.
            back = None
            if stall_turn and not held and running_prefills:
                back = StepPlan(True, _others(running, running_prefills), None)
            return StepPlan(True, running_prefills, admission, True, 0, back)
        if running_prefills:
            decodes = _others(running, running_prefills)
            decode_step = StepPlan(True, running_prefills, admission, True)
            return StepPlan(
                True,
                decodes,
                admission,
                token_cap=token_cap,
                fallback=decode_step if decodes else None,
            )
        # Every running request is a decode from here on.
        decode_step = self._decode_plan(running, admission)
        first = None
        if admission is not None:
            first = admission.first_ready(queues, self._by_priority)
        if admission is None or first is None:
            return decode_step
        if admission.candidate(*first).prompt_end:
            return decode_step  # it joins the decodes
        if not admission.allows(*first):
            return decode_step
        return StepPlan(True, list(running), admission, False, token_cap, decode_step)

    def _decode_plan(
        self, decodes: list[Request], admission: StepAdmission | None
    ) -> StepPlan:
        """The decode step of ``decodes`` (every running request): all of
        them, or, with ``decode_split_break_even_positions``, one group of
        the decode cycle (``decode_groups``) with the others hidden."""
        break_even = self.neuron_config.decode_split_break_even_positions
        if break_even is None:
            return StepPlan(True, [], admission, decode_only=True)
        done = self._decoded_in_cycle
        if done and any(r.request_id not in done for r in decodes):
            # The cycle's second step: whoever has not decoded in it.
            hidden = [r for r in decodes if r.request_id in done]
            return StepPlan(True, hidden, admission, True, decode_cycle=frozenset())
        by_context = sorted(decodes, key=lambda r: r.num_computed_tokens)
        config = self.neuron_config
        shorter = shorter_group_size(
            [r.num_computed_tokens + 1 for r in by_context],
            config.num_seqs_buckets,
            config.decode_context_length_buckets,
            break_even,
        )
        first = frozenset(r.request_id for r in by_context[:shorter])
        return StepPlan(
            True, by_context[shorter:] if shorter else [], admission, True,
            decode_cycle=first,
        )  # fmt: skip

    def _admission_queues(self) -> list[tuple[RequestQueue, bool | None]]:
        """The waiting queues the parent scans in its pause state, in its
        order, each with whether its requests hold KV blocks."""
        pause_state = self.pause_state
        if pause_state == PauseState.PAUSED_ALL:
            return []
        unpaused = pause_state == PauseState.UNPAUSED
        return [
            (getattr(self, queue.attribute), queue.holds_kv)
            for queue in self._features.waiting_queues
            if unpaused or queue.drained_when_paused_new
        ]

    def _waiting_holders(self) -> list[Request]:
        """The waiting requests that hold KV blocks."""
        holders: list[Request] = []
        for queue in self._features.waiting_queues:
            if queue.holds_kv is False:
                continue
            requests = getattr(self, queue.attribute)
            if queue.holds_kv:
                holders.extend(requests)
            else:
                holders.extend(r for r in requests if self._holds_kv(r))
        return holders

    def _holds_kv(self, request: Request) -> bool:
        return holds_kv_blocks(self.kv_cache_manager, request)

    def _num_waiting_without_kv(self) -> int:
        """How many waiting requests hold no KV blocks."""
        count = 0
        for queue in self._features.waiting_queues:
            requests = getattr(self, queue.attribute)
            if queue.holds_kv is None:
                count += sum(1 for r in requests if not self._holds_kv(r))
            elif not queue.holds_kv:
                count += len(requests)
        return count

    def _num_waiting(self) -> int:
        return sum(
            len(getattr(self, q.attribute)) for q in self._features.waiting_queues
        )

    def _step_admission(
        self,
        prefill_in_progress: bool,
        decode_turn: bool,
        throttled: bool,
        interval_hold: bool,
        token_cap: int,
    ) -> StepAdmission | None:
        """This step's admission, or ``None`` when nothing waits."""
        if not any(getattr(self, q.attribute) for q in self._features.waiting_queues):
            return None
        waiting_without_kv = self._num_waiting_without_kv()
        streaming = waiting_for_streaming_input(self)
        occupancy = StepOccupancy(
            num_running=len(self.running) + streaming,
            num_admitted=0,
            prefill_in_progress=prefill_in_progress,
            # Every request known to the scheduler holds KV blocks except
            # the waiting ones without (running, loading or holding KV while
            # waiting, finished with blocks still being sent).
            kv_holders=len(self.requests) - waiting_without_kv,
            kv_blocks_committed=self._kv_blocks_committed(),
            decode_turn=decode_turn,
            throttled=throttled,
            interval_hold=interval_hold,
            prefill_token_cap=token_cap,
            num_loading=max(0, self._num_waiting() - waiting_without_kv - streaming),
        )
        return StepAdmission(
            self.admission_limits,
            occupancy,
            self._candidate,
            self._is_ready,
            self._count_refusal,
            chunk_limit=self._long_prefill_threshold(),
            draft_slots=self._draft_slots,
            passes_over=self._lora_does_not_fit if self.lora_config else None,
            holds_kv_of=self._holds_kv,
            holders_first=self._features.picks_across_queues,
        )

    def _lora_does_not_fit(self, request: Request) -> bool:
        """vLLM's ``max_loras`` rule on the true running set: a request whose
        adapter is not among those of the running requests (hidden ones
        included) waits while ``max_loras`` adapters are in use. (The parent
        counts only what it scheduled this step, and cannot see the hidden
        decodes' adapters.)"""
        lora = request.lora_request
        if lora is None or lora.lora_int_id <= 0:
            return False
        in_use = {
            r.lora_request.lora_int_id
            for r in (*self.running, *self._hidden)
            if r.lora_request is not None and r.lora_request.lora_int_id > 0
        }
        assert self.lora_config is not None
        return (
            lora.lora_int_id not in in_use and len(in_use) >= self.lora_config.max_loras
        )

    def _long_prefill_threshold(self) -> int:
        """The most tokens vLLM gives one prefill this step (0: no limit):
        ``long_prefill_token_threshold`` while more than one request is
        eligible, floored at a fair share of the budget when adaptive (as
        ``Scheduler.schedule`` decides it, on the true queue lengths; before
        vLLM 0.31 the threshold always applies)."""
        threshold = self.scheduler_config.long_prefill_token_threshold
        if threshold <= 0:
            return 0
        if not self._features.long_prefill_threshold_with_others:
            return threshold  # vLLM 0.29, 0.30: always
        num_running, num_waiting = self.get_request_counts()
        eligible = num_running + num_waiting
        if eligible <= 1:
            return 0
        if self.adaptive_long_prefill_threshold:
            budget = self.scheduler_config.max_num_batched_tokens
            threshold = max(threshold, budget // eligible)
        return threshold

    def _is_ready(self, request: Request) -> bool:
        """False for a request in a blocked state that is still blocked (the
        parent passes it over); promotes one whose wait is over, as the
        parent does (idempotent)."""
        return is_ready_to_schedule(self, request)

    def _count_refusal(self, rule: AdmissionRule) -> None:
        self.metrics.refusals[rule] += 1

    def _run_pass(self, plan: StepPlan, throttle_prefills: bool) -> SchedulerOutput:
        """One parent pass with ``plan.hidden`` out of ``running`` (and the
        parent's running limits lowered to match) and the waiting queues
        gated by ``plan.admission``. Everything is restored in ``finally``."""
        features = self._features
        queues = [getattr(self, q.attribute) for q in features.waiting_queues]
        all_running = self.running
        saved_limits = [getattr(self, name) for name in self._lowered_limits]
        hidden = plan.hidden
        try:
            if hidden:
                hidden_set = set(hidden)
                self.running = [r for r in all_running if r not in hidden_set]
                self._hidden = hidden
                self.max_num_running_reqs -= len(hidden)
                if features.active_limit:
                    self.max_num_active_reqs -= len(hidden)
                if plan.token_cap:
                    # Decodes wait behind this prefill step: keep it short.
                    self.max_num_scheduled_tokens = min(
                        self.max_num_scheduled_tokens, plan.token_cap
                    )
            if plan.admission is not None:
                plan.admission.decode_only = plan.decode_only
            group = (
                GateGroup(self._by_priority) if features.picks_across_queues else None
            )
            for spec, queue in zip(features.waiting_queues, queues, strict=True):
                gate = AdmissionGate(queue, plan.admission, spec.holds_kv, group)
                setattr(self, spec.attribute, gate)
            self._abandon_if_empty = plan.fallback is not None
            bound_before = self.prefill_capacity_bound
            output = self._call_base_schedule(throttle_prefills)
            if features.capacity_bound_from_waiting_queue:
                self._settle_capacity_bound(output, throttle_prefills, bound_before)
            return output
        finally:
            self._abandon_if_empty = False
            for spec, queue in zip(features.waiting_queues, queues, strict=True):
                gate = getattr(self, spec.attribute)
                if isinstance(gate, AdmissionGate):
                    # Skipped as vLLM skips: counted where it counts them.
                    mark_deferred(self, gate.restore())
                setattr(self, spec.attribute, queue)
            for name, value in zip(self._lowered_limits, saved_limits, strict=True):
                setattr(self, name, value)
            if hidden:
                self.running = _restore_running(all_running, hidden, self.running)
                self._hidden = []

    def _settle_capacity_bound(
        self, output: SchedulerOutput, throttle_prefills: bool, bound_before: bool
    ) -> None:
        """vLLM 0.29 and 0.30 set ``prefill_capacity_bound`` to
        ``bool(self.waiting)`` after a step that did not defer prefills,
        which the gate answers with admission's verdict: set it from the
        real queue as the parent meant (its scan ran unless it preempted or
        was paused)."""
        deferred = (
            throttle_prefills
            and not bound_before
            and any(not r.is_prefill_chunk for r in self.running)
        )
        scanned = (
            not output.preempted_req_ids and self.pause_state == PauseState.UNPAUSED
        )
        if scanned and not deferred:
            # The gate's length counts what it set aside: still waiting.
            self.prefill_capacity_bound = len(self.waiting) > 0

    def _candidate(self, request: Request, holds_kv: bool) -> Candidate:
        """``request`` as admission sees it: the tokens left after its
        computed tokens or local prefix-cache hit; its worst-case KV growth
        only under ``reserve``, and only if it holds no blocks yet (a
        holder's blocks and growth are already in the committed count)."""
        computed = request.num_computed_tokens
        if not holds_kv and computed == 0:
            computed = self._prefix_hit_tokens(request)
        left = request.num_tokens - computed
        blocks = 0
        if not holds_kv and self.admission_limits.kv_admission is KvAdmission.RESERVE:
            blocks = self._new_request_blocks(request)
        prompt_end = left == 1 and self._prompt_end_slack == 1
        return Candidate(left, blocks, holds_kv, prompt_end=prompt_end)

    def _prefix_hit_tokens(self, request: Request) -> int:
        """Tokens of ``request`` the local prefix cache holds now, as the
        parent's lookup will find them (it never counts the last token)."""
        if not self.cache_config.enable_prefix_caching or kv_events_enabled(self):
            # With KV events the lookup may publish events: not a read-only
            # look any more, so admission does without the hit.
            return 0
        return prefix_hit_tokens(self.kv_cache_manager, request)

    def _worst_case_blocks(self, request: Request) -> int:
        """Blocks ``request`` can ever hold: its prompt and every token it
        may generate, capped at ``max_model_len``."""
        return blocks_for(
            max_request_len(
                request.num_prompt_tokens,
                # vLLM also allocates slots for speculative lookahead tokens.
                request.max_tokens + lookahead_tokens(self),
                self.max_model_len,
            ),
            self.block_size,
        )

    def _new_request_blocks(self, request: Request) -> int:
        """Blocks a request that holds none yet can take from the free pool:
        its worst case less the cached prefix blocks running requests hold
        (those are already in use)."""
        need = self._worst_case_blocks(request)
        if self.cache_config.enable_prefix_caching and request.block_hashes:
            max_hits = (request.num_tokens - 1) // self.block_size
            for block_hash in request.block_hashes[:max_hits]:
                if not prefix_block_in_use(self.kv_cache_manager, block_hash):
                    break
                need -= 1
        # A cache smaller than one request's worst case (only possible below
        # vLLM's own start-up check) would otherwise never admit it.
        limits = self.admission_limits
        return min(need, limits.usable_kv_blocks - limits.reserved_kv_blocks)

    def _kv_blocks_committed(self) -> int:
        """Blocks in use now plus what every block holder can still grow by
        (its worst case less the blocks it holds)."""
        if self.admission_limits.kv_admission is not KvAdmission.RESERVE:
            return 0
        free = num_free_blocks(self.kv_cache_manager)
        used = self.admission_limits.usable_kv_blocks - free
        held = blocks_held(self.kv_cache_manager)  # read once per step
        growth = 0
        for holders in (self.running, self._waiting_holders()):
            for r in holders:
                held_now = len(held.get(r.request_id, ()))
                growth += max(0, self._worst_case_blocks(r) - held_now)
        return used + growth

    def _record_step(self, output: SchedulerOutput) -> StepRecord:
        config = self.neuron_config
        record = describe_output(
            output,
            self.requests,
            config.num_batched_tokens_buckets,
            config.num_seqs_buckets,
            config.decode_context_length_buckets,
            self._prompt_end_slack,
        )
        if config.kv_segment_size is not None and record.kind is StepKind.PREFILL:
            _check_segment_starts(output, config.kv_segment_size)
        padded = NeuronSchedulerOutput.adopt(output)
        padded.num_scheduled_tokens_padded = dict(record.padded_tokens)
        padded.total_num_scheduled_tokens_padded = record.total_padded
        padded.num_seqs_padded = record.num_seqs_padded
        if record.kind is StepKind.DECODE:
            padded.decode_context_len_padded = record.context_len_padded
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
        if logger.isEnabledFor(logging.DEBUG):  # summary() is not free
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
        if self._step_log is not None:
            self._step_log.close()
        super().shutdown()

    def _align_to_segments(self, segment: int) -> None:
        """``kv_segment_size_buckets``: prefix-cache hits end on a segment,
        and so (with every chunk budget a multiple of it) does every chunk.
        Refuses at start what could start a chunk off a segment."""
        key = "neuron_config['kv_segment_size_buckets']"
        threshold = self.scheduler_config.long_prefill_token_threshold
        if threshold > 0 and (threshold % segment or self._adaptive_threshold()):
            raise ValueError(
                f"{key} = [{segment}] needs long_prefill_token_threshold to be a "
                f"multiple of it and not adaptive, got {threshold}"
            )
        if self.vllm_config.kv_transfer_config is not None:
            raise ValueError(
                f"{key} = [{segment}] cannot align a KV connector's external "
                "hits to segments: use it without a KV connector"
            )
        if not self._features.truncates_prefix_hits:
            raise ValueError(
                f"{key} = [{segment}] needs a vLLM whose KV cache manager can cut "
                "a prefix-cache hit back (truncate_computed_blocks, vLLM 0.29+)"
            )
        align_prefix_hits(self.kv_cache_manager, segment)

    def _adaptive_threshold(self) -> bool:
        """Whether vLLM floors the long-prefill threshold at a fair share
        (only where it has that rule: ``long_prefill_threshold_with_others``)."""
        return (
            self._features.long_prefill_threshold_with_others
            and self.adaptive_long_prefill_threshold
        )

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
            vllm_estimate=estimate,
            reserved_blocks=watermark_blocks(self.kv_cache_manager),
        )


class _NothingScheduled(Exception):
    """A pass planned for one kind of work scheduled nothing (internal)."""


@dataclass(slots=True)  # not frozen: built every step, frozen init is slower
class StepPlan:
    """What the parent sees in one pass.

    ``hidden``: running requests it does not see. ``admission``: the step's
    ``StepAdmission`` for the waiting queues (``None``: nothing starts);
    with ``decode_only`` only prompt ends start. ``token_cap``: the prefill
    token budget while decodes wait (0: none). ``fallback``: if set and the
    pass schedules nothing, the step runs this plan instead.
    ``decode_cycle``: if set, the ids decoded in the decode cycle once this
    plan has run (``decode_groups``; empty: the cycle is over).
    """

    has_decodes: bool
    hidden: list[Request]
    admission: StepAdmission | None
    decode_only: bool = False
    token_cap: int = 0
    fallback: StepPlan | None = None
    decode_cycle: frozenset[str] | None = None


def _others(requests: list[Request], excluded: list[Request]) -> list[Request]:
    """``requests`` without ``excluded``, in order."""
    drop = set(excluded)
    return [r for r in requests if r not in drop]


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


def _check_segment_starts(output: SchedulerOutput, segment: int) -> None:
    """Every prefill chunk of ``output`` starts on a segment (raises
    ``RuntimeError`` naming the request otherwise)."""
    starts = [
        (new.req_id, new.num_computed_tokens) for new in output.scheduled_new_reqs
    ]
    cached = output.scheduled_cached_reqs
    starts += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    for request_id, start in starts:
        if start % segment:
            raise RuntimeError(
                f"prefill chunk of {request_id} starts at token {start}, off the "
                f"KV segment size {segment}"
            )


def _raw_neuron_config(additional_config: object) -> object:
    if additional_config is None:
        return {}
    if not isinstance(additional_config, dict):
        get = getattr(additional_config, "get", None)
        return get(NEURON_CONFIG_KEY, {}) if callable(get) else {}
    return additional_config.get(NEURON_CONFIG_KEY, {})
