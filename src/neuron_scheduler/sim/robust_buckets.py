"""Buckets that hold on tomorrow's traffic, not only on the sample.

``optimal_buckets`` finds the exact optimum for the values it is given; on
one sample that optimum ends at the sample's largest value, and the next
bucket is the required maximum. Traffic from the same source holds a longer
request sooner or later, and every such step pays the jump (a decode at a
context of 7,000 reads 131,072 positions per row). ``robust_buckets``
chooses for the traffic the sample stands for instead:

1. **Expected cost over a tail model.** Below the sample's largest value the
   distribution is the sample's own; above it, a log-normal fitted to the
   sample (weighted mean and deviation of the log values, the deviation at
   least ``MIN_LOG_DEVIATION``) gives each of ``TAIL_STEPS_PER_OCTAVE``
   steps per octave up to the maximum the weight it expects there. The
   exact optimum over both (``optimal_buckets``) is the choice of least
   expected padding: it places buckets above the sample's range where the
   fitted tail is heavy enough to pay for them.
2. **No cliff above that.** Between the optimum's last bucket below the
   maximum and the maximum, a geometric ladder with a ratio of at most
   ``MAX_LADDER_RATIO`` (its buckets come out of the count, at most a
   quarter of it, and the optimum is taken again with what is left): a
   step beyond everything the model expected pads at most that much
   instead of to the maximum.

Measured (docs/benchmark.md, "Robust tuning"): tuned on the built-in
workload's 200-request sample, on fresh samples of the same source robust
buckets reach at least 0.95x each sample's own exact optimum, where the
sample-exact buckets fell to 0.3-0.5x.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from neuron_scheduler.buckets import align_up, optimal_buckets

#: Grid of the fitted tail above the sample's largest value.
TAIL_STEPS_PER_OCTAVE = 8
#: The fitted tail's narrowest spread (log space): a sample of one value.
MIN_LOG_DEVIATION = 0.05
#: The largest ratio between consecutive buckets above the tail model's.
MAX_LADDER_RATIO = 4.0


def _normal_tail(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def tail_model(
    values: Sequence[int], weights: Sequence[float], maximum: int
) -> tuple[list[int], list[float]]:
    """Points above ``max(values)`` up to ``maximum`` and the weight a
    log-normal fitted to the sample expects at each (a share of the
    sample's total weight); empty where nothing is above."""
    total = sum(weights)
    if total <= 0 or not values:
        return [], []
    logs = [math.log(max(v, 1)) for v in values]
    mean = sum(w * x for w, x in zip(weights, logs, strict=True)) / total
    variance = sum(w * (x - mean) ** 2 for w, x in zip(weights, logs, strict=True))
    deviation = max(MIN_LOG_DEVIATION, math.sqrt(variance / total))
    points: list[int] = []
    expected: list[float] = []
    low = float(max(values))
    step = 2.0 ** (1.0 / TAIL_STEPS_PER_OCTAVE)
    while low < maximum:
        high = min(float(maximum), low * step)
        share = _normal_tail((math.log(low) - mean) / deviation) - _normal_tail(
            (math.log(high) - mean) / deviation
        )
        if share > 0:
            points.append(min(maximum, math.ceil(math.sqrt(low * high))))
            expected.append(total * share)
        low = high
    return points, expected


def ladder_sizes(last: int, maximum: int, max_count: int, align: int) -> list[int]:
    """The fewest buckets strictly between ``last`` and ``maximum`` (at
    most ``max_count``) that keep each ratio within ``MAX_LADDER_RATIO``,
    at equal ratios; aligned."""
    if max_count < 1 or maximum <= MAX_LADDER_RATIO * last:
        return []
    needed = math.ceil(math.log(maximum / last, MAX_LADDER_RATIO)) - 1
    count = min(needed, max_count)
    ratio = (maximum / last) ** (1.0 / (count + 1))
    sizes = {align_up(round(last * ratio**k), align) for k in range(1, count + 1)}
    return sorted(s for s in sizes if last < s < maximum)


def robust_buckets(
    values: Sequence[int],
    weights: Sequence[float],
    max_buckets: int,
    maximum: int,
    align: int = 1,
) -> tuple[int, ...]:
    """At most ``max_buckets`` buckets ending at ``maximum`` (every other a
    multiple of ``align``) for the traffic the ``values`` sample: the least
    expected padding under the tail model, then the ladder (see the
    module). ``ValueError`` as ``optimal_buckets``."""
    if max_buckets < 1:
        raise ValueError(f"max_buckets must be >= 1, got {max_buckets!r}")
    tail, expected = tail_model(values, weights, maximum)
    points, spread = [*values, *tail], [*weights, *expected]
    body = optimal_buckets(points, spread, max_buckets, maximum, align)
    if len(body) < 2:
        return body
    room = min(max_buckets // 4, len(ladder_sizes(body[-2], maximum, max_buckets, 1)))
    if room < 1:
        return body
    body = optimal_buckets(points, spread, max_buckets - room, maximum, align)
    if len(body) < 2:
        return body
    ladder = ladder_sizes(body[-2], maximum, room, align)
    return tuple(sorted({*body[:-1], *ladder})) + (maximum,)
