"""A tiny random-weight Llama with a local word-level tokenizer, made on
disk so vLLM can load it with no hub access (demo and end-to-end tests)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: Words of the toy tokenizer; token ids follow the list order after the
#: special tokens.
_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "on",
    "for",
    "with",
    "and",
    "or",
    "but",
    "is",
    "are",
    "was",
    "were",
    "be",
    "been",
    "it",
    "this",
    "that",
    "these",
    "those",
    "he",
    "she",
    "they",
    "we",
    "you",
    "i",
    "me",
    "my",
    "your",
    "our",
    "their",
    "his",
    "her",
    "its",
    "what",
    "which",
    "who",
    "when",
    "where",
    "why",
    "how",
    "all",
    "any",
    "some",
    "many",
    "much",
    "more",
    "most",
    "other",
    "such",
    "no",
    "not",
    "only",
    "same",
    "so",
    "than",
    "too",
    "very",
    "can",
    "will",
    "just",
    "should",
    "now",
    "time",
    "year",
    "day",
    "way",
    "man",
    "woman",
    "child",
    "world",
    "life",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
]

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")

#: ``vllm.LLM`` settings for the tiny model on a CPU: small enough to start in
#: seconds; prompts above 512 tokens are chunked.
TINY_ENGINE_ARGS: dict[str, object] = {
    "max_model_len": 2048,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 8,
    "kv_cache_memory_bytes": 64 << 20,
    "dtype": "float32",
    "enforce_eager": True,
    "seed": 0,
}


@dataclass(frozen=True)
class LlamaSize:
    """Shape of a random-weight Llama made on disk."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


#: The demo's model: hidden 64, 2 layers, head_dim 32 (~1 ms steps).
TINY = LlamaSize(64, 128, 2, 2)
#: ``neuron-scheduler validate``'s model: hidden 512, 6 layers, 8 heads of
#: 64, MLP 1536 (~20M parameters). On one core of this 2-core machine (the
#: server's worker binding) an engine step of one decode row at context 512
#: takes ~6 ms, of 8 rows ~10 ms, a 1024-token prefill ~260 ms.
VALIDATION = LlamaSize(512, 1536, 6, 8, max_position_embeddings=8192)
#: The engine ``neuron-scheduler validate`` serves ``VALIDATION`` with.
VALIDATION_ENGINE: dict[str, object] = {
    "max_model_len": 4096,
    "max_num_batched_tokens": 1024,
    "max_num_seqs": 8,
    "kv_cache_memory_bytes": 512 << 20,
}


def make_tiny_llama(directory: str | Path, *, seed: int = 0) -> Path:
    """Write the demo's random-weight Llama (``TINY``) and its tokenizer into
    ``directory`` (created if missing); return the path. Re-uses an existing
    complete model there."""
    return make_random_llama(directory, TINY, seed=seed)


def make_random_llama(directory: str | Path, size: LlamaSize, *, seed: int = 0) -> Path:
    """Write a random-weight Llama of ``size`` and the word-level tokenizer
    into ``directory``; re-use a complete model of that size already there."""
    path = Path(directory)
    config_path = path / "config.json"
    if config_path.exists() and (path / "tokenizer.json").exists():
        existing = json.loads(config_path.read_text())
        if (
            existing.get("hidden_size") == size.hidden_size
            and existing.get("num_hidden_layers") == size.num_hidden_layers
        ):
            return path
    path.mkdir(parents=True, exist_ok=True)

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for word in _WORDS:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=len(vocab),
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_attention_heads,
        head_dim=size.head_dim,
        max_position_embeddings=size.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    # vLLM reads generation defaults from here; keep them neutral.
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    )
    return path
