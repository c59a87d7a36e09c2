"""Cost models: what one engine step costs on the accelerator.

``CostModel`` is the interface the simulator charges: a step time for a
``StepShape`` and the KV capacity. Two models plug in: ``RooflineCostModel``
(below, the default: published hardware figures) and
``sim.profile_cost.ProfileCostModel`` (step times measured on a real engine
by ``neuron-scheduler profile``); ``sim.run_setup.cost_model_for``
picks one.

Roofline: step time = fixed overhead + max(compute time, memory time) +
collective time, where compute is FLOPs / (peak x compute efficiency),
memory is bytes moved / (HBM bandwidth x bandwidth efficiency), and
collectives are the two all-reduces per layer of tensor parallelism when
it spans more than one chip (latency + ring traffic over the chip link).
Shapes are what the compiled graph runs (padded), not what the requests
need.

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
* Efficiencies, per chip generation, from optimum-neuron's published
  single-user runs of Llama-3.1-8B (``sim.published``: every point, its
  source, and the simulator's answer), with the engine those runs used
  (``Execution.GRAPH_PER_PHASE``: a decode graph at the compiled batch of
  32 or 4 over a power-of-two context bucket, here 2048, and a 2048-token
  context-encoding graph for a ~1500-token prompt):
  trn2 (TP 4, one chip): ITL 22.1 ms -> bandwidth 0.403, TTFT 197 ms ->
  compute 0.26. inf2 (TP 2, one chip): ITL 50.7 ms -> bandwidth 0.42, TTFT
  1058 ms -> compute 0.169; its TP 8 run over 4 chips (ITL 23.9 ms, TTFT
  310 ms) gives the cross-chip collective: ~79 us per all-reduce and
  ~45 GB/s of ring bandwidth. trn1 has inf2's NeuronCore-v2 and takes its
  values; trn2 takes inf2's collective values until a published multi-chip
  trn2 run measures them. Every loaded point (up to 128 users) is then a
  prediction of the simulator, not a fit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

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
    compute_efficiency: float
    bandwidth_efficiency: float
    step_overhead_s: float = 0.001
    #: Share of HBM usable for weights + KV (runtime, activations, graphs).
    usable_hbm_fraction: float = 0.9
    #: One all-reduce between chips: fixed latency, and the ring's
    #: effective bandwidth per rank (tensor parallelism over several chips).
    collective_latency_s: float = 79e-6
    collective_gb_per_s: float = 45.0


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


#: NeuronCore-v2 efficiencies (inf2 and trn1 share the core).
_V2_COMPUTE, _V2_BANDWIDTH = 0.169, 0.42

HARDWARE = {
    "trn2": HardwareProfile(
        "trn2", 667.0, 2900.0, 96.0, 4, compute_efficiency=0.26,
        bandwidth_efficiency=0.403,
    ),
    "trn1": HardwareProfile(
        "trn1", 190.0, 820.0, 32.0, 2, compute_efficiency=_V2_COMPUTE,
        bandwidth_efficiency=_V2_BANDWIDTH,
    ),
    "inf2": HardwareProfile(
        "inf2", 190.0, 820.0, 32.0, 2, compute_efficiency=_V2_COMPUTE,
        bandwidth_efficiency=_V2_BANDWIDTH,
    ),
}  # fmt: skip

MODELS = {
    "llama-3.1-8b": ModelProfile("llama-3.1-8b", 32, 4096, 32, 8, 128, 8.03e9),
    "llama-3.1-70b": ModelProfile("llama-3.1-70b", 80, 8192, 64, 8, 128, 70.6e9),
}


class CostModelError(ValueError):
    pass


@dataclass(frozen=True)
class StepShape:
    """What one engine step computes, as a cost model charges it.

    ``prefill_chunks``: (tokens, context_before) per prompt chunk; in a
    static prefill step the padding is counted in the last chunk.
    ``decode_rows``: rows computing one position each (a static step counts
    its dummy rows); ``decode_context``: positions each row reads (a static
    graph: the context bucket; a dynamic step: the rows' mean context);
    ``decode_context_actual``: the real rows' mean context (what an
    attention kernel that is not padded reads; 0: same as
    ``decode_context``), and ``decode_rows_actual`` how many rows are real
    (0: all; such a kernel reads nothing for a dummy row). ``static``: the
    shapes are a compiled graph's (padded), not a dynamic step's.
    ``prefill_tokens_actual``: the real tokens of a static prefill (0: the
    padded count; an attention kernel that is not padded runs only them).
    """

    prefill_chunks: tuple[tuple[int, int], ...] = ()
    decode_rows: int = 0
    decode_context: float = 0.0
    static: bool = True
    decode_context_actual: float = 0.0
    decode_rows_actual: int = 0
    prefill_tokens_actual: int = 0

    @property
    def prefill_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.prefill_chunks)


class CostModel(ABC):
    """Step times and KV capacity of one model on one accelerator."""

    @abstractmethod
    def step_time(self, shape: StepShape, engine: int = 0) -> float:
        """Seconds one engine step of ``shape`` takes on engine ``engine``
        of a fleet (a model whose charges vary from step to step keeps
        each engine's apart, so that the steps of one engine decide its
        charges, whatever process steps it)."""

    @abstractmethod
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the accelerator holds."""

    @abstractmethod
    def describe(self) -> str:
        """One line naming the model, for reports."""

    def kv_bytes_per_token(self) -> int | None:
        """Bytes of KV cache one token holds (what a P/D transfer moves per
        prompt token), or ``None`` where the model does not know."""
        return None

    def mean_step_time(self, shape: StepShape) -> float:
        """Seconds a step of ``shape`` takes on average: ``step_time`` less
        the step-to-step variation a model may draw (a price for comparing
        shapes, not one step's charge); it refuses what ``step_time``
        refuses and counts what it charges."""
        return self.step_time(shape)

    def estimate(self, shape: StepShape) -> float:
        """Seconds a step of ``shape`` would take, for a counterfactual (the
        time breakdown's unpadded shapes): like ``step_time``, but nothing
        is counted as charged, and a model that refuses shapes it lacks
        interpolates them."""
        return self.step_time(shape)

    def report(self) -> dict[str, Any]:
        """What the model has to say about the steps it charged (for the
        JSON report): nothing, unless a model overrides it."""
        return {}

    def add_counts(self, counts: dict[str, Any]) -> None:  # noqa: B027 - optional
        """Add the integer counts of ``report()`` that a copy of this model
        charged in another process (a fleet stepped in several): nothing,
        unless a model counts."""


@dataclass(frozen=True)
class RooflineCostModel(CostModel):
    """Step times for one model on ``tensor_parallel_size`` cores."""

    hardware: HardwareProfile
    model: ModelProfile
    tensor_parallel_size: int = 4

    @classmethod
    def named(
        cls, hardware: str, model: str, tensor_parallel_size: int
    ) -> RooflineCostModel:
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

    def describe(self) -> str:
        return (
            f"roofline: {self.hardware.name} x TP{self.tensor_parallel_size}, "
            f"{self.model.name}"
        )

    @property
    def num_chips(self) -> float:
        return self.tensor_parallel_size / self.hardware.cores_per_chip

    @property
    def peak_flops(self) -> float:
        return self.hardware.bf16_tflops_per_chip * TERA * self.num_chips

    @property
    def bandwidth(self) -> float:
        return self.hardware.hbm_gb_per_s_per_chip * GIGA * self.num_chips

    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

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

    def _time(self, flops: float, bytes_moved: float, tokens: float) -> float:
        hw = self.hardware
        compute = flops / (self.peak_flops * hw.compute_efficiency)
        memory = bytes_moved / (self.bandwidth * hw.bandwidth_efficiency)
        return (
            hw.step_overhead_s + max(compute, memory) + self.collective_seconds(tokens)
        )

    def collective_seconds(self, tokens: float) -> float:
        """Two all-reduces per layer of ``tokens`` x hidden activations, when
        the tensor-parallel ranks span more than one chip (a ring moves
        2 (p - 1) / p of the message per rank)."""
        if self.num_chips <= 1:
            return 0.0
        hw, m, ranks = self.hardware, self.model, self.tensor_parallel_size
        message = tokens * m.hidden_size * BYTES_BF16
        ring = 2 * (ranks - 1) / ranks * message / (hw.collective_gb_per_s * GIGA)
        return 2 * m.num_layers * (hw.collective_latency_s + ring)

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

    def step_time(self, shape: StepShape, engine: int = 0) -> float:
        m = self.model
        flops = 2 * m.num_params * (shape.prefill_tokens + shape.decode_rows)
        kv_tokens = 0.0
        for new, before in shape.prefill_chunks:
            flops += self._attention_flops(new, before)
            kv_tokens += before + new
        if shape.decode_rows:
            # One query token per row over its context (its own included).
            flops += shape.decode_rows * self._attention_flops(1, shape.decode_context)
            kv_tokens += shape.decode_rows * shape.decode_context
        return self._time(
            flops,
            m.weight_bytes + m.kv_bytes_per_token * kv_tokens,
            shape.prefill_tokens + shape.decode_rows,
        )
