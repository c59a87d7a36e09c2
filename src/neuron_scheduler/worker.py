"""``StaticShapeWorker``: vLLM's CPU worker running every forward pass at the
static shape ``NeuronScheduler`` padded the step to.

Select it with vLLM's own option: ``LLM(worker_cls=
"neuron_scheduler.StaticShapeWorker", scheduler_cls=
"neuron_scheduler.NeuronScheduler")`` or ``--worker-cls`` on the server.

It reuses the padding path vLLM's GPU model runner (which the CPU runner
extends) has for CUDA graphs: the step's batch descriptor carries the padded
token count, the persistent input buffers are run at that length, the padded
tokens' KV slots are -1 (no KV write) and their positions 0. On top of that
it fills the padding as the design says: pad token ids, and in a prefill
step positions repeating the last real position (a dummy decode row keeps
position 0). Shapes:

* a prefill step runs ``total_num_scheduled_tokens_padded`` tokens (a token
  bucket);
* a decode step runs ``num_seqs_padded`` rows (a batch bucket) of one token
  each (1 + k with speculative decoding): the dummy rows are padding tokens
  that write nothing.

Attention is the exception, as in vLLM's piecewise CUDA graphs: the CPU
attention kernel runs the real tokens only (its metadata is not padded), and
it reads each sequence's own context, so ``decode_context_len_padded`` is
recorded but not applied on this platform. Every other layer (embedding,
projections, MLP, norms, logits) runs the padded shape.

A step whose padded shape is not a configured bucket raises
``StaticShapeError``. With ``neuron_config["compile_buckets"]`` the worker
runs every bucket shape once at start, the analogue of compiling one Neuron
graph per bucket, and records the seconds each first run took in
``model_runner.compile_seconds`` (with ``"warmup"``: vLLM's own compile
seconds). On the CPU platform vLLM compiles one dynamic-shape graph at
warm-up (``torch.compile`` with ``enforce_eager=False``): that is where the
compile time goes, and each bucket's first run after it costs what a later
run does. A Neuron worker pays per bucket.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from neuron_scheduler.vllm_compat import check_vllm_version

# Before any vLLM internal is imported: another vLLM fails here, by name.
check_vllm_version()

import torch
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from neuron_scheduler.config import NEURON_CONFIG_KEY, EngineLimits, NeuronConfig
from neuron_scheduler.output import NeuronSchedulerOutput
from neuron_scheduler.step import StepKind

logger = init_logger(f"vllm.{__name__}")


class StaticShapeError(RuntimeError):
    """A step's padded shape is not one the configuration compiles."""


@dataclass(frozen=True)
class ForwardShape:
    """The shape one forward pass runs: ``kind`` (prefill or decode),
    ``tokens`` (padded, the graph's token dimension) and, for
    a decode step, ``rows`` (padded) and ``context`` (the context bucket)."""

    kind: StepKind
    tokens: int
    actual_tokens: int
    rows: int = 0
    context: int = 0


class StaticShapeModelRunner(CPUModelRunner):
    """``CPUModelRunner`` whose forward passes run the scheduler's padded
    shapes. ``forward_shapes`` counts the shapes run (tests and profiles read
    it); ``compile_seconds`` maps ``"prefill:T"`` / ``"decode:R"`` to the
    seconds the first run of that shape took at start."""

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        scheduler_config = vllm_config.scheduler_config
        self.neuron_config = NeuronConfig.from_dict(
            (vllm_config.additional_config or {}).get(NEURON_CONFIG_KEY, {}),
            EngineLimits(
                max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
                max_model_len=vllm_config.model_config.max_model_len,
                max_num_seqs=scheduler_config.max_num_seqs,
            ),
        )
        hf_config = vllm_config.model_config.hf_text_config
        self.pad_token_id = int(getattr(hf_config, "pad_token_id", None) or 0)
        self.forward_shapes: Counter[ForwardShape] = Counter()
        self.compile_seconds: dict[str, float] = {}
        self._shape: ForwardShape | None = None

    # ----------------------------------------------------------- the step

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None):
        self._shape = self.static_shape(scheduler_output)
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._shape = None

    def static_shape(self, output: Any) -> ForwardShape | None:
        """The padded shape of ``output``'s step (``None``: nothing to run).
        Raises ``StaticShapeError`` for a shape outside the buckets or an
        output no ``NeuronScheduler`` padded."""
        actual = output.total_num_scheduled_tokens
        if not actual:
            return None
        if not isinstance(output, NeuronSchedulerOutput):
            raise StaticShapeError(
                "StaticShapeWorker runs the shapes NeuronScheduler pads steps to; "
                f"this engine's scheduler sent a {type(output).__name__} (set "
                "scheduler_cls='neuron_scheduler.NeuronScheduler')"
            )
        config = self.neuron_config
        if output.decode_context_len_padded is None:
            tokens = output.total_num_scheduled_tokens_padded
            if tokens not in config.num_batched_tokens_buckets:
                raise StaticShapeError(
                    f"prefill step padded to {tokens} tokens, not a token bucket "
                    f"{list(config.num_batched_tokens_buckets)}"
                )
            return ForwardShape(StepKind.PREFILL, tokens, actual)
        rows = len(output.num_scheduled_tokens)
        rows_padded = output.num_seqs_padded
        context = output.decode_context_len_padded
        if rows_padded not in config.num_seqs_buckets:
            raise StaticShapeError(
                f"decode step padded to {rows_padded} rows, not a batch bucket "
                f"{list(config.num_seqs_buckets)}"
            )
        if context not in config.decode_context_length_buckets:
            raise StaticShapeError(
                f"decode step padded to a context of {context}, not a context "
                f"bucket {list(config.decode_context_length_buckets)}"
            )
        per_row = max(output.num_scheduled_tokens.values())
        if per_row * rows != actual:
            raise StaticShapeError(
                f"decode rows of unequal lengths {output.num_scheduled_tokens}"
            )
        return ForwardShape(
            StepKind.DECODE, rows_padded * per_row, actual, rows_padded, context
        )

    # The hooks below are vLLM internals (checked in vllm_internals).

    def _determine_batch_execution_and_padding(self, num_tokens: int, *args, **kwargs):  # type: ignore[no-untyped-def]
        mode, descriptor, *rest = super()._determine_batch_execution_and_padding(
            num_tokens, *args, **kwargs
        )
        shape = self._shape
        if shape is not None:
            if num_tokens != shape.actual_tokens:
                raise StaticShapeError(
                    f"the runner got {num_tokens} tokens for a step of "
                    f"{shape.actual_tokens}"
                )
            if shape.tokens > self.max_num_tokens:
                raise StaticShapeError(
                    f"padded shape {shape} exceeds the runner's buffers "
                    f"({self.max_num_tokens} tokens)"
                )
            descriptor = replace(descriptor, num_tokens=shape.tokens)
            self.forward_shapes[shape] += 1
        return (mode, descriptor, *rest)

    def _preprocess(
        self,
        scheduler_output: Any,
        num_input_tokens: int,
        intermediate_tensors: Any = None,
    ):  # type: ignore[no-untyped-def]
        actual = scheduler_output.total_num_scheduled_tokens
        shape = self._shape
        padded = shape is not None and num_input_tokens > actual
        if padded:
            self.input_ids.gpu[actual:num_input_tokens] = self.pad_token_id
        result = super()._preprocess(
            scheduler_output, num_input_tokens, intermediate_tensors
        )
        if padded and shape is not None and shape.kind is StepKind.PREFILL:
            # vLLM's padding path zeroes padded positions (what a dummy decode
            # row keeps); a prefill's padding repeats its last real position.
            self.positions[actual:num_input_tokens] = self.positions[actual - 1]
        return result

    # ------------------------------------------------------ compile at start

    def bucket_shapes(self) -> list[tuple[StepKind, int]]:
        """Every (kind, tokens) shape the configuration can run: each token
        bucket, and each batch bucket of single-token rows."""
        config = self.neuron_config
        shapes = [(StepKind.PREFILL, t) for t in config.num_batched_tokens_buckets]
        shapes += [(StepKind.DECODE, r) for r in config.num_seqs_buckets]
        return shapes

    def compile_buckets(self) -> dict[str, float]:
        """Run each bucket shape once (compiling it when vLLM compiles) and
        record the seconds each first run took."""
        for kind, tokens in self.bucket_shapes():
            started = time.perf_counter()
            self._dummy_run(tokens, uniform_decode=kind is StepKind.DECODE)
            self.compile_seconds[f"{kind.value}:{tokens}"] = (
                time.perf_counter() - started
            )
        logger.info(
            "StaticShapeWorker: %d bucket shapes run at start in %.1f s",
            len(self.compile_seconds),
            sum(self.compile_seconds.values()),
        )
        return self.compile_seconds


class StaticShapeWorker(CPUWorker):
    """vLLM's CPU worker with a ``StaticShapeModelRunner``."""

    def init_device(self) -> None:
        super().init_device()
        if self.use_v2_model_runner:
            raise StaticShapeError(
                "StaticShapeWorker extends vLLM's V1 CPU model runner; set "
                "VLLM_USE_V2_MODEL_RUNNER=0"
            )
        self.model_runner = StaticShapeModelRunner(
            self.vllm_config, torch.device("cpu")
        )

    def forward_shape_counts(self) -> dict[str, int]:
        """``"prefill:T"`` / ``"decode:R"`` -> forward passes run at that
        shape (plain data: readable through ``LLM.collective_rpc``)."""
        counts: Counter[str] = Counter()
        runner = self.model_runner
        assert isinstance(runner, StaticShapeModelRunner)
        for shape, count in runner.forward_shapes.items():
            size = shape.tokens if shape.kind is StepKind.PREFILL else shape.rows
            counts[f"{shape.kind.value}:{size}"] += count
        return dict(counts)

    def compile_or_warm_up_model(self) -> Any:
        times = super().compile_or_warm_up_model()
        runner = self.model_runner
        if isinstance(runner, StaticShapeModelRunner) and (
            runner.neuron_config.compile_buckets
        ):
            runner.compile_seconds["warmup"] = float(times.language_model or 0.0)
            runner.compile_buckets()
        return times

    def compile_seconds(self) -> dict[str, float]:
        """``model_runner.compile_seconds`` (through ``collective_rpc``)."""
        runner = self.model_runner
        assert isinstance(runner, StaticShapeModelRunner)
        return dict(runner.compile_seconds)
