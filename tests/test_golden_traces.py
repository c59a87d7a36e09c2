"""Golden per-step traces for the design's examples, on the real vLLM
scheduler. Each line: (kind, requests, actual, padded, state) where actual /
padded are tokens for a prefill step and batch sizes for a decode step."""

import pytest

from helpers import neuron_engine, prompt, run_trace
from neuron_scheduler import SchedulerState

pytestmark = pytest.mark.matrix

P, D, E = "prefill", "decode", "empty"
PRE, DEC, IDLE = "ACTIVE_PREFILL", "ACTIVE_DECODE", "IDLE"


def test_short_prompt_pads_to_256_then_decodes():
    engine = neuron_engine(max_num_batched_tokens=8192)
    engine.add("a", prompt(200), max_tokens=3)
    assert run_trace(engine) == [
        (P, ("a",), 200, 256, PRE),
        (D, ("a",), 1, 1, DEC),
        (D, ("a",), 1, 1, DEC),
    ]
    assert len(engine.tokens["a"]) == 3


def test_5000_token_prompt_pads_to_8192_then_decodes():
    engine = neuron_engine(max_num_batched_tokens=8192)
    engine.add("a", prompt(5000), max_tokens=2)
    assert run_trace(engine) == [
        (P, ("a",), 5000, 8192, PRE),
        (D, ("a",), 1, 1, DEC),
    ]


def test_32000_token_prompt_is_chunked_and_stays_in_prefill():
    engine = neuron_engine(max_num_batched_tokens=8192, max_model_len=32768)
    engine.add("a", prompt(32000), max_tokens=2)
    assert run_trace(engine) == [
        (P, ("a",), 8192, 8192, PRE),
        (P, ("a",), 8192, 8192, PRE),
        (P, ("a",), 8192, 8192, PRE),
        (P, ("a",), 7424, 8192, PRE),
        (D, ("a",), 1, 1, DEC),
    ]


def test_three_waiting_prompts_admitted_one_per_step_with_decodes_hidden():
    engine = neuron_engine(max_num_batched_tokens=8192, max_num_seqs=8)
    engine.add("a", prompt(100, 1), max_tokens=4)
    engine.step()  # a prefills alone
    engine.add("b", prompt(300, 2), max_tokens=3)
    engine.add("c", prompt(600, 3), max_tokens=3)
    engine.add("d", prompt(1000, 4), max_tokens=3)
    assert run_trace(engine) == [
        (P, ("b",), 300, 512, PRE),  # a's decode hidden
        (P, ("c",), 600, 1024, PRE),
        (P, ("d",), 1000, 1024, PRE),
        (D, ("a", "b", "c", "d"), 4, 4, DEC),  # decodes resume
        (D, ("a", "b", "c", "d"), 4, 4, DEC),
        (D, ("a",), 1, 1, DEC),
    ]


def test_three_decodes_pad_to_batch_four():
    engine = neuron_engine(max_num_batched_tokens=8192, max_num_seqs=8)
    for i, request_id in enumerate("abc"):
        engine.add(request_id, prompt(50, i), max_tokens=2)
    assert run_trace(engine) == [
        (P, ("a",), 50, 128, PRE),
        (P, ("b",), 50, 128, PRE),
        (P, ("c",), 50, 128, PRE),
        (D, ("a", "b", "c"), 3, 4, DEC),
    ]


def test_decode_padding_recorded_on_output():
    engine = neuron_engine(max_num_batched_tokens=8192, max_num_seqs=8)
    for i, request_id in enumerate("abc"):
        engine.add(request_id, prompt(50, i), max_tokens=2)
    for _ in range(3):
        engine.step()
    output, _ = engine.step()
    assert output.num_scheduled_tokens_padded == {"a": 1, "b": 1, "c": 1}
    assert output.num_seqs_padded == 4
    totals = engine.scheduler.metrics
    assert (totals.decode_slots, totals.decode_slots_padded) == (3, 4)


def test_prefix_cache_hit_pads_only_new_tokens():
    engine = neuron_engine(
        max_num_batched_tokens=8192, block_size=8, enable_prefix_caching=True
    )
    shared = prompt(1000, 9)
    engine.add("warm", shared + prompt(8, 10), max_tokens=1)
    engine.run()
    engine.add("a", shared + prompt(4000, 11), max_tokens=1)
    assert run_trace(engine) == [(P, ("a",), 4000, 4096, PRE)]


def test_idle_when_empty():
    engine = neuron_engine()
    assert engine.scheduler.state is SchedulerState.IDLE
    engine.add("a", prompt(10), max_tokens=2)
    engine.step()
    assert engine.scheduler.state is SchedulerState.ACTIVE_PREFILL
    engine.step()
    assert engine.scheduler.state is SchedulerState.ACTIVE_DECODE
    engine.run()
    assert engine.scheduler.get_num_unfinished_requests() == 0
    engine.scheduler.schedule()
    assert engine.scheduler.state is SchedulerState.IDLE
    assert engine.scheduler.last_step.kind.value == E


def test_padded_counts_on_output_and_actual_counts_drive_vllm():
    engine = neuron_engine(max_num_batched_tokens=8192, max_model_len=32768)
    request = engine.add("a", prompt(20000), max_tokens=1)
    output, _ = engine.step()
    assert output.num_scheduled_tokens == {"a": 8192}
    assert output.num_scheduled_tokens_padded == {"a": 8192}
    assert output.num_seqs_padded == 1
    output, _ = engine.step()
    output, _ = engine.step()
    assert output.num_scheduled_tokens == {"a": 20000 - 2 * 8192}
    assert output.num_scheduled_tokens_padded == {"a": 4096}
    assert request.num_computed_tokens == 20000  # actual counts, not padded
    totals = engine.scheduler.metrics
    assert totals.prefill_tokens == 20000
    assert totals.prefill_tokens_padded == 8192 * 2 + 4096
