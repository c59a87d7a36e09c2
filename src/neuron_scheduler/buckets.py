"""Bucket math: pure functions, no vLLM imports.

A *bucket* list is a strictly ascending tuple of positive ints whose last entry
is the largest shape a compiled graph supports. Static-shape accelerators
compile one graph per bucket; work is padded up to the smallest bucket that
holds it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

#: Smallest default prefill bucket. Graphs below this size save almost no
#: compute on Neuron (the tensor engine works on 128-row tiles).
DEFAULT_MIN_TOKEN_BUCKET = 128


def powers_of_two_buckets(maximum: int, minimum: int = 1) -> tuple[int, ...]:
    """Powers of two from ``minimum`` (rounded up to a power of two) up to
    ``maximum``, with ``maximum`` itself appended when it is not one.

    >>> powers_of_two_buckets(600, 128)
    (128, 256, 512, 600)
    >>> powers_of_two_buckets(8)
    (1, 2, 4, 8)
    """
    if maximum < 1:
        raise ValueError(f"bucket maximum must be >= 1, got {maximum!r}")
    buckets: list[int] = []
    size = 1
    while size < minimum:
        size *= 2
    while size < maximum:
        buckets.append(size)
        size *= 2
    buckets.append(maximum)
    return tuple(buckets)


def default_token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Default prefill token buckets: 128, 256, ... up to ``max_tokens``."""
    return powers_of_two_buckets(max_tokens, DEFAULT_MIN_TOKEN_BUCKET)


def default_seq_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Default decode batch-size buckets: 1, 2, 4, ... up to ``max_num_seqs``."""
    return powers_of_two_buckets(max_num_seqs, 1)


def validate_buckets(key: str, value: object, required_max: int) -> tuple[int, ...]:
    """Check a user-given bucket list and return it as a tuple.

    Raises ``ValueError`` naming ``key`` and the offending value when the list
    is not a non-empty, strictly ascending list of positive ints ending at
    ``required_max``. Nothing is fixed up silently.
    """
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"neuron_config[{key!r}] must be a list of ints, got "
            f"{type(value).__name__} {value!r}"
        )
    if not value:
        raise ValueError(f"neuron_config[{key!r}] must not be empty, got {value!r}")
    for entry in value:
        if isinstance(entry, bool) or not isinstance(entry, int):
            raise ValueError(
                f"neuron_config[{key!r}] entries must be ints, got "
                f"{type(entry).__name__} {entry!r} in {value!r}"
            )
        if entry <= 0:
            raise ValueError(
                f"neuron_config[{key!r}] entries must be positive, got {entry!r} "
                f"in {value!r}"
            )
    for previous, current in zip(value, value[1:], strict=False):
        if current <= previous:
            what = "duplicate" if current == previous else "not ascending"
            raise ValueError(
                f"neuron_config[{key!r}] must be strictly ascending: {current!r} "
                f"after {previous!r} is {what} in {value!r}"
            )
    if value[-1] != required_max:
        raise ValueError(
            f"neuron_config[{key!r}] must end at {required_max} (the largest shape "
            f"the engine can produce), got last entry {value[-1]!r} in {value!r}"
        )
    return tuple(value)


def smallest_bucket(buckets: Sequence[int], size: int) -> int:
    """The smallest bucket ``>= size``.

    Raises ``ValueError`` if ``size`` exceeds the largest bucket: that is a
    scheduler bug (the engine produced a shape no graph was compiled for).
    """
    index = bisect_left(buckets, size)
    if index == len(buckets):
        raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


def padding_cost(
    buckets: Sequence[int], values: Sequence[int], weights: Sequence[float]
) -> float:
    """Total weighted padding: ``sum(w * (smallest_bucket(v) - v))``."""
    return float(
        sum(
            w * (smallest_bucket(buckets, v) - v)
            for v, w in zip(values, weights, strict=True)
        )
    )


def align_up(value: int, align: int) -> int:
    """The smallest multiple of ``align`` that is at least ``value``."""
    return -(-value // align) * align


def aligned_sizes_below(maximum: int, align: int) -> int:
    """How many multiples of ``align`` lie below ``maximum`` (the bucket
    sizes an aligned list can use besides the maximum)."""
    return (maximum - 1) // align


def optimal_buckets(
    values: Sequence[int],
    weights: Sequence[float],
    max_buckets: int,
    maximum: int,
    align: int = 1,
) -> tuple[int, ...]:
    """The bucket list of at most ``max_buckets`` entries, last = ``maximum``,
    every other entry a multiple of ``align``, that minimises
    ``padding_cost`` over the observed ``values`` (each with its weight: how
    often it occurs, or what a padded unit costs there).

    Exact: an optimal list only uses the aligned ceilings of observed values
    (moving a bucket down to the smallest aligned size that still covers
    the largest value it covers never adds padding), so a dynamic programme
    over the sorted distinct ceilings, ``O(max_buckets * n^2)`` vectorised,
    finds the optimum. Raises ``ValueError`` for a value above ``maximum``,
    ``max_buckets < 1`` or ``align < 1``.
    """
    import numpy as np

    if max_buckets < 1:
        raise ValueError(f"max_buckets must be >= 1, got {max_buckets!r}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align!r}")
    #: aligned size -> (total weight, total weight x value) of the values it
    #: is the ceiling of
    groups: dict[int, tuple[float, float]] = {}
    for value, weight in zip(values, weights, strict=True):
        if value > maximum:
            raise ValueError(f"value {value} exceeds the largest bucket {maximum}")
        size = align_up(value, align)
        if size < maximum and weight > 0:
            total, weighted = groups.get(size, (0.0, 0.0))
            groups[size] = (total + weight, weighted + weight * value)
    v = np.array(sorted(groups), dtype=float)
    n = len(v)
    if n == 0 or max_buckets == 1:
        return (maximum,)
    if n <= max_buckets - 1:
        return tuple(int(x) for x in v) + (maximum,)
    w = np.array([groups[int(x)][0] for x in v])
    s = np.array([groups[int(x)][1] for x in v])
    # Index 0 is the empty prefix; index j covers the j smallest sizes.
    cum_w = np.concatenate(([0.0], np.cumsum(w)))
    cum_s = np.concatenate(([0.0], np.cumsum(s)))
    # cost[c][j]: least padding covering values 1..j with c buckets, the
    # c-th at value j; choice[c][j]: where the (c-1)-th bucket sits.
    previous = np.full(n + 1, np.inf)
    previous[0] = 0.0
    choices: list[np.ndarray] = []
    layers = [previous]
    for _ in range(max_buckets - 1):
        current = np.full(n + 1, np.inf)
        choice = np.zeros(n + 1, dtype=np.int64)
        # Cost of values i+1..j under bucket v[j-1]: v*(W_j - W_i) - (S_j - S_i)
        base = previous + cum_s
        for j in range(1, n + 1):
            candidates = base[:j] - v[j - 1] * cum_w[:j]
            best = int(np.argmin(candidates))
            current[j] = candidates[best] + v[j - 1] * cum_w[j] - cum_s[j]
            choice[j] = best
        choices.append(choice)
        layers.append(current)
        previous = current
    # The last bucket (maximum) covers the values above the last interior one.
    best_total, best_layer, best_end = np.inf, 0, 0
    for count, layer in enumerate(layers):
        tail = maximum * (cum_w[n] - cum_w) - (cum_s[n] - cum_s)
        totals_here = layer + tail
        end = int(np.argmin(totals_here))
        if totals_here[end] < best_total - 1e-9:
            best_total, best_layer, best_end = totals_here[end], count, end
    chosen: list[int] = []
    j = best_end
    for count in range(best_layer, 0, -1):
        chosen.append(int(v[j - 1]))
        j = int(choices[count - 1][j])
    return tuple(sorted(chosen)) + (maximum,)
