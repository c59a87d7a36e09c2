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
