"""Config-only copies of the models vLLM's scheduler tests name.

The hub is unreachable here, and the scheduler reads only a model's
``config.json`` (attention layout, context length, vocabulary). These are the
public configs of the models the suite names, written into a local Hugging
Face hub cache so that ``ModelConfig("facebook/opt-125m")`` resolves offline.
No weights, no tokenizers: tests that run a model end to end still fail, for
the stock scheduler as for ours.

Multimodal models (``llava-hf/llava-1.5-7b-hf``, ``Qwen/Qwen2.5-VL-3B-
Instruct``) are left out on purpose: vLLM inspects their model classes, which
import ``torchvision``, and PyPI's torchvision is a CUDA build that breaks
vLLM's CPU torch. Their tests fail for both schedulers alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Stand-in snapshot id (the hub cache layout needs one).
SNAPSHOT = "0" * 40

_OPT_COMMON: dict[str, Any] = {
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "dropout": 0.1,
    "eos_token_id": 2,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 50272,
}

_QWEN_COMMON: dict[str, Any] = {
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

#: repository id -> config.json, as published on the hub.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # The suite's default model.
    "facebook/opt-125m": {
        **_OPT_COMMON,
        "do_layer_norm_before": True,
        "ffn_dim": 3072,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "word_embed_proj_dim": 768,
    },
    "facebook/opt-350m": {
        **_OPT_COMMON,
        "do_layer_norm_before": False,
        "ffn_dim": 4096,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "word_embed_proj_dim": 512,
    },
    # vLLM 0.32's ModelConfig default.
    "Qwen/Qwen3-0.6B": {
        **_QWEN_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rope_scaling": None,
        "sliding_window": None,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen1.5-7B": {
        **_QWEN_COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "eos_token_id": 151643,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
    },
}


def write_hub_cache(root: Path) -> Path:
    """Write every config into a hub cache at ``root`` (the layout
    ``huggingface_hub`` reads with ``HF_HUB_CACHE=root`` and
    ``HF_HUB_OFFLINE=1``) and return ``root``. Idempotent."""
    for repo_id, config in MODEL_CONFIGS.items():
        repo_dir = root / ("models--" + repo_id.replace("/", "--"))
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / "main").write_text(SNAPSHOT)
        snapshot = repo_dir / "snapshots" / SNAPSHOT
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=1))
    return root
