"""From a scheduled step to fixed-shape tensors: what a static-shape model
runner does with the scheduler's padded counts.

Pure functions, torch tensors in and out, no vLLM state. Conventions:

* a prefill step is the concatenation of its requests' chunks (one request,
  or several when ``max_prefills_per_batch > 1``), padded at the end to
  ``total_num_scheduled_tokens_padded`` with ``pad_token_id``;
* padded positions repeat the last real position (a valid rotary index);
* ``slot_mapping`` is ``block_id * block_size + offset`` for real tokens and
  ``-1`` for padding: the KV write of a padded token is dropped;
* a decode step pads its batch to ``num_seqs_padded`` with dummy rows (pad
  token, position 0, slot ``-1``, an all-null block table, context 0) and
  its block tables to ``decode_context_len_padded`` positions; ``real_rows``
  says which rows to keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from neuron_scheduler.admission import blocks_for

#: Slot of a token whose KV must not be written.
NO_SLOT = -1


@dataclass(frozen=True)
class PrefillChunk:
    """One request's part of a prefill step: the tokens scheduled now, how
    many of its tokens are already in the KV cache, and its block table."""

    token_ids: torch.Tensor
    num_computed: int
    block_table: torch.Tensor


@dataclass(frozen=True)
class PrefillBatch:
    """Tensors of one padded prefill step (length ``padded_total``).

    ``query_start_loc[r]:query_start_loc[r+1]`` are request ``r``'s real
    tokens; ``seq_lens[r]`` its context after the step; ``logits_indices[r]``
    its last real token (where its next-token logits are read).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    logits_indices: torch.Tensor
    num_real_tokens: int


def _slots(
    block_ids: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """KV slots of ``positions``, each in the block of ``block_ids`` that
    holds it (the block table entry ``position // block_size``)."""
    return block_ids * block_size + positions % block_size


def build_prefill_batch(
    chunks: Sequence[PrefillChunk],
    padded_total: int,
    *,
    block_size: int,
    pad_token_id: int = 0,
) -> PrefillBatch:
    """Concatenate ``chunks`` and pad them to ``padded_total`` tokens.

    Raises ``ValueError`` if there are no chunks, a chunk is empty, a block
    table is too short for its positions, or the real tokens exceed
    ``padded_total``.
    """
    if not chunks:
        raise ValueError("a prefill step needs at least one chunk")
    lengths = [int(c.token_ids.numel()) for c in chunks]
    if min(lengths) == 0:
        raise ValueError(f"empty prefill chunk in lengths {lengths}")
    total = sum(lengths)
    if total > padded_total:
        raise ValueError(f"{total} real tokens exceed padded_total {padded_total}")
    positions = []
    slots = []
    for chunk, length in zip(chunks, lengths, strict=True):
        chunk_positions = torch.arange(
            chunk.num_computed, chunk.num_computed + length, dtype=torch.long
        )
        if chunk.block_table.numel() < blocks_for(
            chunk.num_computed + length, block_size
        ):
            raise ValueError(
                f"block table of {chunk.block_table.numel()} blocks cannot hold "
                f"position {chunk.num_computed + length - 1} at block size "
                f"{block_size}"
            )
        positions.append(chunk_positions)
        block_ids = chunk.block_table.long()[chunk_positions // block_size]
        slots.append(_slots(block_ids, chunk_positions, block_size))
    padding = padded_total - total
    real_positions = torch.cat(positions)
    input_ids = torch.cat(
        [*(c.token_ids.long() for c in chunks), torch.full((padding,), pad_token_id)]
    )
    all_positions = torch.cat([real_positions, real_positions[-1].repeat(padding)])
    slot_mapping = torch.cat(
        [*slots, torch.full((padding,), NO_SLOT, dtype=torch.long)]
    )
    query_start_loc = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return PrefillBatch(
        input_ids=input_ids,
        positions=all_positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(
            [c.num_computed + n for c, n in zip(chunks, lengths, strict=True)]
        ),
        logits_indices=query_start_loc[1:] - 1,
        num_real_tokens=total,
    )


def prefill_attention_mask(batch: PrefillBatch) -> torch.Tensor:
    """Which of this step's tokens each token attends to, ``[T, T]`` bool:
    causal within its own request, never across requests or to padding;
    a padding token attends only to itself (its output is discarded).
    Attention to tokens already in the KV cache follows ``seq_lens``."""
    size = int(batch.input_ids.numel())
    request_of = torch.full((size,), -1, dtype=torch.long)
    bounds = batch.query_start_loc.tolist()
    for r, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
        request_of[start:end] = r
    index = torch.arange(size)
    same_request = (request_of[:, None] == request_of[None, :]) & (
        request_of[:, None] >= 0
    )
    causal = index[None, :] <= index[:, None]
    return (same_request & causal) | torch.eye(size, dtype=torch.bool)


@dataclass(frozen=True)
class DecodeBatch:
    """Tensors of one padded decode step (``padded_batch`` rows).

    ``context_lens[r]``: tokens row ``r`` attends to, its new one included
    (0 for dummy rows); ``block_tables``: ``[padded_batch, blocks]`` with
    enough blocks for ``padded_context_len`` positions, 0 (the null block)
    past a row's own blocks.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    real_rows: torch.Tensor


def build_decode_batch(
    token_ids: Sequence[int],
    positions: Sequence[int],
    block_tables: Sequence[torch.Tensor],
    padded_batch: int,
    *,
    block_size: int,
    padded_context_len: int,
    pad_token_id: int = 0,
) -> DecodeBatch:
    """One new token per real row (at ``positions[r]``), padded with dummy
    rows to ``padded_batch``. Raises ``ValueError`` for mismatched lengths,
    more rows than ``padded_batch``, or a context beyond
    ``padded_context_len``."""
    num_real = len(token_ids)
    if not (num_real == len(positions) == len(block_tables)):
        raise ValueError(
            f"token_ids ({num_real}), positions ({len(positions)}) and "
            f"block_tables ({len(block_tables)}) must have one entry per row"
        )
    if num_real > padded_batch:
        raise ValueError(f"{num_real} rows exceed padded_batch {padded_batch}")
    if num_real and max(positions) + 1 > padded_context_len:
        raise ValueError(
            f"context {max(positions) + 1} exceeds padded_context_len "
            f"{padded_context_len}"
        )
    num_blocks = blocks_for(padded_context_len, block_size)
    tables = torch.zeros((padded_batch, num_blocks), dtype=torch.long)
    for row, table in enumerate(block_tables):
        tables[row, : min(table.numel(), num_blocks)] = table[:num_blocks].long()
    dummy = padded_batch - num_real
    position_tensor = torch.tensor(list(positions), dtype=torch.long)
    block_ids = tables[torch.arange(num_real), position_tensor // block_size]
    real_slots = _slots(block_ids, position_tensor, block_size)
    return DecodeBatch(
        input_ids=torch.cat(
            [
                torch.tensor(list(token_ids), dtype=torch.long),
                torch.full((dummy,), pad_token_id, dtype=torch.long),
            ]
        ),
        positions=torch.cat([position_tensor, torch.zeros(dummy, dtype=torch.long)]),
        slot_mapping=torch.cat(
            [real_slots, torch.full((dummy,), NO_SLOT, dtype=torch.long)]
        ),
        block_tables=tables,
        context_lens=torch.cat(
            [position_tensor + 1, torch.zeros(dummy, dtype=torch.long)]
        ),
        real_rows=torch.arange(padded_batch) < num_real,
    )


def decode_attention_mask(batch: DecodeBatch, padded_context_len: int) -> torch.Tensor:
    """``[padded_batch, padded_context_len]`` bool: row ``r`` attends to
    positions ``< context_lens[r]``; a dummy row only to position 0 (so its
    softmax is defined; its output is discarded)."""
    mask = torch.arange(padded_context_len)[None, :] < batch.context_lens[:, None]
    mask[~batch.real_rows, 0] = True
    return mask
