"""The ``decode_split_break_even_positions`` a cost model implies.

A decode step's time on a static graph grows with the KV positions it
reads (rows x context bucket) on top of a fixed part (weights, launch,
collectives). The break-even is that fixed part in positions: splitting a
batch in two (``neuron_scheduler.decode_groups``) pays when it saves more
positions than this. Both parts are read off the cost model at the largest
batch: the slope between two contexts, and the time extrapolated to
context 0.
"""

from __future__ import annotations

from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.sim.cost_model import CostModel, StepShape

#: The ``neuron_config`` key the break-even goes under.
SPLIT_KEY = "decode_split_break_even_positions"


def decode_seconds(cost: CostModel, rows: int, context: int) -> float:
    """A static decode step of ``rows`` real rows at ``context`` (counts
    nothing)."""
    return cost.estimate(StepShape((), rows, context, True, context, rows))


def break_even_positions(cost: CostModel, settings: EngineSettings) -> int:
    """One decode step's fixed cost in KV positions read, at
    ``max_num_seqs`` rows between contexts of a quarter of
    ``max_model_len`` (at most 8192) and ``max_model_len``; at least 1.
    Raises ``ValueError`` if the cost model's decode time does not grow
    with context."""
    rows = settings.max_num_seqs
    high = settings.max_model_len
    low = max(1, min(8192, high // 4))
    t_low, t_high = (decode_seconds(cost, rows, c) for c in (low, high))
    slope = (t_high - t_low) / (rows * (high - low))  # seconds per position
    if slope <= 0:
        raise ValueError(
            f"the cost model's decode step does not grow with context "
            f"({t_low:.6f} s at {low}, {t_high:.6f} s at {high}, {rows} rows): "
            "no break-even to derive"
        )
    fixed = t_low - slope * rows * low
    return max(1, round(fixed / slope))
