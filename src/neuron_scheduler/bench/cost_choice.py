"""Which cost model a run charges: the roofline model of a named
accelerator and model, or a profile measured on a real engine."""

from __future__ import annotations

from neuron_scheduler.bench.cost_model import CostModel, RooflineCostModel
from neuron_scheduler.bench.profile_cost import ProfileCostModel


def cost_model_for(
    hardware: str,
    model: str,
    tensor_parallel_size: int,
    profile: str | None = None,
    *,
    interpolate: bool = False,
) -> CostModel:
    """The cost model the bench's options name: the measured profile at
    ``profile`` if given, else the roofline model of ``hardware`` and
    ``model``."""
    if profile is not None:
        return ProfileCostModel.load(profile, interpolate=interpolate)
    return RooflineCostModel.named(hardware, model, tensor_parallel_size)
