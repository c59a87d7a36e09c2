"""The policies a run compares: a scheduler class, its ``neuron_config``,
the engine settings it changes, and how the accelerator executes its steps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from neuron_scheduler.scheduler import NeuronScheduler


class Execution(enum.Enum):
    """How the accelerator runs the step a scheduler planned.

    ``PADDED``: one compiled graph at the shape ``NeuronScheduler`` padded
    the step to. ``DYNAMIC``: one unpadded step, prefill chunks and decode
    rows together (a GPU-like engine). ``GRAPH_PER_PHASE``: the runner of
    optimum-neuron's vLLM integration, the engine every published Neuron vLLM
    benchmark ran (``optimum/neuron/vllm/runner.py``: prefill and decode are
    different graphs, decode first): the decode graph at the compiled batch
    (``max_num_seqs``; every slot computed, real or not) and the smallest
    power-of-two context bucket holding the batch's longest context, then
    one context-encoding graph per new prompt (``ctx_batch_size`` 1), padded
    to a power-of-two bucket; buckets from 128 to ``max_model_len``, NxD
    Inference's automatic bucketing."""

    PADDED = "padded"
    DYNAMIC = "dynamic"
    GRAPH_PER_PHASE = "graph-per-phase"


@dataclass(frozen=True)
class Policy:
    """A scheduler to compare: its class, its ``neuron_config``, the engine
    settings it changes, and how the accelerator executes its steps."""

    label: str
    scheduler_cls: type[Scheduler]
    neuron_config: dict[str, Any] | None = None
    execution: Execution = Execution.PADDED
    #: ``EngineSettings`` fields this policy's engine sets differently.
    engine_overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def static_shapes(self) -> bool:
        """Steps are the padded shapes ``NeuronScheduler`` records."""
        return self.execution is Execution.PADDED


SEED = Policy("seed", NeuronScheduler, {})


UNCONSTRAINED = Policy("unconstrained", Scheduler, None, Execution.DYNAMIC)


def neuron_vllm_policy(max_model_len: int) -> Policy:
    """The published engine: vLLM's scheduler as optimum-neuron's platform
    configures it (chunked prefill off, ``max_num_batched_tokens`` raised to
    ``max_model_len``), executed graph per phase."""
    return Policy(
        "neuron-vllm",
        Scheduler,
        None,
        Execution.GRAPH_PER_PHASE,
        {"enable_chunked_prefill": False, "max_num_batched_tokens": max_model_len},
    )
