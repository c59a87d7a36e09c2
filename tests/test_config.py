"""Every invalid neuron_config fails at scheduler start with a ValueError
naming the key and the offending value; valid ones give the documented
defaults."""

import pytest

from helpers import neuron_engine
from neuron_scheduler.buckets import powers_of_two_buckets, smallest_bucket
from neuron_scheduler.config import EngineLimits, NeuronConfig

pytestmark = pytest.mark.matrix

LIMITS = EngineLimits(max_num_batched_tokens=8192, max_model_len=32768, max_num_seqs=32)


@pytest.mark.parametrize(
    ("raw", "fragments"),
    [
        (
            {"num_batched_tokens_bucket": [8192]},
            ["unknown", "num_batched_tokens_bucket"],
        ),
        ({"num_batched_tokens_buckets": 8192}, ["num_batched_tokens_buckets", "8192"]),
        ({"num_batched_tokens_buckets": []}, ["num_batched_tokens_buckets", "empty"]),
        ({"num_batched_tokens_buckets": [512, 256, 8192]}, ["ascending", "256"]),
        ({"num_batched_tokens_buckets": [512, 512, 8192]}, ["duplicate", "512"]),
        ({"num_batched_tokens_buckets": [0, 8192]}, ["positive", "0"]),
        ({"num_batched_tokens_buckets": [-128, 8192]}, ["positive", "-128"]),
        ({"num_batched_tokens_buckets": [128, "8192"]}, ["ints", "'8192'"]),
        ({"num_batched_tokens_buckets": [128.0, 8192]}, ["ints", "128.0"]),
        ({"num_batched_tokens_buckets": [True, 8192]}, ["ints", "True"]),
        ({"num_batched_tokens_buckets": [128, 4096]}, ["end at 8192", "4096"]),
        ({"num_seqs_buckets": [1, 2, 4]}, ["num_seqs_buckets", "end at 32", "4"]),
        ({"num_seqs_buckets": [4, 2, 32]}, ["num_seqs_buckets", "ascending"]),
        ({"num_seqs_buckets": "1,2,32"}, ["num_seqs_buckets", "'1,2,32'"]),
        ({"max_prefills_per_batch": 0}, ["max_prefills_per_batch", "positive", "0"]),
        ({"max_prefills_per_batch": "1"}, ["max_prefills_per_batch", "'1'"]),
        (
            {"max_prefills_per_batch": 33},
            ["max_prefills_per_batch", "33", "max_num_seqs = 32"],
        ),
        ({"kv_admission": "reserved"}, ["kv_admission", "'reserved'", "reserve"]),
        ({"kv_admission": 1}, ["kv_admission", "int 1"]),
        (
            {"max_consecutive_prefill_steps": 0},
            ["max_consecutive_prefill_steps", "positive", "0"],
        ),
        (
            {"max_consecutive_prefill_steps": 2.5},
            ["max_consecutive_prefill_steps", "2.5"],
        ),
        (
            {"decode_context_length_buckets": [4096, 40000]},
            ["decode_context_length_buckets", "end at 32768", "40000"],
        ),
        (  # AWS's form (below max_model_len): multiples of 128
            {"decode_context_length_buckets": [4000, 16384]},
            ["decode_context_length_buckets", "multiples of 128", "4000"],
        ),
        (
            {"decode_context_length_buckets": [8192, 4096, 32768]},
            ["decode_context_length_buckets", "ascending", "4096"],
        ),
        ({"decode_context_length_buckets": []}, ["decode_context_length_buckets"]),
        (
            {"max_prefill_tokens_with_decodes_waiting": 9000},
            ["max_prefill_tokens_with_decodes_waiting", "9000", "largest token bucket"],
        ),
        (
            {
                "num_batched_tokens_buckets": [512, 8192],
                "max_prefill_tokens_with_decodes_waiting": -1,
            },
            ["max_prefill_tokens_with_decodes_waiting", "positive", "-1"],
        ),
        ([1, 2], ["neuron_config", "JSON object", "[1, 2]"]),
    ],
)
def test_invalid_config_is_rejected_with_key_and_value(raw, fragments):
    with pytest.raises(ValueError) as error:
        NeuronConfig.from_dict(raw, LIMITS)
    message = str(error.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_defaults_follow_engine_limits():
    config = NeuronConfig.from_dict({}, LIMITS)
    assert config.num_batched_tokens_buckets == (128, 256, 512, 1024, 2048, 4096, 8192)
    assert config.num_seqs_buckets == (1, 2, 4, 8, 16, 32)
    assert config.max_prefills_per_batch == 1
    assert config.kv_admission.value == "max_model_len"
    assert config.max_consecutive_prefill_steps is None
    assert config.decode_context_length_buckets == (32768,)


def test_all_options_combine():
    config = NeuronConfig.from_dict(
        {
            "num_batched_tokens_buckets": [1000, 8192],
            "num_seqs_buckets": [3, 32],
            "max_prefills_per_batch": 4,
            "kv_admission": "reserve",
            "max_consecutive_prefill_steps": 2,
            "decode_context_length_buckets": [2048, 32768],
        },
        LIMITS,
    )
    assert config.max_prefills_per_batch == 4
    assert config.kv_admission.value == "reserve"
    assert config.max_consecutive_prefill_steps == 2
    assert config.decode_context_length_buckets == (2048, 32768)


def test_default_token_buckets_use_min_of_batched_tokens_and_model_len():
    limits = EngineLimits(
        max_num_batched_tokens=8192, max_model_len=3000, max_num_seqs=24
    )
    config = NeuronConfig.from_dict({}, limits)
    assert config.num_batched_tokens_buckets == (128, 256, 512, 1024, 2048, 3000)
    assert config.num_seqs_buckets == (1, 2, 4, 8, 16, 24)


def test_given_buckets_are_kept():
    config = NeuronConfig.from_dict(
        {"num_batched_tokens_buckets": [1000, 8192], "num_seqs_buckets": [3, 32]},
        LIMITS,
    )
    assert config.num_batched_tokens_buckets == (1000, 8192)
    assert config.num_seqs_buckets == (3, 32)


def test_bucket_functions():
    assert powers_of_two_buckets(600, 128) == (128, 256, 512, 600)
    assert powers_of_two_buckets(1) == (1,)
    assert smallest_bucket((128, 256), 128) == 128
    assert smallest_bucket((128, 256), 129) == 256
    assert smallest_bucket((128, 256), 1) == 128
    with pytest.raises(ValueError, match="257"):
        smallest_bucket((128, 256), 257)


def test_bad_config_fails_at_scheduler_start():
    with pytest.raises(ValueError, match="num_seqs_buckets"):
        neuron_engine(max_num_seqs=8, neuron_config={"num_seqs_buckets": [1, 4]})


def test_token_cap_without_chunked_prefill_is_refused_at_start():
    with pytest.raises(ValueError, match="needs chunked prefill") as error:
        neuron_engine(
            max_num_batched_tokens=4096,
            max_model_len=4096,
            enable_chunked_prefill=False,
            neuron_config={"max_prefill_tokens_with_decodes_waiting": 512},
        )
    assert "max_prefill_tokens_with_decodes_waiting" in str(error.value)


def test_reserve_admission_on_a_hybrid_kv_cache_is_refused_at_start():
    """Two KV cache groups (e.g. full + sliding-window attention): the
    reservation count covers one group only, so it refuses to start."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    from neuron_scheduler import NeuronScheduler
    from neuron_scheduler.offline.engine import EngineSettings, build_vllm_config

    vllm_config = build_vllm_config(
        EngineSettings(num_kv_blocks=1024, neuron_config={"kv_admission": "reserve"})
    )
    spec = dict(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=1024,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn"], FullAttentionSpec(**spec)
            ),
            KVCacheGroupSpec(
                ["model.layers.1.self_attn.attn"],
                SlidingWindowSpec(**spec, sliding_window=128),
            ),
        ],
    )
    with pytest.raises(ValueError, match="'reserve' needs one KV cache group") as error:
        NeuronScheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=16,
        )
    assert "has 2" in str(error.value)
