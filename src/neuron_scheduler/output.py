"""``NeuronSchedulerOutput``: vLLM's ``SchedulerOutput`` with the static shape
the step was padded to, as declared, typed fields.

``NeuronScheduler`` adopts the output the parent built (same object, same
fields) into this class and fills the fields in. The object travels to the
workers as vLLM sends any ``SchedulerOutput``: by reference in-process,
pickled to worker processes (the class is importable there, so the fields
arrive too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from vllm.v1.core.sched.output import SchedulerOutput


@dataclass
class NeuronSchedulerOutput(SchedulerOutput):
    """A ``SchedulerOutput`` of a static-shape step.

    ``num_scheduled_tokens`` keeps the actual counts that drive vLLM's
    accounting. ``num_scheduled_tokens_padded``: request id -> padded count
    (in a prefill step the padding sits on the last request);
    ``total_num_scheduled_tokens_padded``: the tokens the compiled graph
    runs; ``num_seqs_padded``: its rows (batch bucket of a decode step);
    ``decode_context_len_padded``: the context bucket of a decode step
    (``None`` otherwise).
    """

    num_scheduled_tokens_padded: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens_padded: int = 0
    num_seqs_padded: int = 0
    decode_context_len_padded: int | None = None

    @classmethod
    def adopt(cls, output: SchedulerOutput) -> NeuronSchedulerOutput:
        """``output`` itself, now of this class, its padded fields unset."""
        output.__class__ = cls
        adopted = cast(NeuronSchedulerOutput, output)
        adopted.num_scheduled_tokens_padded = {}
        adopted.total_num_scheduled_tokens_padded = 0
        adopted.num_seqs_padded = 0
        adopted.decode_context_len_padded = None
        return adopted
