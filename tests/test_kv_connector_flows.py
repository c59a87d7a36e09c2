"""The KV-connector flows vLLM uses for disaggregated prefill/decode and KV
offloading, and the other places the parent's own decisions must survive
NeuronScheduler: one regression test per defect found by vLLM's scheduler
tests, on the real scheduler with a simulated connector (remote KV hits,
async loads, lookups that are not ready)."""

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from helpers import neuron_engine, prompt
from neuron_scheduler import NeuronAsyncScheduler, NeuronScheduler
from neuron_scheduler.offline.engine import (
    EngineSettings,
    OfflineEngine,
    build_scheduler,
)
from neuron_scheduler.vllm_internals import scheduler_features

pytestmark = pytest.mark.matrix


def _engine(scheduler_cls, pipelined=False, **settings):
    return OfflineEngine(
        build_scheduler(scheduler_cls, EngineSettings(**settings)), pipelined=pipelined
    )


def _loading(engine):
    return sum(
        1
        for r in engine.requests.values()
        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    )


# Defect 1: the KV window counted only running requests.
WINDOW_OF_TWO = dict(
    block_size=16,
    num_kv_blocks=33,  # 32 usable: two requests at max_model_len
    max_model_len=256,
    max_num_batched_tokens=256,
    kv_connector={"remote_tokens": 128, "load_steps": 8},
)


def _four_remote_prefixes(engine):
    for i in range(4):
        engine.add(f"r{i}", prompt(129, i), max_tokens=127)
    most_loading = 0
    while engine.has_work():
        engine.step()
        most_loading = max(most_loading, _loading(engine))
    return most_loading


def test_stock_overcommits_the_cache_with_async_loads():
    """The scenario bites: vLLM's own scheduler starts three loads for a
    cache that holds two requests at max_model_len, then preempts."""
    engine = _engine(Scheduler, **WINDOW_OF_TWO)
    assert _four_remote_prefixes(engine) == 3
    assert engine.num_preemptions > 0


@pytest.mark.parametrize("scheduler_cls", [NeuronScheduler, NeuronAsyncScheduler])
def test_kv_window_counts_requests_loading_or_holding_kv(scheduler_cls):
    engine = _engine(
        scheduler_cls, pipelined=scheduler_cls is NeuronAsyncScheduler, **WINDOW_OF_TWO
    )
    assert engine.scheduler.admission_limits.max_kv_concurrent == 2
    assert _four_remote_prefixes(engine) == 2
    assert engine.num_preemptions == 0
    assert all(len(engine.tokens[f"r{i}"]) == 127 for i in range(4))


# Defect 2: decodes were hidden although the parent did not run the prefill.


def test_no_empty_step_while_a_connector_lookup_is_not_ready():
    engine = _engine(NeuronScheduler, kv_connector={})
    engine.add("a", prompt(32, 1), max_tokens=10)
    engine.step()
    engine.add(
        "b", prompt(32, 2), max_tokens=2, kv_transfer_params={"lookup_defers": 5}
    )
    scheduled = [sorted(engine.step()[0].num_scheduled_tokens) for _ in range(7)]
    # Five lookups defer: "a" decodes meanwhile; then "b" prefills alone.
    assert scheduled[:5] == [["a"]] * 5
    assert scheduled[5] == ["b"]
    assert scheduled[6] == ["a", "b"]
    assert engine.scheduler.connector.lookups["b"] == 6


def test_no_empty_step_when_the_admitted_prefill_cannot_get_blocks():
    """vLLM's allocation refuses the admitted prompt (here by injection: a
    block pool that turns it down five times): the step runs the decodes."""
    engine = neuron_engine(max_num_seqs=4)
    manager = engine.scheduler.kv_cache_manager
    allocate, refusals = manager.allocate_slots, []

    def refuse_b(request, *args, **kwargs):
        if request.request_id == "b" and len(refusals) < 5:
            refusals.append(request.request_id)
            return None
        return allocate(request, *args, **kwargs)

    manager.allocate_slots = refuse_b
    engine.add("a", prompt(200, 1), max_tokens=30)
    engine.step()
    engine.add("b", prompt(200, 2), max_tokens=4)
    for _ in range(5):
        output, _ = engine.step()
        assert sorted(output.num_scheduled_tokens) == ["a"]
        assert engine.scheduler.last_step.kind.value == "decode"
    assert len(refusals) == 5
    output, _ = engine.step()
    assert sorted(output.num_scheduled_tokens) == ["b"]
    engine.run()
    assert len(engine.tokens["b"]) == 4 and engine.num_preemptions == 0


def test_admission_keeps_vllms_watermark_free():
    """vLLM keeps its watermark only while something runs; a prefill pass
    hides the running decodes from it, so admission keeps it instead."""
    settings = dict(max_model_len=1024, num_kv_blocks=257)  # 4 at max_model_len
    plain = neuron_engine(**settings).scheduler
    assert plain.admission_limits.max_kv_concurrent == 4
    watermarked = neuron_engine(**settings, watermark=0.3).scheduler
    assert watermarked.admission_limits.reserved_kv_blocks == int(0.3 * 257)
    assert watermarked.admission_limits.max_kv_concurrent == 2


def test_cache_below_one_max_model_len_request_finishes_like_stock():
    """Block size 4, 10 blocks: no request fits at max_model_len, so
    admission goes by each request's own need; both finish in as many steps
    as with vLLM's scheduler, never an empty step, never a preemption."""
    settings = dict(
        block_size=4, num_kv_blocks=10, max_model_len=64, max_num_batched_tokens=64
    )
    steps = {}
    for scheduler_cls in (Scheduler, NeuronScheduler):
        engine = _engine(scheduler_cls, **settings)
        engine.add("a", prompt(24, 1), max_tokens=3)
        engine.add("b", prompt(24, 2), max_tokens=3)
        steps[scheduler_cls] = 0
        while engine.has_work():
            output, _ = engine.step()
            steps[scheduler_cls] += 1
            if engine.scheduler.get_num_unfinished_requests():
                assert output.total_num_scheduled_tokens > 0
        assert engine.num_preemptions == 0
        assert [len(engine.tokens[r]) for r in "ab"] == [3, 3]
    assert steps[NeuronScheduler] == steps[Scheduler]


# Defect 3: starting an async KV load counted as the step's one prefill.


def _transfers_behind_a_decode(engine, prefix, decode_tokens):
    """Request "a" decoding (``decode_tokens`` in all), then six fully
    transferred 64-token prompts ``<prefix>0``..``<prefix>5`` of 4 tokens,
    each load taking 3 steps."""
    engine.add("a", prompt(32, 1), max_tokens=decode_tokens)
    while not engine.tokens["a"]:
        engine.step()
    for i in range(6):
        engine.add(
            f"{prefix}{i}",
            prompt(64, 10 + i),
            max_tokens=4,
            kv_transfer_params={"remote_tokens": 64, "load_steps": 3},
        )


@pytest.mark.parametrize("scheduler_cls", [NeuronScheduler, NeuronAsyncScheduler])
def test_a_burst_of_remote_kv_arrivals_starts_every_load_in_one_step(scheduler_cls):
    engine = _engine(
        scheduler_cls, pipelined=scheduler_cls is NeuronAsyncScheduler, kv_connector={}
    )
    _transfers_behind_a_decode(engine, "p", decode_tokens=20)
    output, _ = engine.step()
    assert _loading(engine) == 6
    assert "a" in output.num_scheduled_tokens  # the decode ran in that step
    engine.run()
    assert all(len(engine.tokens[f"p{i}"]) == 4 for i in range(6))
    assert engine.num_preemptions == 0


@pytest.mark.parametrize("scheduler_cls", [NeuronScheduler, NeuronAsyncScheduler])
def test_with_kv_loads_taking_slots_a_decode_engine_pulls_only_into_free_slots(
    scheduler_cls,
):
    """``kv_loads_take_slots``: with 1 request running and 4 slots, a burst
    of 6 fully transferred prompts starts 3 loads; the others start as slots
    free, so running plus loading never exceeds ``max_num_seqs``."""
    engine = _engine(
        scheduler_cls,
        pipelined=scheduler_cls is NeuronAsyncScheduler,
        max_num_seqs=4,
        kv_connector={},
        neuron_config={"kv_loads_take_slots": True},
    )
    _transfers_behind_a_decode(engine, "d", decode_tokens=12)
    engine.step()
    assert _loading(engine) == 3
    most_taken = 0
    while engine.has_work():
        engine.step()
        holding = sum(
            1
            for r in engine.requests.values()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            or (r.status == RequestStatus.WAITING and r.num_computed_tokens > 0)
        )
        most_taken = max(most_taken, len(engine.scheduler.running) + holding)
    assert most_taken == 4
    assert all(len(engine.tokens[f"d{i}"]) == 4 for i in range(6))
    assert engine.num_preemptions == 0


def test_fully_transferred_requests_join_the_decode_batch():
    """The decode side of P/D: the whole prompt arrives by KV transfer and
    only its last token is left: a decode row, not a prefill step."""
    engine = _engine(NeuronScheduler, kv_connector={}, max_num_seqs=8)
    engine.add("a", prompt(32, 1), max_tokens=30)
    engine.step()
    for i in range(3):
        engine.add(
            f"d{i}",
            prompt(48, 20 + i),
            max_tokens=5,
            kv_transfer_params={"remote_tokens": 48, "load_steps": 2},
        )
    prefill_steps = 0
    first_step_of = {}
    while engine.has_work():
        output, _ = engine.step()
        record = engine.scheduler.last_step
        prefill_steps += record.kind.value == "prefill"
        for request_id in output.num_scheduled_tokens:
            first_step_of.setdefault(
                request_id, (record, dict(output.num_scheduled_tokens))
            )
    assert prefill_steps == 0  # after a's own prompt: the transferred have none
    for i in range(3):
        record, scheduled = first_step_of[f"d{i}"]
        assert record.kind.value == "decode" and "a" in scheduled
        assert scheduled[f"d{i}"] == 1  # only the last prompt token
    assert all(len(engine.tokens[f"d{i}"]) == 5 for i in range(3))


# Defect 4: schedule(throttle_prefills=True) had no effect.


def test_dp_throttle_gives_the_step_to_running_decodes():
    engine = neuron_engine(max_num_seqs=8)
    engine.add("a", prompt(64, 1), max_tokens=10)
    engine.step()
    engine.add("b", prompt(64, 2), max_tokens=2)
    scheduler = engine.scheduler
    throttled = scheduler.schedule(throttle_prefills=True)
    assert sorted(throttled.num_scheduled_tokens) == ["a"]
    from neuron_scheduler import AdmissionRule

    assert scheduler.metrics.refusals[AdmissionRule.DP_THROTTLE] == 1
    engine._in_flight.append(throttled)
    engine.step()  # applies the throttled step, schedules the next
    assert "b" in engine.scheduler.last_step.request_ids


def test_dp_throttle_backs_off_when_the_last_release_was_capacity_bound():
    engine = neuron_engine(max_num_seqs=8, max_num_batched_tokens=256)
    engine.add("a", prompt(64, 1), max_tokens=10)
    engine.step()
    engine.add("b", prompt(64, 2), max_tokens=2)
    engine.add("c", prompt(64, 3), max_tokens=2)
    engine.step()  # releases "b"; "c" is left waiting: capacity-bound
    assert engine.scheduler.prefill_capacity_bound
    output = engine.scheduler.schedule(throttle_prefills=True)
    assert "c" in output.num_scheduled_tokens


# Defect 5: long_prefill_token_threshold was decided on the reshaped queues.


@pytest.mark.parametrize(
    "threshold, adaptive, first_chunk",
    [(400, False, 400), (100, True, 512)],
    ids=["threshold", "adaptive-fair-share"],
)
def test_long_prefill_threshold_counts_the_hidden_decodes(
    threshold, adaptive, first_chunk
):
    if adaptive and not scheduler_features().long_prefill_threshold_with_others:
        pytest.skip("this vLLM (before 0.31) has no adaptive long-prefill threshold")
    scheduler = build_scheduler(
        NeuronScheduler, EngineSettings(max_num_seqs=8, max_num_batched_tokens=1024)
    )
    scheduler.scheduler_config.long_prefill_token_threshold = threshold
    scheduler.adaptive_long_prefill_threshold = adaptive
    engine = OfflineEngine(scheduler)
    engine.add("a", prompt(64, 1), max_tokens=10)
    engine.step()
    engine.add("long", prompt(2000, 2), max_tokens=2)
    output, _ = engine.step()
    # Two eligible requests (the decode is hidden, not gone): the prompt is
    # capped as vLLM caps it, at the threshold or the fair share 1024 // 2.
    assert output.num_scheduled_tokens == {"long": first_chunk}
