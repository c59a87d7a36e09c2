"""neuron-scheduler: a vLLM v1 scheduler for static-shape accelerators.

The public names are imported on first use, so that ``neuron-scheduler
--version`` and the error for an unsupported vLLM (raised when the scheduler
module is imported: ``vllm_compat``) do not depend on vLLM importing.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "AdmissionRule": "neuron_scheduler.admission",
    "NeuronAsyncScheduler": "neuron_scheduler.async_scheduler",
    "NeuronConfig": "neuron_scheduler.config",
    "NeuronScheduler": "neuron_scheduler.scheduler",
    "MixedBatchError": "neuron_scheduler.step",
    "SchedulerState": "neuron_scheduler.step",
    "StepKind": "neuron_scheduler.step",
    "StepRecord": "neuron_scheduler.step",
    "StaticShapeWorker": "neuron_scheduler.worker",
}

if TYPE_CHECKING:
    from neuron_scheduler.admission import AdmissionRule
    from neuron_scheduler.async_scheduler import NeuronAsyncScheduler
    from neuron_scheduler.config import NeuronConfig
    from neuron_scheduler.scheduler import NeuronScheduler
    from neuron_scheduler.step import (
        MixedBatchError,
        SchedulerState,
        StepKind,
        StepRecord,
    )
    from neuron_scheduler.worker import StaticShapeWorker


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module), name)


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
    "__version__",
]
