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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import RequestQueue, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from neuron_scheduler.admission import (
    AdmissionLimits,
    AdmissionRule,
    StepOccupancy,
    admission_refusal,
    max_kv_concurrency,
)
from neuron_scheduler.config import NEURON_CONFIG_KEY, EngineLimits, NeuronConfig
from neuron_scheduler.step import (
    PaddingTotals,
    SchedulerState,
    StepRecord,
    describe_step,
    scheduled_requests,
)

# Under the "vllm" logger so vLLM's handlers and levels apply.
logger = init_logger(f"vllm.{__name__}")


class NeuronScheduler(Scheduler):
    """vLLM v1 scheduler for static-shape accelerators (see module docstring).

    Readable state: ``state`` (``SchedulerState`` of the last step),
    ``last_step`` (its ``StepRecord``), ``padding_totals``,
    ``admission_refusals`` (refusal counts per ``AdmissionRule``),
    ``neuron_config`` and ``admission_limits``. ``step_listeners`` receive
    every ``StepRecord``.
    """

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
        self.admission_limits = AdmissionLimits(
            max_running=min(self.max_num_running_reqs, self.max_num_active_reqs),
            max_prefills_per_batch=self.neuron_config.max_prefills_per_batch,
            max_kv_concurrent=self._max_kv_concurrent(),
        )
        self.state = SchedulerState.IDLE
        self.last_step: StepRecord | None = None
        self.padding_totals = PaddingTotals()
        self.admission_refusals: Counter[AdmissionRule] = Counter()
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
        saved_limits = (self.max_num_running_reqs, self.max_num_active_reqs)
        hidden: list[Request] = []
        try:
            running_prefills = [
                r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens
            ]
            self._admit(held_kv_holding, held_waiting, bool(running_prefills))
            hidden = self._hide_decodes(running_prefills)
            self.max_num_running_reqs -= len(hidden)
            self.max_num_active_reqs -= len(hidden)
            output = self._call_base_schedule(throttle_prefills)
        finally:
            self.max_num_running_reqs, self.max_num_active_reqs = saved_limits
            if hidden:
                # Hidden decodes go back in front: they are older than any
                # request admitted this step, so running keeps arrival order.
                hidden.extend(self.running)
                self.running = hidden
            self.waiting = _merge_back(self.waiting, held_waiting)
            self.kv_holding_waiting = _merge_back(
                self.kv_holding_waiting, held_kv_holding
            )
        self._record_step(output)
        return output

    # ---------------------------------------------------------------- helpers

    def can_schedule(
        self, request: Request, num_admitted: int, prefill_in_progress: bool
    ) -> AdmissionRule | None:
        """Why ``request`` may not start its prefill in this step (``None``:
        it may), given ``num_admitted`` requests already admitted to it."""
        del request  # the design's rules depend on the step, not the request
        occupancy = StepOccupancy(
            num_running=len(self.running) + self.num_waiting_for_streaming_input,
            num_admitted=num_admitted,
            prefill_in_progress=prefill_in_progress,
        )
        return admission_refusal(self.admission_limits, occupancy)

    def _admit(
        self,
        held_kv_holding: RequestQueue,
        held_waiting: RequestQueue,
        prefill_in_progress: bool,
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
        num_admitted = 0
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
                refusal = self.can_schedule(request, num_admitted, prefill_in_progress)
                if refusal is not None:
                    self.admission_refusals[refusal] += 1
                    refused = True
                    break
                restored.add_request(held.pop_request())
                num_admitted += 1
            if passed_over:
                held.prepend_requests(reversed(passed_over))
            if refused:
                return

    def _hide_decodes(self, running_prefills: list[Request]) -> list[Request]:
        """Keep only prefill work visible to the parent; return the hidden."""
        if running_prefills:
            if len(running_prefills) == len(self.running):
                return []
            prefill_set = set(running_prefills)
            hidden = [r for r in self.running if r not in prefill_set]
            self.running = running_prefills
            return hidden
        if self.waiting or self.kv_holding_waiting:
            hidden = self.running
            self.running = []
            return hidden
        return []

    def _record_step(self, output: SchedulerOutput) -> None:
        requests = self.requests
        record = describe_step(
            scheduled_requests(output, lambda rid: requests[rid].num_prompt_tokens),
            self.neuron_config.num_batched_tokens_buckets,
            self.neuron_config.num_seqs_buckets,
        )
        output.num_scheduled_tokens_padded = dict(record.padded_tokens)  # type: ignore[attr-defined]
        output.num_seqs_padded = record.num_seqs_padded  # type: ignore[attr-defined]
        self.padding_totals.add(record)
        self.state = record.state
        self.last_step = record
        for listener in self.step_listeners:
            listener(record)
        logger.debug("NeuronScheduler step: %s", record.summary())

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
