"""The model-runner padding functions: shape rules (property-tested), the
tie to the scheduler's padded counts, and semantics proven on a tiny
random-weight transformers Llama: padded runs give the unpadded logits."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import neuron_engine, prompt
from neuron_scheduler.model_runner import (
    NO_SLOT,
    PrefillChunk,
    build_decode_batch,
    build_prefill_batch,
    decode_attention_mask,
    prefill_attention_mask,
)

BLOCK = 4


def _chunk(length, computed, seed=0):
    blocks = (computed + length - 1) // BLOCK + 1
    table = torch.arange(100 * seed + 1, 100 * seed + 1 + blocks)
    return PrefillChunk(torch.arange(length) % 50 + 3, computed, table)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    computed=st.lists(st.integers(0, 30), min_size=4, max_size=4),
    extra=st.integers(0, 50),
)
def test_prefill_shape_rules(lengths, computed, extra):
    chunks = [
        _chunk(n, c, i) for i, (n, c) in enumerate(zip(lengths, computed, strict=False))
    ]
    total = sum(lengths)
    batch = build_prefill_batch(chunks, total + extra, block_size=BLOCK, pad_token_id=0)
    assert batch.input_ids.shape == batch.positions.shape == (total + extra,)
    assert batch.slot_mapping.shape == (total + extra,)
    assert (batch.input_ids[total:] == 0).all()
    assert (batch.slot_mapping[total:] == NO_SLOT).all()
    assert (batch.slot_mapping[:total] >= 0).all()
    assert len(set(batch.slot_mapping[:total].tolist())) == total  # no overwrite
    assert (batch.positions[total:] == batch.positions[total - 1]).all()
    assert batch.query_start_loc.tolist()[-1] == total
    assert batch.logits_indices.tolist() == [
        end - 1 for end in batch.query_start_loc[1:].tolist()
    ]
    for r, chunk in enumerate(chunks):
        start = batch.query_start_loc[r]
        assert batch.positions[start] == chunk.num_computed
        assert batch.seq_lens[r] == chunk.num_computed + lengths[r]
    mask = prefill_attention_mask(batch)
    assert mask.shape == (total + extra, total + extra)
    assert not mask[:total, total:].any()  # nothing real attends padding
    assert mask.diagonal().all()


@settings(max_examples=200, deadline=None)
@given(
    contexts=st.lists(st.integers(1, 60), min_size=0, max_size=6),
    extra_rows=st.integers(0, 5),
    extra_context=st.integers(0, 20),
)
def test_decode_shape_rules(contexts, extra_rows, extra_context):
    positions = [c - 1 for c in contexts]
    tables = [
        torch.arange(100 * i, 100 * i + (c - 1) // BLOCK + 1)
        for i, c in enumerate(contexts)
    ]
    padded_batch = len(contexts) + extra_rows
    padded_context = max(contexts, default=1) + extra_context
    batch = build_decode_batch(
        [7] * len(contexts), positions, tables, padded_batch,
        block_size=BLOCK, padded_context_len=padded_context,
    )  # fmt: skip
    n = len(contexts)
    assert batch.input_ids.shape == (padded_batch,)
    assert batch.real_rows.tolist() == [True] * n + [False] * extra_rows
    assert (batch.slot_mapping[n:] == NO_SLOT).all()
    assert (batch.slot_mapping[:n] >= 0).all()
    assert batch.block_tables.shape == (padded_batch, -(-padded_context // BLOCK))
    assert (batch.block_tables[n:] == 0).all()
    assert batch.context_lens.tolist() == list(contexts) + [0] * extra_rows
    mask = decode_attention_mask(batch, padded_context)
    assert mask.sum(1).tolist() == list(contexts) + [1] * extra_rows


def test_bad_inputs_are_refused_with_the_values():
    with pytest.raises(ValueError, match="12 real tokens exceed padded_total 8"):
        build_prefill_batch([_chunk(12, 0)], 8, block_size=BLOCK)
    with pytest.raises(ValueError, match="block table of 1 blocks"):
        build_prefill_batch(
            [PrefillChunk(torch.arange(9), 0, torch.tensor([3]))], 16, block_size=BLOCK
        )
    with pytest.raises(ValueError, match="3 rows exceed padded_batch 2"):
        build_decode_batch([1, 2, 3], [0, 0, 0], [torch.tensor([1])] * 3, 2,
                           block_size=BLOCK, padded_context_len=4)  # fmt: skip
    with pytest.raises(ValueError, match="context 9 exceeds padded_context_len 8"):
        build_decode_batch([1], [8], [torch.tensor([1, 2, 3])], 2,
                           block_size=BLOCK, padded_context_len=8)  # fmt: skip


def test_scheduler_output_to_padded_tensors():
    """A packed prefill step from the real scheduler becomes tensors of its
    padded length whose real slots are the KV blocks vLLM allocated."""
    engine = neuron_engine(block_size=16, neuron_config={"max_prefills_per_batch": 3})
    prompts = {"a": prompt(100, 1), "b": prompt(37, 2), "c": prompt(50, 3)}
    for request_id, tokens in prompts.items():
        engine.add(request_id, tokens, max_tokens=2)
    output = engine.scheduler.schedule()
    manager = engine.scheduler.kv_cache_manager
    chunks = [
        PrefillChunk(
            torch.tensor(
                prompts[new.req_id][: output.num_scheduled_tokens[new.req_id]]
            ),
            new.num_computed_tokens,
            torch.tensor(manager.get_block_ids(new.req_id)[0]),
        )
        for new in output.scheduled_new_reqs
    ]
    batch = build_prefill_batch(
        chunks, output.total_num_scheduled_tokens_padded, block_size=16
    )
    assert batch.input_ids.numel() == 256 and batch.num_real_tokens == 187
    real = batch.slot_mapping[:187]
    allocated = {
        block * 16 + offset
        for request_id in prompts
        for block in manager.get_block_ids(request_id)[0]
        for offset in range(16)
    }
    assert set(real.tolist()) <= allocated and len(set(real.tolist())) == 187


# ------------------------------------------------------------ real model


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=256,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "eager"
    return model


def _additive(mask):
    """bool mask -> additive float mask [batch, 1, q, k]."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def _logits(model, input_ids, positions, mask=None):
    with torch.no_grad():
        return model(
            input_ids=input_ids, position_ids=positions, attention_mask=mask
        ).logits


def test_padded_packed_prefill_gives_the_unpadded_logits(llama):
    prompts = [torch.randint(3, 128, (n,)) for n in (5, 9, 1)]
    chunks = [
        PrefillChunk(p, 0, torch.arange(4 * i, 4 * i + 4))
        for i, p in enumerate(prompts)
    ]
    batch = build_prefill_batch(chunks, 32, block_size=BLOCK, pad_token_id=0)
    mask = _additive(prefill_attention_mask(batch))[None, None]
    padded = _logits(llama, batch.input_ids[None], batch.positions[None], mask)[0]
    for r, tokens in enumerate(prompts):
        alone = _logits(llama, tokens[None], torch.arange(len(tokens))[None])[0]
        start, end = batch.query_start_loc[r], batch.query_start_loc[r + 1]
        torch.testing.assert_close(padded[start:end], alone, atol=1e-5, rtol=1e-4)
        assert padded[batch.logits_indices[r]].argmax() == alone[-1].argmax()


def test_decode_with_dummy_rows_gives_the_real_rows_their_logits(llama):
    from transformers import DynamicCache

    prompts = [torch.randint(3, 128, (n,)) for n in (5, 9, 3)]
    next_tokens = [int(torch.randint(3, 128, ())) for _ in prompts]
    reference = []
    for tokens, token in zip(prompts, next_tokens, strict=True):
        with torch.no_grad():
            cache = DynamicCache()
            llama(input_ids=tokens[None], past_key_values=cache, use_cache=True)
            out = llama(
                input_ids=torch.tensor([[token]]),
                position_ids=torch.tensor([[len(tokens)]]),
                past_key_values=cache,
                use_cache=True,
            )
        reference.append(out.logits[0, -1])

    # Static shapes: 3 real rows padded to 4, context padded to 16.
    padded_context = 16
    batch = build_decode_batch(
        next_tokens, [len(p) for p in prompts],
        [torch.arange(4 * i, 4 * i + 4) for i in range(3)], 4,
        block_size=BLOCK, padded_context_len=padded_context,
    )  # fmt: skip
    # Fill a batched KV cache the runner's way: every row's prompt at its
    # positions, right-padded; the dummy row holds only pad tokens.
    width = max(len(p) for p in prompts)
    rows = torch.zeros((4, width), dtype=torch.long)
    valid = torch.zeros((4, width), dtype=torch.bool)
    for r, tokens in enumerate(prompts):
        rows[r, : len(tokens)] = tokens
        valid[r, : len(tokens)] = True
    valid[3, 0] = True
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    prefill_mask = (
        causal[None] & valid[:, None, :] | torch.eye(width, dtype=torch.bool)[None]
    )
    cache = DynamicCache()
    with torch.no_grad():
        llama(
            input_ids=rows,
            position_ids=torch.arange(width).expand(4, width),
            attention_mask=_additive(prefill_mask)[:, None],
            past_key_values=cache,
            use_cache=True,
        )
    # Decode mask over [cached positions..., new token] from context_lens.
    attend = decode_attention_mask(batch, padded_context)
    cached = attend[:, :width].clone()
    cached &= (
        torch.arange(width)[None, :] < (batch.context_lens - 1).clamp(min=0)[:, None]
    )
    step_mask = torch.cat([cached, torch.ones(4, 1, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        out = llama(
            input_ids=batch.input_ids[:, None],
            position_ids=batch.positions[:, None],
            attention_mask=_additive(step_mask)[:, None, None, :],
            past_key_values=cache,
            use_cache=True,
        )
    logits = out.logits[:, -1]
    assert torch.isfinite(logits).all()
    kept = logits[batch.real_rows]
    for r, expected in enumerate(reference):
        torch.testing.assert_close(kept[r], expected, atol=1e-5, rtol=1e-4)
        assert kept[r].argmax() == expected.argmax()
