"""What a simulated run is set up with: the cost model it charges (the
roofline model of a named accelerator and model, or a profile measured on a
real engine), the engine settings, and the policies it compares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from neuron_scheduler.config import NeuronConfig
from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.sim.cost_model import CostModel, CostModelError, RooflineCostModel
from neuron_scheduler.sim.policies import SEED, UNCONSTRAINED, Policy
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.workload import FitReport

#: Engine of the roofline model (a profile brings its own); its KV cache is
#: what fits beside the weights.
ROOFLINE_ENGINE = EngineSettings(
    max_num_seqs=32, max_num_batched_tokens=8192, max_model_len=8192, block_size=32
)
#: The settings a profile fixes and an explicit choice may not contradict.
PROFILED_FIELDS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "block_size",
)
ROOFLINE_HARDWARE, ROOFLINE_MODEL, ROOFLINE_TP = "trn2", "llama-3.1-8b", 4
#: The choices that name a roofline model.
ROOFLINE_CHOICES = ("hardware", "model", "tensor_parallel_size")


def cost_model_for(
    hardware: str,
    model: str,
    tensor_parallel_size: int,
    profile: str | None = None,
    *,
    interpolate: bool = False,
) -> CostModel:
    """The measured profile at ``profile`` if given, else the roofline model
    of ``hardware`` and ``model``."""
    if profile is not None:
        return ProfileCostModel.load(profile, interpolate=interpolate)
    return RooflineCostModel.named(hardware, model, tensor_parallel_size)


@dataclass(frozen=True)
class EngineChoice:
    """The engine and cost model a run asks for; ``None``: the default (the
    roofline engine's, or with ``cost_profile`` the profiled engine's)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = False
    hardware: str | None = None
    model: str | None = None
    tensor_parallel_size: int | None = None
    cost_profile: str | None = None
    interpolate: bool = False


def engine_setup(choice: EngineChoice) -> tuple[CostModel, EngineSettings]:
    """The cost model and engine settings ``choice`` names;
    ``CostModelError`` where a choice contradicts the profile's engine."""
    if choice.cost_profile is None:
        cost = cost_model_for(
            choice.hardware or ROOFLINE_HARDWARE,
            choice.model or ROOFLINE_MODEL,
            choice.tensor_parallel_size or ROOFLINE_TP,
        )
        engine = {
            key: getattr(choice, key) or getattr(ROOFLINE_ENGINE, key)
            for key in PROFILED_FIELDS
        }
        blocks = (
            choice.num_kv_blocks or cost.kv_capacity_tokens() // engine["block_size"]
        )
    else:
        cost, engine, blocks = _profiled_engine(choice)
    settings = replace(
        ROOFLINE_ENGINE,
        **engine,
        num_kv_blocks=blocks,
        enable_prefix_caching=choice.enable_prefix_caching,
    )
    return cost, settings


def _profiled_engine(choice: EngineChoice) -> tuple[CostModel, dict[str, int], int]:
    chosen = [k for k in ROOFLINE_CHOICES if getattr(choice, k) is not None]
    if chosen:
        raise CostModelError(
            f"--{chosen[0].replace('_', '-')} names a roofline model; with "
            "--cost-profile the profiled engine is the model"
        )
    cost = cost_model_for(
        ROOFLINE_HARDWARE,
        ROOFLINE_MODEL,
        ROOFLINE_TP,
        profile=choice.cost_profile,
        interpolate=choice.interpolate,
    )
    assert isinstance(cost, ProfileCostModel)
    profiled = cost.profile.engine
    engine = {}
    for key in PROFILED_FIELDS:
        given, measured = getattr(choice, key), int(profiled[key])
        if given is not None and given != measured:
            raise CostModelError(
                f"--{key.replace('_', '-')} {given} does not match the profile "
                f"{choice.cost_profile} ({key} {measured})"
            )
        engine[key] = measured
    blocks = choice.num_kv_blocks or int(cost.profile.kv_cache["num_blocks"])
    return cost, engine, blocks


def check_profile_covers(
    cost: CostModel, settings: EngineSettings, chosen: Sequence[Policy]
) -> None:
    """With a profile and no ``interpolate``: every bucket shape a static
    policy can produce must be profiled (``CostModelError`` before
    simulating)."""
    if not isinstance(cost, ProfileCostModel) or cost.interpolate:
        return
    for policy in chosen:
        if not policy.static_shapes:
            continue
        config = NeuronConfig.from_dict(policy.neuron_config or {}, settings.limits)
        missing = cost.missing_shapes(
            config.num_batched_tokens_buckets,
            config.num_seqs_buckets,
            config.decode_context_length_buckets,
        )
        if missing:
            raise CostModelError(
                f"policy {policy.label!r} needs shapes the profile lacks: "
                f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}; "
                "profile that configuration, or pass --interpolate"
            )


def policies(
    names: Sequence[str], configs: Sequence[tuple[str, dict[str, Any]]]
) -> list[Policy]:
    """The policies named (``seed``, ``unconstrained``), then a
    ``NeuronScheduler`` per labelled ``neuron_config``; both when none."""
    chosen = [SEED if name == "seed" else UNCONSTRAINED for name in names]
    chosen += [Policy(label, NeuronScheduler, config) for label, config in configs]
    return chosen or [SEED, UNCONSTRAINED]


def describe_setup(
    workload: str,
    cost: CostModel,
    settings: EngineSettings,
    num_requests: int,
    fit: FitReport,
) -> str:
    """One line naming the workload, what fitting it changed, the cost
    model and the engine."""
    fitted = (
        f"; {fit.rejected} rejected (prompt >= max_model_len), "
        f"{fit.outputs_capped} outputs capped, {fit.clipped} clipped"
        if fit.rejected or fit.outputs_capped or fit.clipped
        else ""
    )
    return (
        f"workload: {num_requests} requests ({workload}){fitted}; "
        f"{cost.describe()}; KV {settings.num_kv_blocks} blocks of "
        f"{settings.block_size}; max_num_seqs {settings.max_num_seqs}, "
        f"max_model_len {settings.max_model_len}, max_num_batched_tokens "
        f"{settings.max_num_batched_tokens}"
    )
