"""``NeuronAsyncScheduler``: ``NeuronScheduler`` for vLLM's async engine core.

With async scheduling the engine schedules step N+1 before step N's output is
applied; vLLM's ``AsyncScheduler`` tracks the in-flight tokens as output
placeholders. Our holdback / hiding / padding logic is unchanged: a request
whose last prefill chunk is in flight already counts its prompt as computed,
so it is a decode in step N+1, and the pre-step ``num_computed_tokens`` in
the output still classifies every step correctly.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput

from neuron_scheduler.scheduler import NeuronScheduler


class NeuronAsyncScheduler(NeuronScheduler, AsyncScheduler):
    """Static-shape scheduling with async (pipelined) output handling."""

    def _call_base_schedule(self, throttle_prefills: bool) -> SchedulerOutput:
        # AsyncScheduler inherits schedule() and overrides the update hooks
        # (_update_after_schedule, _update_request_with_output), which the
        # MRO applies to this instance.
        return AsyncScheduler.schedule(self, throttle_prefills)
