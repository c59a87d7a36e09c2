"""A real vLLM engine to start: the arguments of ``vllm.LLM`` and of the
OpenAI server that matter to a profile or a validation, and the simulator's
settings that stand for it."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_scheduler.config import EngineLimits, NeuronConfig
from neuron_scheduler.offline.engine import EngineSettings

#: The worker that runs static shapes on the CPU platform.
CPU_STATIC_WORKER = "neuron_scheduler.StaticShapeWorker"


@dataclass(frozen=True)
class EngineSpec:
    """A real vLLM engine to start (the ``vllm.LLM`` and server arguments
    that matter); ``simulated`` is the ``EngineSettings`` that stands for it
    in the simulator."""

    model: str
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 8
    kv_cache_memory_bytes: int = 64 << 20
    dtype: str = "float32"
    enforce_eager: bool = True
    block_size: int | None = None
    worker_cls: str | None = None
    neuron_config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    #: vLLM's ``distributed_executor_backend``; ``None``: the one the
    #: OpenAI server would use on this platform (``server_executor``).
    distributed_executor_backend: str | None = None

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(
            self.max_num_batched_tokens, self.max_model_len, self.max_num_seqs
        )

    def simulated(self, kv_cache: Mapping[str, Any]) -> EngineSettings:
        """This engine's settings for the simulator, with the KV cache it
        was measured to have (a profile's ``num_blocks`` and
        ``block_size``)."""
        return EngineSettings(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=int(kv_cache["block_size"]),
            num_kv_blocks=int(kv_cache["num_blocks"]),
        )

    def resolved_config(self) -> NeuronConfig:
        return NeuronConfig.from_dict(self.neuron_config, self.limits)

    def measuring_neuron_config(self) -> dict[str, Any]:
        """The user's shapes, with the measurement run's admission."""
        config = self.resolved_config()
        measuring: dict[str, Any] = {
            "num_batched_tokens_buckets": list(config.num_batched_tokens_buckets),
            "num_seqs_buckets": list(config.num_seqs_buckets),
            "decode_context_length_buckets": list(config.decode_context_length_buckets),
            "kv_admission": "reserve",
        }
        if config.compile_buckets:
            measuring["compile_buckets"] = True
        return measuring

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.model,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "dtype": self.dtype,
            "enforce_eager": self.enforce_eager,
            # The profile's long-context prefill samples share their
            # context (validate's server runs without it).
            "enable_prefix_caching": True,
            "seed": self.seed,
            "scheduler_cls": "neuron_scheduler.NeuronScheduler",
            "additional_config": {"neuron_config": self.measuring_neuron_config()},
        }
        if self.block_size is not None:
            kwargs["block_size"] = self.block_size
        if self.worker_cls is not None:
            kwargs["worker_cls"] = self.worker_cls
        executor = self.distributed_executor_backend or server_executor()
        if executor is not None:
            kwargs["distributed_executor_backend"] = executor
        return kwargs


def server_executor() -> str | None:
    """The executor vLLM's OpenAI server runs a one-device engine with, where
    it differs from the in-process default: on CPU the server always uses
    ``mp``, whose worker process gets vLLM's OpenMP binding (one core is
    reserved for the engine core; ``vllm/platforms/cpu.py``). An in-process
    engine would otherwise run its forward passes on every core and time
    steps the server never takes. ``None`` elsewhere: vLLM's default."""
    from vllm.platforms import current_platform

    return "mp" if current_platform.is_cpu() else None


def server_neuron_config(spec: EngineSpec) -> dict[str, Any]:
    """``spec``'s ``neuron_config`` as its server runs it: every bucket
    shape run once at start (``compile_buckets``, unless the user set it),
    as a Neuron server compiles every graph before it serves. A profile
    times warmed shapes (medians); a server's first step of each shape ran
    1.5-2.5x a later one (measured 2026-12-03: a 2048-token bucket's first
    2.2-2.7 s, later 1.0 s; a 4096 one's 3.7-4.5 s, later 2.3-3.4), which
    went into the first level a validation fits on."""
    return {"compile_buckets": True, **spec.neuron_config}


def server_args(spec: EngineSpec) -> list[str]:
    """The OpenAI server's command line for ``spec`` (``EngineSpec``)."""
    additional = {"neuron_config": server_neuron_config(spec)}
    args = [
        "--served-model-name", "validate",
        "--max-model-len", str(spec.max_model_len),
        "--max-num-batched-tokens", str(spec.max_num_batched_tokens),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes),
        "--dtype", spec.dtype,
        "--no-enable-prefix-caching",
        "--scheduler-cls", "neuron_scheduler.NeuronScheduler",
        "--additional-config", json.dumps(additional),
    ]  # fmt: skip
    if spec.worker_cls is not None:
        args += ["--worker-cls", spec.worker_cls]
    if spec.enforce_eager:
        args.append("--enforce-eager")
    if spec.block_size is not None:
        args += ["--block-size", str(spec.block_size)]
    return args


def profile_command(
    spec: EngineSpec, output: Path, *, progress: bool, fit_seconds: float | None = None
) -> list[str]:
    """``neuron-scheduler profile`` of ``spec`` writing ``output`` (with
    ``--fit-seconds`` if given): the command line a child process runs (an
    in-process engine changes its process's environment, which a server
    started next would inherit)."""
    command = [
        sys.executable, "-m", "neuron_scheduler", "profile",
        "--model", spec.model,
        "--max-model-len", str(spec.max_model_len),
        "--max-num-batched-tokens", str(spec.max_num_batched_tokens),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes),
        "--dtype", spec.dtype,
        "--neuron-config", json.dumps(spec.neuron_config),
        "--output", str(output),
    ]  # fmt: skip
    if spec.worker_cls:
        command += ["--worker-cls", spec.worker_cls]
    if spec.block_size is not None:
        command += ["--block-size", str(spec.block_size)]
    if not spec.enforce_eager:
        command.append("--compile")
    if not progress:
        command.append("--no-progress")
    if fit_seconds is not None:
        command += ["--fit-seconds", f"{fit_seconds:g}"]
    return command
