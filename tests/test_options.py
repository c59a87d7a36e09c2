"""Issue 6's scheduler options on the real vLLM scheduler: packed prefills,
the decode stall bound, decode context-length buckets and KV admission by
reservation (never a preemption)."""

import random

import pytest

from helpers import neuron_engine, prompt, run_trace
from neuron_scheduler import NeuronAsyncScheduler, NeuronScheduler
from neuron_scheduler.admission import AdmissionRule

pytestmark = pytest.mark.matrix

P, D = "prefill", "decode"
PRE, DEC = "ACTIVE_PREFILL", "ACTIVE_DECODE"


# ------------------------------------------------------------ packed prefills


def test_packed_prefills_share_one_bucket_in_fifo_order():
    engine = neuron_engine(
        max_num_batched_tokens=8192,
        neuron_config={"max_prefills_per_batch": 3},
    )
    engine.add("a", prompt(100, 1), max_tokens=2)
    engine.add("b", prompt(300, 2), max_tokens=2)
    engine.add("c", prompt(600, 3), max_tokens=2)
    engine.add("d", prompt(200, 4), max_tokens=2)
    assert run_trace(engine) == [
        (P, ("a", "b", "c"), 1000, 1024, PRE),  # 3 = max_prefills_per_batch
        (P, ("d",), 200, 256, PRE),  # a, b, c's decodes hidden
        (D, ("a", "b", "c", "d"), 4, 4, DEC),
    ]


def test_packing_stops_before_a_prompt_that_would_overflow_the_largest_bucket():
    engine = neuron_engine(
        max_num_batched_tokens=4096,
        neuron_config={"max_prefills_per_batch": 8},
    )
    engine.add("a", prompt(3000, 1), max_tokens=1)
    engine.add("b", prompt(2000, 2), max_tokens=1)  # 5000 > 4096: next step
    engine.add("c", prompt(1000, 3), max_tokens=1)
    trace = run_trace(engine)
    assert trace[:2] == [
        (P, ("a",), 3000, 4096, PRE),
        (P, ("b", "c"), 3000, 4096, PRE),  # FIFO: c does not jump ahead of b
    ]
    refusals = engine.scheduler.metrics.refusals
    assert refusals[AdmissionRule.PACKED_TOKENS] >= 1


def test_packed_step_records_total_padding_on_the_output():
    engine = neuron_engine(neuron_config={"max_prefills_per_batch": 2})
    engine.add("a", prompt(100, 1), max_tokens=1)
    engine.add("b", prompt(90, 2), max_tokens=1)
    output, _ = engine.step()
    assert output.num_scheduled_tokens == {"a": 100, "b": 90}
    assert output.total_num_scheduled_tokens == 190
    assert output.total_num_scheduled_tokens_padded == 256
    # Padding follows the concatenated prompts: on the last one.
    assert output.num_scheduled_tokens_padded == {"a": 100, "b": 156}
    assert output.decode_context_len_padded is None


# --------------------------------------------------------------- stall bound


def test_stall_bound_interleaves_a_decode_step_between_prefills():
    engine = neuron_engine(neuron_config={"max_consecutive_prefill_steps": 1})
    engine.add("a", prompt(100, 1), max_tokens=5)
    engine.step()
    for i, name in enumerate("bcd"):
        engine.add(name, prompt(100, i + 2), max_tokens=2)
    assert run_trace(engine)[:6] == [
        (P, ("b",), 100, 128, PRE),
        (D, ("a", "b"), 2, 2, DEC),  # decode turn: c waits
        (P, ("c",), 100, 128, PRE),
        (D, ("a", "c"), 2, 2, DEC),  # b finished at its 2nd token
        (P, ("d",), 100, 128, PRE),
        (D, ("a", "d"), 2, 2, DEC),
    ]
    assert engine.scheduler.metrics.refusals[AdmissionRule.DECODE_TURN] == 2


def test_stall_bound_pauses_a_chunked_prefill_for_the_decodes():
    engine = neuron_engine(
        max_num_batched_tokens=1024,
        max_model_len=8192,
        neuron_config={"max_consecutive_prefill_steps": 2},
    )
    engine.add("a", prompt(100, 1), max_tokens=4)
    engine.step()
    engine.add("long", prompt(5000, 2), max_tokens=1)
    trace = run_trace(engine)
    assert [(kind, ids) for kind, ids, *_ in trace[:8]] == [
        (P, ("long",)),
        (P, ("long",)),
        (D, ("a",)),  # the chunked prefill is hidden for one step
        (P, ("long",)),
        (P, ("long",)),
        (D, ("a",)),
        (P, ("long",)),  # last chunk; long's only token ends it
        (D, ("a",)),
    ]
    assert len(trace) == 8
    assert len(engine.tokens["long"]) == 1 and len(engine.tokens["a"]) == 4


def test_without_stall_bound_the_chunked_prefill_starves_decodes():
    engine = neuron_engine(max_num_batched_tokens=1024, max_model_len=8192)
    engine.add("a", prompt(100, 1), max_tokens=4)
    engine.step()
    engine.add("long", prompt(5000, 2), max_tokens=1)
    kinds = [kind for kind, *_ in run_trace(engine)]
    assert kinds[:6] == [P] * 5 + [D]


# ----------------------------------------------------- context-length buckets


def test_decode_context_is_padded_to_the_smallest_context_bucket():
    engine = neuron_engine(
        max_model_len=4096,
        max_num_batched_tokens=4096,
        neuron_config={"decode_context_length_buckets": [256, 1024, 4096]},
    )
    engine.add("a", prompt(200, 1), max_tokens=60)
    engine.add("b", prompt(900, 2), max_tokens=3)
    engine.step()
    engine.step()
    output, _ = engine.step()
    record = engine.scheduler.last_step
    # b's context: 900 prompt tokens + 1 output being decoded.
    assert (record.context_len, record.context_len_padded) == (901, 1024)
    assert output.decode_context_len_padded == 1024
    seen = set()
    while engine.has_work():
        output, _ = engine.step()
        if output is not None and output.decode_context_len_padded is not None:
            seen.add(
                (
                    engine.scheduler.last_step.context_len,
                    output.decode_context_len_padded,
                )
            )
    # Once b finishes, a alone (context 200..259) fits the 256 bucket, then 1024.
    assert (256, 256) in seen and (257, 1024) in seen


def test_default_context_bucket_is_max_model_len():
    engine = neuron_engine(max_model_len=4096, max_num_batched_tokens=4096)
    engine.add("a", prompt(10, 1), max_tokens=2)
    engine.step()
    output, _ = engine.step()
    assert output.decode_context_len_padded == 4096


# ---------------------------------------------------- reservation admission

# 128 usable blocks of 16 = 2048 tokens; at max_model_len 1024, 2 requests.
SMALL_CACHE = dict(
    max_num_seqs=16,
    max_num_batched_tokens=1024,
    max_model_len=1024,
    block_size=16,
    num_kv_blocks=129,
)


def _run_counting_running(engine, max_steps=20_000):
    most = 0
    for _ in range(max_steps):
        if not engine.has_work():
            return most
        engine.step()
        most = max(most, len(engine.scheduler.running))
    raise AssertionError("no completion")


@pytest.mark.parametrize("mode", ["max_model_len", "reserve"])
def test_reserve_admits_by_real_need_and_never_preempts(mode):
    engine = neuron_engine(**SMALL_CACHE, neuron_config={"kv_admission": mode})
    for i in range(16):
        engine.add(f"r{i}", prompt(100, i), max_tokens=50)  # 10 blocks each
    most = _run_counting_running(engine)
    assert all(len(engine.tokens[f"r{i}"]) == 50 for i in range(16))
    assert engine.num_preemptions == 0
    # max_model_len mode: 2 at a time; reserve: 12 x 10 blocks fit in 128.
    assert most == (2 if mode == "max_model_len" else 12)


def test_reserve_with_every_request_growing_to_max_model_len():
    engine = neuron_engine(**SMALL_CACHE, neuron_config={"kv_admission": "reserve"})
    for i in range(6):
        engine.add(f"r{i}", prompt(600, i), max_tokens=424)  # 1024 = 64 blocks
    most = _run_counting_running(engine)
    assert most == 2
    assert all(len(engine.tokens[f"r{i}"]) == 424 for i in range(6))
    assert engine.num_preemptions == 0


def _check_random_workload(scheduler_cls, pipelined, prefix_caching, seed):
    rng = random.Random(seed)
    engine = neuron_engine(
        scheduler_cls,
        pipelined=pipelined,
        enable_prefix_caching=prefix_caching,
        **SMALL_CACHE,
        neuron_config={"kv_admission": "reserve", "max_prefills_per_batch": 4},
    )
    shared = prompt(320, 99)  # 20 full blocks several requests share
    expected = {}
    for i in range(40):
        length = rng.choice([1, 15, 16, 17, 200, 700, 1000, 1023])
        body = prompt(length, i)
        tokens = (shared + body)[:1023] if rng.random() < 0.5 else body
        max_tokens = rng.randint(1, 1024 - len(tokens))
        engine.add(f"r{i}", tokens, max_tokens=max_tokens)
        expected[f"r{i}"] = max_tokens
        for _ in range(rng.randint(0, 6)):
            if engine.has_work():
                engine.step()
        if rng.random() < 0.15:
            victim = f"r{rng.randrange(i + 1)}"
            if victim not in engine.finished:
                engine.abort([victim])
                expected.pop(victim)
    engine.run(max_steps=50_000)
    assert engine.num_preemptions == 0
    for request_id, max_tokens in expected.items():
        assert len(engine.tokens[request_id]) == max_tokens, request_id
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize(
    ("scheduler_cls", "pipelined"),
    [(NeuronScheduler, False), (NeuronAsyncScheduler, True)],
)
def test_reserve_never_preempts_on_adversarial_workloads(
    scheduler_cls, pipelined, prefix_caching
):
    for seed in range(5):
        _check_random_workload(scheduler_cls, pipelined, prefix_caching, seed)


def test_reserve_credits_prefix_blocks_shared_with_running_requests():
    def most_running(prefix_caching):
        engine = neuron_engine(
            **SMALL_CACHE,
            enable_prefix_caching=prefix_caching,
            neuron_config={"kv_admission": "reserve"},
        )
        shared = prompt(512, 7)  # 32 blocks
        engine.add("first", shared + prompt(16, 1), max_tokens=100)
        engine.step()
        for i in range(5):
            engine.add(f"r{i}", shared + prompt(16, i + 2), max_tokens=100)
        most = _run_counting_running(engine)
        assert engine.num_preemptions == 0
        return most

    # Alone each needs ceil((528 + 100) / 16) = 40 blocks: 3 fit in 128.
    # Sharing the 32 prefix blocks, each extra one needs 8: all 6 fit.
    assert most_running(False) == 3
    assert most_running(True) == 6


def test_prefill_token_cap_chunks_prompts_only_while_decodes_wait():
    config = {"max_prefill_tokens_with_decodes_waiting": 1024}
    engine = neuron_engine(neuron_config=config)
    engine.add("alone", prompt(3000, 1), max_tokens=3)
    assert run_trace(engine)[0] == (P, ("alone",), 3000, 4096, PRE)  # no decodes

    engine = neuron_engine(neuron_config={**config, "max_consecutive_prefill_steps": 2})
    engine.add("a", prompt(100, 1), max_tokens=4)
    engine.step()
    engine.add("b", prompt(3000, 2), max_tokens=2)
    assert run_trace(engine) == [
        (P, ("b",), 1024, 1024, PRE),
        (P, ("b",), 1024, 1024, PRE),
        (D, ("a",), 1, 1, DEC),  # stall bound
        (P, ("b",), 952, 1024, PRE),
        (D, ("a", "b"), 2, 2, DEC),
        (D, ("a",), 1, 1, DEC),
    ]


def test_prefill_token_cap_limits_packing_while_decodes_wait():
    engine = neuron_engine(
        neuron_config={
            "max_prefills_per_batch": 8,
            "max_prefill_tokens_with_decodes_waiting": 512,
        }
    )
    engine.add("a", prompt(100, 1), max_tokens=3)
    engine.step()
    for i, name in enumerate("bcd"):
        engine.add(name, prompt(200, i + 2), max_tokens=1)
    trace = run_trace(engine)
    assert trace[:2] == [
        (P, ("b", "c"), 400, 512, PRE),  # d would make 600 > 512
        (P, ("d",), 200, 256, PRE),
    ]


# ------------------------------------------------- decode split by context


def _decode_steps(engine):
    """Each decode step's (request ids, padded context) until idle."""
    steps = []
    for _ in range(2000):
        if not engine.has_work():
            return steps
        output, _ = engine.step()
        record = engine.scheduler.last_step
        if output is not None and record.kind.value == "decode":
            steps.append((frozenset(record.request_ids), record.context_len_padded))
    raise AssertionError("no completion")


SPLIT_ENGINE = dict(
    max_model_len=4096, max_num_batched_tokens=4096, max_num_seqs=8,
)  # fmt: skip
SPLIT_BUCKETS = {"decode_context_length_buckets": [256, 4096]}


@pytest.mark.parametrize(
    ("scheduler_cls", "pipelined"),
    [(NeuronScheduler, False), (NeuronAsyncScheduler, True)],
)
def test_decode_split_runs_short_and_long_contexts_in_turn(scheduler_cls, pipelined):
    # One step: 4 rows x 4096 positions; split: 4 x 256 (3 short rows, padded
    # to the 4 bucket) + 1 x 4096, saving 10,240 positions > 1,000.
    config = {**SPLIT_BUCKETS, "decode_split_break_even_positions": 1000}
    engine = neuron_engine(
        scheduler_cls, pipelined, **SPLIT_ENGINE, neuron_config=config
    )
    engine.add("long", prompt(3000, 9), max_tokens=20)
    short = {"s1", "s2", "s3"}
    for i, name in enumerate(sorted(short)):
        engine.add(name, prompt(100, i), max_tokens=20)
    steps = _decode_steps(engine)
    assert all(len(engine.tokens[r]) == 20 for r in [*short, "long"])
    # From the first decode on, the groups take turns, each at its own
    # context bucket, each request once per turn (19 decodes after the
    # token its prefill made).
    assert steps == [(frozenset(short), 256), (frozenset({"long"}), 4096)] * 19
    assert engine.num_preemptions == 0


def test_decode_split_only_where_it_saves_more_than_the_break_even():
    # Saving 10,240 positions does not beat a break-even of 20,000: no split.
    config = {**SPLIT_BUCKETS, "decode_split_break_even_positions": 20_000}
    engine = neuron_engine(**SPLIT_ENGINE, neuron_config=config)
    engine.add("long", prompt(3000, 9), max_tokens=20)
    for i in range(3):
        engine.add(f"s{i}", prompt(100, i), max_tokens=20)
    steps = _decode_steps(engine)
    assert steps == [(frozenset({"long", "s0", "s1", "s2"}), 4096)] * 19


def test_decode_split_break_even_must_be_a_positive_int():
    for bad in (0, -5, 1.5, "auto", True):
        with pytest.raises(ValueError, match="decode_split_break_even_positions"):
            neuron_engine(
                **SPLIT_ENGINE,
                neuron_config={"decode_split_break_even_positions": bad},
            )
