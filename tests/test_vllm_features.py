"""vLLM scheduler features under NeuronScheduler that the README's feature
table lists and no other test file covers: speculative decoding, LoRA's
max_loras, pause/resume. (Chunked prefill, prefix caching, priority, async
scheduling, structured output, KV connectors and the DP throttle have their
own files.)"""

import pytest
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from helpers import neuron_engine, prompt, waiting_requests
from neuron_scheduler import NeuronScheduler
from neuron_scheduler.vllm_internals import scheduler_features

pytestmark = pytest.mark.matrix


def test_speculative_decode_steps_are_rows_of_one_plus_k_tokens():
    k = 3
    engine = neuron_engine(max_num_seqs=4, num_speculative_tokens=k)
    scheduler = engine.scheduler
    for i in range(3):
        engine.add(f"r{i}", prompt(40, i), max_tokens=12)
    decode_steps = 0
    while engine.has_work():
        output = scheduler.schedule()
        record = scheduler.last_step
        if record.kind.value == "decode":
            decode_steps += 1
            # Every row verifies k drafts (real or placeholder): one shape.
            assert set(output.num_scheduled_tokens.values()) == {1 + k}
            assert output.num_seqs_padded >= len(output.num_scheduled_tokens)
        # The model accepts the first draft (plus its own bonus token).
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            request = scheduler.requests[rid]
            done = request.num_computed_tokens >= request.num_prompt_tokens
            drafts = output.scheduled_spec_decode_tokens.get(rid, [])
            sampled.append(([5] + [7]) if drafts and done else ([5] if done else []))
        scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={rid: j for j, rid in enumerate(ids)},
                sampled_token_ids=sampled,
            ),
        )
        live = [rid for rid in ids if rid in scheduler.requests]
        scheduler.update_draft_token_ids(DraftTokenIds(live, [[1] * k for _ in live]))
    assert decode_steps > 0
    assert not scheduler.requests


def test_lora_requests_wait_for_an_adapter_slot():
    """max_loras=1: vLLM passes over a request whose adapter does not fit the
    batch; admission follows, and no step mixes kinds."""
    engine = neuron_engine(max_num_seqs=4, max_loras=1)
    for i, adapter in enumerate([1, 1, 2]):
        request = engine.add(f"r{i}", prompt(40, i), max_tokens=4)
        request.lora_request = LoRARequest(f"lora{adapter}", adapter, "/none")
    adapters_per_step = []
    while engine.has_work():
        output, _ = engine.step()
        adapters = {
            engine.requests[rid].lora_request.lora_int_id
            for rid in output.num_scheduled_tokens
        }
        adapters_per_step.append(adapters)
    assert all(len(a) <= 1 for a in adapters_per_step)
    assert {2} in adapters_per_step  # the second adapter ran once the first left
    assert all(len(engine.tokens[f"r{i}"]) == 4 for i in range(3))


def test_pause_new_drains_running_work_and_admits_nothing_new():
    engine = neuron_engine(max_num_seqs=4)
    engine.add("a", prompt(40, 1), max_tokens=6)
    engine.step()
    engine.add("b", prompt(40, 2), max_tokens=2)
    engine.scheduler.set_pause_state(PauseState.PAUSED_NEW)
    for _ in range(8):
        output, _ = engine.step()
        assert output is None or "b" not in output.num_scheduled_tokens
    assert len(engine.tokens["a"]) == 6  # running work drained
    assert not engine.tokens["b"]
    engine.scheduler.set_pause_state(PauseState.PAUSED_ALL)
    output, _ = engine.step()
    assert output is None or output.total_num_scheduled_tokens == 0
    engine.scheduler.set_pause_state(PauseState.UNPAUSED)
    engine.run()
    assert len(engine.tokens["b"]) == 2


def test_a_full_prefix_cache_hit_joins_the_decodes():
    """A prompt the prefix cache holds whole needs only its last token: one
    decode row in the running decode step, no prefill step of its own."""
    engine = neuron_engine(max_num_seqs=4, enable_prefix_caching=True)
    shared = prompt(64, 1) + [7]  # 4 full blocks, then one more token
    engine.add("a", shared, max_tokens=20)
    engine.step()
    engine.add("b", list(shared), max_tokens=3)
    output, _ = engine.step()
    assert output.num_scheduled_tokens == {"a": 1, "b": 1}
    assert engine.scheduler.last_step.kind.value == "decode"
    engine.run()
    assert len(engine.tokens["b"]) == 3


def _cadence(scheduler_cls, interval):
    """Step kinds while a decode runs and a new prompt arrives whenever none
    waits, under ``prefill_schedule_interval``."""
    engine = neuron_engine(
        scheduler_cls, max_num_seqs=16, prefill_schedule_interval=interval
    )
    engine.add("run", prompt(32, 0), max_tokens=40)
    kinds = []
    for i in range(12):
        if not waiting_requests(engine.scheduler):
            engine.add(f"p{i}", prompt(32, i + 1), max_tokens=40)
        output, _ = engine.step()
        kinds.append("P" if output.scheduled_new_reqs else "d")
    return "".join(kinds)


@pytest.mark.parametrize("interval", [2, 3])
def test_the_local_prefill_cadence_holds_prefills_as_stock_does(interval):
    if not scheduler_features().local_prefill_interval:
        pytest.skip("this vLLM (before 0.33) has no local prefill cadence")
    stock = _cadence(Scheduler, interval)
    ours = _cadence(NeuronScheduler, interval)
    # Stock runs a prefill every `interval` steps (mixed with the decodes);
    # ours runs the same prefill steps, alone, and the decodes in between.
    assert stock == ("P" + "d" * (interval - 1)) * (12 // interval)
    assert ours == stock


def _holder_runs_while_paused_new(scheduler_cls):
    """Whether a request whose KV transfer finished runs under PAUSED_NEW."""
    engine = neuron_engine(scheduler_cls, max_num_seqs=4, kv_connector={})
    engine.add("a", prompt(40, 1), max_tokens=12)
    engine.step()
    engine.add(
        "r", prompt(64, 2), max_tokens=3, kv_transfer_params={"remote_tokens": 64}
    )
    engine.step()  # starts the load; the engine reports it done
    assert engine.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.scheduler.set_pause_state(PauseState.PAUSED_NEW)
    ran = False
    for _ in range(4):
        output, _ = engine.step()
        ran = ran or (output is not None and "r" in output.num_scheduled_tokens)
    return ran


def test_pause_new_treats_a_finished_kv_transfer_as_stock_does():
    # vLLM 0.32+ still drains waiting KV holders under PAUSED_NEW; before,
    # no waiting request runs. Ours follows the installed vLLM either way.
    ours = _holder_runs_while_paused_new(NeuronScheduler)
    assert ours == _holder_runs_while_paused_new(Scheduler)
    drains = [q.drained_when_paused_new for q in scheduler_features().waiting_queues]
    assert ours == any(drains)
