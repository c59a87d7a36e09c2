"""Roofline cost model of a static-shape accelerator running one LLM.

Step time = fixed overhead + max(compute time, memory time), where compute
is FLOPs / (peak x compute efficiency) and memory is bytes moved /
(HBM bandwidth x bandwidth efficiency). Shapes are what the compiled graph
runs (padded), not what the requests need.

Sources of the constants:
* trn2: AWS Trainium2 product page / Neuron docs "Trainium2 architecture":
  per chip 8 NeuronCore-v3 (4 logical cores at the default LNC=2), 667 dense
  BF16 TFLOP/s, 96 GiB HBM at 2.9 TB/s.
* trn1: Neuron docs "Trainium architecture": per chip 2 NeuronCore-v2,
  190 BF16 TFLOP/s, 32 GiB HBM at 820 GB/s.
* inf2: Neuron docs "Inferentia2 architecture": per chip 2 NeuronCore-v2,
  190 BF16 TFLOP/s, 32 GiB HBM at 820 GB/s.
* Llama-3.1-8B / 70B: their Hugging Face ``config.json`` (layers, hidden,
  heads, KV heads, head_dim 128, vocab 128256) and parameter counts (8.03B,
  70.6B).
* Efficiencies and overhead: fitted to optimum-neuron's published vLLM
  benchmark of Llama-3.1-8B on trn2 at TP 4 (one chip): ITL ~22 ms at 1
  concurrent user, ~44.5 ms at 32, TTFT ~197 ms for a ~1500-token prompt at
  1 user. That benchmark's decode graphs cover 4096 positions
  (``CALIBRATION_MAX_MODEL_LEN``) and its prefill pads 1500 to a 2048 bucket.
  The fit: decode is bandwidth bound (weights + KV up to 4096 positions per
  sequence), 32 users double the bytes and the time, giving ~26% effective
  bandwidth; prefill is compute bound at ~26% of peak. ``tests`` check the
  three points within +-15%.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_BF16 = 2
TERA = 1e12
GIGA = 1e9
GIB = 1 << 30


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator chip; ``cores_per_chip`` counts the cores a
    tensor-parallel rank maps to."""

    name: str
    bf16_tflops_per_chip: float
    hbm_gb_per_s_per_chip: float
    hbm_gib_per_chip: float
    cores_per_chip: int
    compute_efficiency: float = 0.26
    bandwidth_efficiency: float = 0.262
    step_overhead_s: float = 0.001
    #: Share of HBM usable for weights + KV (runtime, activations, graphs).
    usable_hbm_fraction: float = 0.9


@dataclass(frozen=True)
class ModelProfile:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: float

    @property
    def weight_bytes(self) -> float:
        return self.num_params * BYTES_BF16

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer, BF16."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * BYTES_BF16


HARDWARE = {
    "trn2": HardwareProfile("trn2", 667.0, 2900.0, 96.0, cores_per_chip=4),
    "trn1": HardwareProfile("trn1", 190.0, 820.0, 32.0, cores_per_chip=2),
    "inf2": HardwareProfile("inf2", 190.0, 820.0, 32.0, cores_per_chip=2),
}

MODELS = {
    "llama-3.1-8b": ModelProfile("llama-3.1-8b", 32, 4096, 32, 8, 128, 8.03e9),
    "llama-3.1-70b": ModelProfile("llama-3.1-70b", 80, 8192, 64, 8, 128, 70.6e9),
}

#: Positions the calibration benchmark's decode graphs cover.
CALIBRATION_MAX_MODEL_LEN = 4096


class CostModelError(ValueError):
    pass


@dataclass(frozen=True)
class CostModel:
    """Step times for one model on ``tensor_parallel_size`` cores."""

    hardware: HardwareProfile
    model: ModelProfile
    tensor_parallel_size: int = 4

    @classmethod
    def named(cls, hardware: str, model: str, tensor_parallel_size: int) -> CostModel:
        if hardware not in HARDWARE:
            raise CostModelError(
                f"unknown --hardware {hardware!r}; known: {sorted(HARDWARE)}"
            )
        if model not in MODELS:
            raise CostModelError(f"unknown --model {model!r}; known: {sorted(MODELS)}")
        if tensor_parallel_size <= 0:
            raise CostModelError(
                f"--tensor-parallel-size must be positive, got {tensor_parallel_size}"
            )
        return cls(HARDWARE[hardware], MODELS[model], tensor_parallel_size)

    @property
    def num_chips(self) -> float:
        return self.tensor_parallel_size / self.hardware.cores_per_chip

    @property
    def peak_flops(self) -> float:
        return self.hardware.bf16_tflops_per_chip * TERA * self.num_chips

    @property
    def bandwidth(self) -> float:
        return self.hardware.hbm_gb_per_s_per_chip * GIGA * self.num_chips

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache that fit beside the weights."""
        hbm = self.hardware.hbm_gib_per_chip * GIB * self.num_chips
        free = hbm * self.hardware.usable_hbm_fraction - self.model.weight_bytes
        if free <= 0:
            raise CostModelError(
                f"{self.model.name} weights ({self.model.weight_bytes / GIB:.0f} GiB) "
                f"do not fit on {self.hardware.name} at tensor parallel "
                f"{self.tensor_parallel_size}"
            )
        return int(free // self.model.kv_bytes_per_token)

    def _time(self, flops: float, bytes_moved: float) -> float:
        hw = self.hardware
        compute = flops / (self.peak_flops * hw.compute_efficiency)
        memory = bytes_moved / (self.bandwidth * hw.bandwidth_efficiency)
        return hw.step_overhead_s + max(compute, memory)

    def _attention_flops(self, new_tokens: float, context_before: float) -> float:
        """QK^T and PV for ``new_tokens`` attending to ``context_before`` earlier
        tokens plus themselves (causal)."""
        m = self.model
        return (
            4.0
            * m.num_layers
            * m.num_heads
            * m.head_dim
            * new_tokens
            * (context_before + new_tokens / 2)
        )

    def prefill_time(self, padded_tokens: int, context_before: int = 0) -> float:
        """One prefill graph of ``padded_tokens`` after ``context_before``
        already-computed tokens (chunked prefill / prefix-cache hits)."""
        return self.packed_prefill_time([(padded_tokens, context_before)])

    def packed_prefill_time(self, chunks: list[tuple[int, int]]) -> float:
        """One prefill graph running several prompts concatenated: ``chunks``
        are (tokens, context_before) per prompt, padding counted in the last
        one's tokens. Attention is per prompt (block-diagonal)."""
        m = self.model
        tokens = sum(t for t, _ in chunks)
        flops = 2 * m.num_params * tokens
        kv_tokens = 0
        for new, before in chunks:
            flops += self._attention_flops(new, before)
            kv_tokens += before + new
        return self._time(flops, m.weight_bytes + m.kv_bytes_per_token * kv_tokens)

    def decode_time(self, padded_batch: int, context_len_read: int) -> float:
        """One decode graph for ``padded_batch`` sequences, each one new token
        reading KV for ``context_len_read`` positions (static graphs read their
        whole block table: the context bucket, ``max_model_len`` without
        buckets)."""
        m = self.model
        flops = 2 * m.num_params * padded_batch + padded_batch * self._attention_flops(
            1, context_len_read
        )
        bytes_moved = m.weight_bytes + m.kv_bytes_per_token * padded_batch * (
            context_len_read
        )
        return self._time(flops, bytes_moved)

    def mixed_time(
        self, prefill_chunks: list[tuple[int, int]], decode_contexts: list[int]
    ) -> float:
        """A dynamic-shape step (no padding): prefill chunks as (tokens,
        context_before) and decodes by their actual context length."""
        m = self.model
        tokens = sum(t for t, _ in prefill_chunks) + len(decode_contexts)
        flops = 2 * m.num_params * tokens
        kv_tokens = 0
        for new, before in prefill_chunks:
            flops += self._attention_flops(new, before)
            kv_tokens += before + new
        for context in decode_contexts:
            flops += self._attention_flops(1, context)
            kv_tokens += context
        return self._time(flops, m.weight_bytes + m.kv_bytes_per_token * kv_tokens)
