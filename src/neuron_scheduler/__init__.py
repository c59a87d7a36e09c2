"""neuron-scheduler: a vLLM v1 scheduler for static-shape accelerators."""

from neuron_scheduler.admission import AdmissionRule
from neuron_scheduler.async_scheduler import NeuronAsyncScheduler
from neuron_scheduler.config import NeuronConfig
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.step import MixedBatchError, SchedulerState, StepKind, StepRecord

__all__ = [
    "AdmissionRule",
    "MixedBatchError",
    "NeuronAsyncScheduler",
    "NeuronConfig",
    "NeuronScheduler",
    "SchedulerState",
    "StepKind",
    "StepRecord",
]
