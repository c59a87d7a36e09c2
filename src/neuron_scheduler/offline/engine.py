"""The offline engine: a real vLLM scheduler with a real ``KVCacheManager`` and
no model.

``build_scheduler`` makes a scheduler from a tiny local model config (a
directory holding only ``config.json``; no hub access, no tokenizer) and a
hand-built ``KVCacheConfig``. ``OfflineEngine`` then drives it like vLLM's
engine core does: ``schedule()`` -> a synthetic ``ModelRunnerOutput`` ->
``update_from_output()`` (``apply_step``, the step primitive the simulator
shares), either in lock-step or pipelined the way the async
engine core runs (step N+1 scheduled before step N's output is applied).

Used by the tests and the simulator.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from neuron_scheduler.config import EngineLimits

#: Vocabulary of the config-only model; synthetic prompts use ids below it.
VOCAB_SIZE = 32000
#: Largest max_model_len the config-only model accepts.
MAX_POSITION_EMBEDDINGS = 1 << 20


#: The config-only model: a tiny Llama; only its shapes matter.
CONFIG_ONLY_MODEL: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "head_dim": 32,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
    "torch_dtype": "float32",
}


@cache
def config_only_model_dir() -> str:
    """A directory with just ``CONFIG_ONLY_MODEL`` as ``config.json``, one
    per config under the temporary directory, shared by every process
    (named by the config's hash, so runs leave no directory each; a
    directory of that name whose ``config.json`` differs is not used: a
    fresh one is made beside it)."""
    text = json.dumps(CONFIG_ONLY_MODEL, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    shared = Path(tempfile.gettempdir()) / f"neuron-sched-model-{digest}"
    if not _holds_config(shared, text):
        staging = Path(tempfile.mkdtemp(prefix="neuron-sched-model-"))
        (staging / "config.json").write_text(text)
        try:
            staging.rename(shared)  # atomic; fails where another got there
        except OSError:
            if not _holds_config(shared, text):
                return str(staging)  # a stranger's directory: keep ours
            shutil.rmtree(staging, ignore_errors=True)
    return str(shared)


def _holds_config(directory: Path, text: str) -> bool:
    """``directory/config.json`` exists and reads ``text``."""
    try:
        return (directory / "config.json").read_text() == text
    except OSError:
        return False


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings a scheduler is built with."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    block_size: int = 16
    num_kv_blocks: int = 65536
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    #: vLLM's ``watermark``: fraction of KV blocks kept free for admissions.
    watermark: float = 0.0
    #: Draft tokens per step (an ``ngram`` speculator); 0: none.
    num_speculative_tokens: int = 0
    #: LoRA adapters per batch; 0: LoRA off.
    max_loras: int = 0
    #: vLLM's prefill cadence: prefills at most every this many steps while
    #: decodes run (data-parallel engines; since vLLM 0.33 a single one too).
    prefill_schedule_interval: int = 1
    neuron_config: dict[str, Any] | None = None
    #: ``kv_connector_extra_config`` of a ``SimulatedKVConnector`` (remote
    #: KV hits, async loads, lookups not ready); ``None``: no connector.
    kv_connector: dict[str, Any] | None = None

    @property
    def limits(self) -> EngineLimits:
        """The limits a ``neuron_config`` is checked against."""
        return EngineLimits(
            self.max_num_batched_tokens, self.max_model_len, self.max_num_seqs
        )


def build_vllm_config(settings: EngineSettings) -> VllmConfig:
    model_config = ModelConfig(
        model=config_only_model_dir(),
        skip_tokenizer_init=True,
        max_model_len=settings.max_model_len,
        dtype="float32",
        seed=0,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        enable_chunked_prefill=settings.enable_chunked_prefill,
        is_encoder_decoder=False,
        policy=settings.policy,  # type: ignore[arg-type]
        watermark=settings.watermark,
        prefill_schedule_interval=settings.prefill_schedule_interval,
    )
    cache_config = CacheConfig(
        block_size=settings.block_size,
        enable_prefix_caching=settings.enable_prefix_caching,
    )
    additional: dict[str, Any] = {}
    if settings.neuron_config is not None:
        additional["neuron_config"] = settings.neuron_config
    kv_transfer_config = None
    if settings.kv_connector is not None:
        from neuron_scheduler.offline import sim_connector

        kv_transfer_config = KVTransferConfig(
            kv_connector=sim_connector.CONNECTOR_NAME,
            kv_connector_module_path=sim_connector.CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_connector_extra_config=dict(settings.kv_connector),
        )
    speculative_config = None
    if settings.num_speculative_tokens:
        speculative_config = SpeculativeConfig(
            model="ngram",
            method="ngram",
            num_speculative_tokens=settings.num_speculative_tokens,
            prompt_lookup_max=settings.num_speculative_tokens,
            prompt_lookup_min=1,
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        # Explicit: a vLLM built without a device (vLLM 0.33 here) cannot
        # infer one, and the scheduler needs none.
        device_config=DeviceConfig(device="cpu"),
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        speculative_config=speculative_config,
        lora_config=(
            LoRAConfig(max_loras=settings.max_loras) if settings.max_loras else None
        ),
        additional_config=additional,
    )
    vllm_config.cache_config.num_gpu_blocks = settings.num_kv_blocks
    return vllm_config


def build_scheduler(
    scheduler_cls: type[Scheduler], settings: EngineSettings, log_stats: bool = False
) -> Scheduler:
    """A real ``scheduler_cls`` over a real ``KVCacheManager``."""
    vllm_config = build_vllm_config(settings)
    kv_cache_config = KVCacheConfig(
        num_blocks=settings.num_kv_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn"],
                FullAttentionSpec(
                    block_size=settings.block_size,
                    num_kv_heads=1,
                    head_size=32,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=settings.block_size,
        log_stats=log_stats,
    )


@cache
def _block_hasher(block_size: int) -> Any:
    """vLLM's request block hasher, with its ``NONE_HASH`` set once per
    process as vLLM's engine sets it (before 0.29 each setting drew a new
    random seed without ``PYTHONHASHSEED``, so no two requests would share
    a prefix)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int,
    *,
    arrival_time: float | None = None,
    priority: int = 0,
    block_size: int = 16,
    enable_prefix_caching: bool = False,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Request:
    """A vLLM ``Request`` that generates exactly ``max_tokens`` tokens
    (``kv_transfer_params``: what a P/D proxy passes the KV connector)."""
    block_hasher = _block_hasher(block_size) if enable_prefix_caching else None
    extra_args = (
        {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    )
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args
        ),
        pooling_params=None,
        arrival_time=arrival_time,
        priority=priority,
        block_hasher=block_hasher,
    )


def synthetic_token(request_id: str, position: int) -> int:
    """Deterministic fake sampled token: the same request and position
    always yield the same id."""
    return (zlib.crc32(request_id.encode()) + 7919 * position) % (VOCAB_SIZE - 1) + 1


def synthetic_model_output(
    output: SchedulerOutput,
    prompt_len_of: dict[str, int],
    finished_recving: set[str] | None = None,
    finished_sending: set[str] | None = None,
) -> ModelRunnerOutput:
    """What a model runner would return: one sampled token for each request
    whose step reaches the end of its prompt (last prefill chunk or decode),
    nothing for a partial prefill chunk; ``finished_recving`` /
    ``finished_sending``: the async KV loads / sends that completed."""
    computed_before = {
        new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs
    }
    cached = output.scheduled_cached_reqs
    computed_before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    req_ids = list(output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        end = computed_before[req_id] + output.num_scheduled_tokens[req_id]
        if end >= prompt_len_of[req_id]:
            sampled.append([synthetic_token(req_id, end)])
        else:
            sampled.append([])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=(
            KVConnectorOutput(
                finished_sending=finished_sending or None,
                finished_recving=finished_recving or None,
            )
            if finished_recving or finished_sending
            else None
        ),
    )


def apply_step(
    scheduler: Scheduler,
    output: SchedulerOutput,
    prompt_len_of: dict[str, int],
    finished_recving: set[str] | None = None,
    finished_sending: set[str] | None = None,
) -> list[EngineCoreOutput]:
    """The engine core's half of a step without a model: apply
    ``synthetic_model_output`` of ``output`` to ``scheduler`` and return
    what the engine core would emit, every client's outputs in one list.
    The one step primitive the offline engine and the simulator share."""
    model_output = synthetic_model_output(
        output, prompt_len_of, finished_recving, finished_sending
    )
    engine_outputs = scheduler.update_from_output(output, model_output)
    return [item for outputs in engine_outputs.values() for item in outputs.outputs]


@dataclass
class StepResult:
    """One executed step: the scheduler output and the tokens it produced."""

    output: SchedulerOutput
    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)


class OfflineEngine:
    """Drives a scheduler without a model, like vLLM's ``EngineCore``.

    ``pipelined=False``: ``schedule`` then ``update_from_output`` each step.
    ``pipelined=True``: a batch queue of two, as the async engine core with
    ``async_scheduling`` keeps: step N+1 is scheduled before step N's output
    is applied. With a ``SimulatedKVConnector`` it also plays the worker's
    part in KV loads: each async load a step starts is reported finished
    (``finished_recving``) ``load_steps`` applied steps later.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        pipelined: bool = False,
        on_schedule: Callable[[SchedulerOutput], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.pipelined = pipelined
        #: Called with each output right after ``schedule()`` (checks).
        self.on_schedule = on_schedule
        self.prompt_len_of: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self._in_flight: deque[SchedulerOutput] = deque()
        #: request id -> applied steps until its async KV load completes
        self.loads_in_flight: dict[str, int] = {}
        self._block_size = scheduler.block_size
        self._prefix_caching = bool(scheduler.cache_config.enable_prefix_caching)

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Request:
        """Add a request; ``kv_transfer_params`` are per-request settings of
        the ``SimulatedKVConnector`` (see ``sim_connector``)."""
        request = make_request(
            request_id,
            prompt_token_ids,
            max_tokens,
            arrival_time=arrival_time,
            priority=priority,
            block_size=self._block_size,
            enable_prefix_caching=self._prefix_caching,
        )
        request.kv_transfer_params = kv_transfer_params
        self.prompt_len_of[request_id] = len(prompt_token_ids)
        self.requests[request_id] = request
        self.tokens[request_id] = []
        self.scheduler.add_request(request)
        return request

    def abort(self, request_ids: Iterable[str]) -> None:
        from vllm.v1.request import RequestStatus

        ids = list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for request_id in ids:
            self.finished.setdefault(request_id, "abort")

    @property
    def num_preemptions(self) -> int:
        """Preemptions suffered by all requests added so far."""
        return sum(r.num_preemptions for r in self.requests.values())

    def has_work(self) -> bool:
        return (
            bool(self._in_flight)
            or bool(self.loads_in_flight)
            or self.scheduler.has_requests()
        )

    def step(self) -> tuple[SchedulerOutput | None, StepResult | None]:
        """Run one engine iteration.

        Returns ``(scheduled, applied)``: the output scheduled in this
        iteration (if any) and the step whose model output was applied (if
        any). In lock-step mode both refer to the same step.
        """
        scheduled = None
        if self.scheduler.has_requests() or self.loads_in_flight:
            scheduled = self.scheduler.schedule()
            if self.on_schedule is not None:
                self.on_schedule(scheduled)
            self._in_flight.append(scheduled)
            if (
                self.pipelined
                and len(self._in_flight) < 2
                and (
                    scheduled.total_num_scheduled_tokens > 0
                    or self.scheduler.has_requests()
                )
            ):
                return scheduled, None
        if not self._in_flight:
            return scheduled, None
        return scheduled, self._apply(self._in_flight.popleft())

    def _apply(self, output: SchedulerOutput) -> StepResult:
        from neuron_scheduler.offline.sim_connector import SimulatedKVMetadata

        meta = output.kv_connector_metadata
        if isinstance(meta, SimulatedKVMetadata):
            self.loads_in_flight.update(meta.loads_started)
        done = set()
        for request_id, steps_left in list(self.loads_in_flight.items()):
            if steps_left <= 1:
                done.add(request_id)
                del self.loads_in_flight[request_id]
            else:
                self.loads_in_flight[request_id] = steps_left - 1
        result = StepResult(output)
        for item in apply_step(self.scheduler, output, self.prompt_len_of, done):
            if item.new_token_ids:
                self.tokens[item.request_id].extend(item.new_token_ids)
                result.new_tokens[item.request_id] = list(item.new_token_ids)
            if item.finish_reason is not None:
                self.finished[item.request_id] = str(item.finish_reason)
                result.finished.append(item.request_id)
        return result

    def run(self, max_steps: int = 100_000) -> int:
        """Step until no work is left; return the number of iterations.

        Raises ``RuntimeError`` if work remains after ``max_steps``.
        """
        for iteration in range(max_steps):
            if not self.has_work():
                return iteration
            self.step()
        raise RuntimeError(
            f"scheduler made no final progress: work left after {max_steps} steps "
            f"({self.scheduler.get_request_counts()} running/waiting)"
        )
