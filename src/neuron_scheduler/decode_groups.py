"""Decode batches split in two by context, when that reads less KV.

A static decode graph reads its context bucket for every row it holds, so a
batch whose rows have very different contexts reads most of its KV for the
longest one: rows at 1,000 positions beside one at 30,000 each read 32,768
(the bucket). Splitting the rows into the shorter ones and the longer ones,
each group a step of its own at its own buckets, reads less, at the price of
one more step's fixed cost (the weights read again, the launch): the
``decode_split_break_even_positions`` of ``neuron_config``, that fixed cost
expressed in KV positions read (``sim.decode_split.break_even_positions``
derives it from a cost model).

A cycle decodes every running decode exactly once: the first step of a
cycle takes the shorter group, the next decode step takes every running
decode not yet decoded in the cycle (the longer group and any request that
became a decode meanwhile), and the cycle ends. Pure functions; the
scheduler keeps the cycle's state.
"""

from __future__ import annotations

from collections.abc import Sequence

from neuron_scheduler.buckets import smallest_bucket


def positions_read(
    rows: int,
    longest_context: int,
    seq_buckets: Sequence[int],
    context_buckets: Sequence[int],
) -> int:
    """KV positions a decode graph reads for ``rows`` rows whose longest
    context is ``longest_context``: padded rows x the context bucket."""
    return smallest_bucket(seq_buckets, rows) * smallest_bucket(
        context_buckets, longest_context
    )


def shorter_group_size(
    contexts: Sequence[int],
    seq_buckets: Sequence[int],
    context_buckets: Sequence[int],
    break_even_positions: int,
) -> int:
    """How many of the rows, ``contexts`` ascending, decode first as the
    shorter group: the split that reads the fewest KV positions when it
    saves more than ``break_even_positions`` against one step; 0: one step
    for all."""
    n = len(contexts)
    if n < 2:
        return 0
    longest = contexts[-1]
    one_step = positions_read(n, longest, seq_buckets, context_buckets)
    best, best_k = one_step - break_even_positions, 0
    for k in range(1, n):
        if contexts[k - 1] == longest:
            break  # the rest share the longest bucket: nothing more to save
        split = positions_read(
            k, contexts[k - 1], seq_buckets, context_buckets
        ) + positions_read(n - k, longest, seq_buckets, context_buckets)
        if split < best:
            best, best_k = split, k
    return best_k
