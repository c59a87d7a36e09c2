"""neuron-scheduler: a vLLM v1 scheduler for static-shape accelerators."""

from neuron_scheduler.admission import AdmissionRule
from neuron_scheduler.async_scheduler import NeuronAsyncScheduler
from neuron_scheduler.config import NeuronConfig
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.step import MixedBatchError, SchedulerState, StepKind, StepRecord


def __getattr__(name: str) -> object:
    # The worker imports vLLM's CPU worker stack: only on demand.
    if name == "StaticShapeWorker":
        from neuron_scheduler.worker import StaticShapeWorker

        return StaticShapeWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AdmissionRule",
    "MixedBatchError",
    "NeuronAsyncScheduler",
    "NeuronConfig",
    "NeuronScheduler",
    "SchedulerState",
    "StaticShapeWorker",
    "StepKind",
    "StepRecord",
]
