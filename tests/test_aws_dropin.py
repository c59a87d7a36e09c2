"""A drop-in for AWS's vLLM Neuron scheduler: the ``neuron_config`` a Neuron
user writes for it means the same here (AWS's context-bucket form,
``kv_segment_size_buckets``), ``strict_prefill`` keeps the rule AWS's model
runner assumes, and every output carries what that runner reads."""

import pytest

from helpers import neuron_engine, prompt
from neuron_scheduler import NeuronAsyncScheduler, NeuronScheduler
from neuron_scheduler.config import EngineLimits, NeuronConfig
from neuron_scheduler.step import MixedBatchError, ScheduledRequest, describe_step
from neuron_scheduler.vllm_internals import scheduler_features

pytestmark = pytest.mark.matrix

#: This vLLM can cut prefix-cache hits back to a segment (0.29+).
SEGMENTS = scheduler_features().truncates_prefix_hits
needs_segments = pytest.mark.skipif(
    not SEGMENTS, reason="this vLLM (0.24) cannot cut a prefix-cache hit back"
)

LIMITS = EngineLimits(
    max_num_batched_tokens=1024, max_model_len=4096, max_num_seqs=8, block_size=32
)


def _config(**raw):
    return NeuronConfig.from_dict(raw, LIMITS)


# ------------------------------------------------ AWS's neuron_config forms


def test_aws_context_buckets_below_max_model_len_imply_it():
    config = _config(decode_context_length_buckets=[1024, 2048])
    assert config.decode_context_length_buckets == (1024, 2048, 4096)
    # Ours, ending at max_model_len, is unchanged.
    ours = _config(decode_context_length_buckets=[100, 4096])
    assert ours.decode_context_length_buckets == (100, 4096)


@pytest.mark.parametrize(
    "value, named",
    [([1000, 2048], "1000"), ([2048, 1024], "1024"), ([0], "0")],
)
def test_aws_context_buckets_aws_refuses_are_refused_by_name(value, named):
    with pytest.raises(ValueError, match="decode_context_length_buckets") as error:
        _config(decode_context_length_buckets=value)
    assert named in str(error.value)


def test_kv_segment_size_is_read_as_aws_writes_it():
    assert _config(kv_segment_size_buckets=[512]).kv_segment_size == 512
    assert _config().kv_segment_size is None
    both = _config(kv_segment_size_buckets=[1024], num_batched_tokens_buckets=[1024])
    assert both.kv_segment_size == 1024


@pytest.mark.parametrize(
    "raw, named",
    [
        ({"kv_segment_size_buckets": [500]}, "[500]"),
        ({"kv_segment_size_buckets": [512, 1024]}, "[512, 1024]"),
        ({"kv_segment_size_buckets": 512}, "512"),
        (
            {"kv_segment_size_buckets": [512], "num_batched_tokens_buckets": [1024]},
            "must equal num_batched_tokens_buckets",
        ),
        ({"kv_segment_size_buckets": [2048]}, "largest token bucket 1024"),
    ],
)
def test_kv_segment_sizes_aws_refuses_or_we_cannot_honour_are_refused(raw, named):
    with pytest.raises(ValueError, match="kv_segment_size_buckets") as error:
        _config(**raw)
    assert named in str(error.value)


def test_kv_segment_size_must_divide_by_the_block_size():
    limits = EngineLimits(1024, 4096, 8, block_size=48)
    with pytest.raises(ValueError, match="not divisible by the block size 48"):
        NeuronConfig.from_dict({"kv_segment_size_buckets": [512]}, limits)


@pytest.mark.skipif(SEGMENTS, reason="this vLLM can cut prefix-cache hits back")
def test_kv_segment_size_is_refused_where_vllm_cannot_honour_it():
    with pytest.raises(ValueError, match="truncate_computed_blocks"):
        neuron_engine(
            block_size=32,
            max_num_batched_tokens=1024,
            neuron_config={"kv_segment_size_buckets": [512]},
        )


def test_kv_segment_size_with_a_kv_connector_is_refused_at_start():
    with pytest.raises(ValueError, match="KV connector"):
        neuron_engine(
            block_size=32,
            max_num_batched_tokens=1024,
            kv_connector={},
            neuron_config={"kv_segment_size_buckets": [512]},
        )


# ------------------------------------------- segments honoured, end to end


def _prefill_starts(segment):
    """Chunk starts of a long prompt and of one that shares 1300 of its
    tokens (prefix caching), and the second one's cache hit."""
    config = {} if segment is None else {"kv_segment_size_buckets": [segment]}
    engine = neuron_engine(
        block_size=32,
        max_num_batched_tokens=1024,
        enable_prefix_caching=True,
        neuron_config=config,
    )
    first = prompt(1500, 1)
    engine.add("a", first, max_tokens=2)
    engine.run()
    engine.add("b", first[:1300] + prompt(400, 2), max_tokens=2)
    starts = []
    while engine.has_work():
        output, _ = engine.step()
        if engine.scheduler.last_step.kind.value == "prefill":
            starts += [new.num_computed_tokens for new in output.scheduled_new_reqs]
            starts += list(output.scheduled_cached_reqs.num_computed_tokens)
    return starts


@needs_segments
def test_prefix_hits_and_chunks_start_on_a_segment():
    # Block-aligned by vLLM: the hit ends at 1280 (40 blocks of 32).
    assert _prefill_starts(None) == [1280]
    # On 512-token segments the hit is cut back to 1024, and the rest of the
    # prompt (676 tokens) is one chunk from there.
    assert _prefill_starts(512) == [1024]


# ---------------------------------------------------------- strict_prefill


def _remote_prompt_end_trace(strict):
    """A decodes; B's whole prompt arrives over a KV transfer, leaving only
    its last token: a prompt end."""
    engine = neuron_engine(
        max_num_seqs=4,
        kv_connector={"load_steps": 1},
        neuron_config={"strict_prefill": strict},
    )
    engine.add("a", prompt(40, 1), max_tokens=8)
    engine.step()
    engine.add(
        "b", prompt(64, 2), max_tokens=3, kv_transfer_params={"remote_tokens": 64}
    )
    trace = []
    while engine.has_work():
        engine.step()
        record = engine.scheduler.last_step
        if record.kind.value != "empty":
            trace.append((record.kind.value, record.request_ids))
    return trace


def test_a_prompt_end_joins_the_decodes_by_default_and_runs_alone_when_strict():
    loose = _remote_prompt_end_trace(False)
    assert ("decode", ("a", "b")) in loose  # b's last prompt token as a row
    strict = _remote_prompt_end_trace(True)
    b_steps = [step for step in strict if "b" in step[1]]
    assert b_steps[0] == ("prefill", ("b",))  # alone, with a hidden
    assert all(kind == "decode" for kind, _ in b_steps[1:])


def test_strict_prefill_allows_one_prefill_per_step():
    with pytest.raises(ValueError, match="max_prefills_per_batch = 2"):
        _config(strict_prefill=True, max_prefills_per_batch=2)
    with pytest.raises(ValueError, match="strict_prefill"):
        _config(strict_prefill="yes")


def test_strict_verification_refuses_a_prompt_end_beside_a_decode_or_a_prefill():
    prompt_end = ScheduledRequest("end", 63, 64, 1)
    decode = ScheduledRequest("dec", 70, 64, 1)
    prefill = ScheduledRequest("pre", 0, 64, 64)
    shapes = ((64, 128), (1, 2, 4))
    # The design's rule: a prompt end is a decode row.
    assert describe_step([prompt_end, decode], *shapes).kind.value == "decode"
    with pytest.raises(MixedBatchError, match="mixed batch"):
        describe_step([prompt_end, decode], *shapes, prompt_end_slack=0)
    with pytest.raises(MixedBatchError, match="strict prefill"):
        describe_step([prompt_end, prefill], *shapes, prompt_end_slack=0)
    alone = describe_step([prompt_end], *shapes, prompt_end_slack=0)
    assert alone.kind.value == "prefill" and alone.total_padded == 64


# ----------------------------------------- what AWS's model runner reads


AWS_CONFIG = {
    "num_batched_tokens_buckets": [512],
    "num_seqs_buckets": [2, 4, 8],
    "decode_context_length_buckets": [1024],
    "strict_prefill": True,
    **({"kv_segment_size_buckets": [512]} if SEGMENTS else {}),
}


@pytest.mark.parametrize("scheduler_cls", [NeuronScheduler, NeuronAsyncScheduler])
def test_every_output_carries_what_aws_runner_reads(scheduler_cls):
    """AWS's runner indexes ``num_scheduled_tokens_padded`` for every
    scheduled request: a prefill's value is a configured token bucket, a
    decode's the scheduled count; one prefill per step, never beside a
    decode; chunks start on a segment."""
    engine = neuron_engine(
        scheduler_cls,
        pipelined=scheduler_cls is NeuronAsyncScheduler,
        block_size=32,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=2048,
        enable_prefix_caching=True,
        neuron_config=AWS_CONFIG,
    )
    for i, length in enumerate([5, 40, 300, 700, 1500, 20, 90, 1100]):
        engine.add(f"r{i}", prompt(length, i % 3), max_tokens=6)
    kinds = set()
    while engine.has_work():
        output, _ = engine.step()
        if output is None or not output.num_scheduled_tokens:
            continue
        record = engine.scheduler.last_step
        kinds.add(record.kind.value)
        padded = output.num_scheduled_tokens_padded
        assert set(padded) == set(output.num_scheduled_tokens)
        if record.kind.value == "prefill":
            ((request_id, tokens),) = padded.items()  # one prefill a step
            assert tokens in AWS_CONFIG["num_batched_tokens_buckets"]
        else:
            assert padded == output.num_scheduled_tokens
            assert output.decode_context_len_padded in (1024, 2048)
    assert kinds == {"prefill", "decode"}
    assert all(len(engine.tokens[f"r{i}"]) == 6 for i in range(8))
