"""Holdback-queue bookkeeping: exceptions in the parent lose nothing,
priority queues are honoured, blocked and KV-holding waiting requests never
slip into a decode batch."""

import dataclasses

import pytest
from vllm.v1.request import RequestStatus

from helpers import neuron_engine, prompt, run_trace, waiting_requests
from neuron_scheduler import NeuronScheduler
from neuron_scheduler.vllm_internals import lowered_limits, scheduler_features

pytestmark = pytest.mark.matrix


class FailingOnce(NeuronScheduler):
    """Raises inside the parent's scheduling pass on a chosen call."""

    fail_on_call = 3

    def _call_base_schedule(self, throttle_prefills):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("injected fault")
        return super()._call_base_schedule(throttle_prefills)


def _snapshot(scheduler):
    return (
        [
            [r.request_id for r in getattr(scheduler, queue.attribute)]
            for queue in scheduler_features().waiting_queues
        ],
        [r.request_id for r in scheduler.running],
        [getattr(scheduler, limit) for limit in lowered_limits()],
        scheduler.prefill_streak,
    )


class FailingEvery(NeuronScheduler):
    """Raises inside the parent's scheduling pass on every ``period``-th call."""

    period = 3

    def _call_base_schedule(self, throttle_prefills):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls % self.period == 0:
            raise RuntimeError("injected fault")
        return super()._call_base_schedule(throttle_prefills)


@pytest.mark.parametrize(
    "neuron_config",
    [
        {},
        {
            "max_consecutive_prefill_steps": 1,
            "max_prefill_tokens_with_decodes_waiting": 128,
        },
        {"kv_admission": "reserve", "max_prefills_per_batch": 3},
    ],
    ids=["design", "stall-bound", "reserve-packed"],
)
def test_repeated_faults_lose_nothing_under_every_option(neuron_config):
    engine = neuron_engine(
        FailingEvery,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        max_model_len=2048,
        num_kv_blocks=257,
        neuron_config=neuron_config,
    )
    expected = {}
    for i in range(10):
        length = 1500 if i % 4 == 0 else 100 + 37 * i  # some chunked prompts
        engine.add(f"r{i}", prompt(length, i), max_tokens=3 + i % 4)
        expected[f"r{i}"] = 3 + i % 4
    faults = 0
    for _ in range(2000):
        if not engine.has_work():
            break
        before = _snapshot(engine.scheduler)
        try:
            engine.step()
        except RuntimeError as error:
            assert "injected fault" in str(error)
            assert _snapshot(engine.scheduler) == before
            faults += 1
    assert faults > 5 and not engine.has_work()
    assert {rid: len(engine.tokens[rid]) for rid in expected} == expected
    assert engine.num_preemptions == 0


def test_exception_in_parent_restores_queues_and_limits():
    engine = neuron_engine(FailingOnce, max_num_seqs=4)
    for i in range(6):
        engine.add(f"r{i}", prompt(100, i), max_tokens=3)
    engine.step()
    engine.step()
    before = _snapshot(engine.scheduler)
    assert before[0] and before[2]  # something waiting and running
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.scheduler.schedule()
    assert _snapshot(engine.scheduler) == before
    engine.run()
    assert all(len(engine.tokens[f"r{i}"]) == 3 for i in range(6))


def test_priority_policy_admits_in_priority_order():
    engine = neuron_engine(policy="priority", max_num_seqs=8)
    for request_id, priority in (("low", 5), ("high", 0), ("mid", 1)):
        engine.add(request_id, prompt(100, priority), max_tokens=1, priority=priority)
    trace = run_trace(engine)
    assert [line[1] for line in trace] == [("high",), ("mid",), ("low",)]


def test_fcfs_admission_keeps_arrival_order():
    engine = neuron_engine(max_num_seqs=8)
    for request_id in ("c", "a", "b"):
        engine.add(request_id, prompt(100, ord(request_id)), max_tokens=1)
    assert [line[1] for line in run_trace(engine)] == [("c",), ("a",), ("b",)]


def test_blocked_waiting_request_is_passed_over_and_never_mixed():
    engine = neuron_engine(max_num_seqs=8)
    engine.add("first", prompt(100, 1), max_tokens=4)
    blocked = engine.add("blocked", prompt(100, 2), max_tokens=2)
    # A request whose grammar is still compiling: vLLM parks it in waiting.
    engine.scheduler.waiting.remove_request(blocked)
    blocked.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    engine.scheduler._enqueue_waiting_request(blocked)
    engine.add("after", prompt(100, 3), max_tokens=2)
    trace = [engine.step() and engine.scheduler.last_step for _ in range(4)]
    kinds = [(r.kind.value, r.request_ids) for r in trace]
    assert kinds[0] == ("prefill", ("first",))
    assert kinds[1] == ("prefill", ("after",))  # blocked one passed over
    assert all("blocked" not in ids for _, ids in kinds)
    assert blocked in waiting_requests(engine.scheduler)
    blocked.status = RequestStatus.WAITING  # grammar ready
    engine.run()
    assert len(engine.tokens["blocked"]) == 2


def test_kv_holding_waiting_request_is_not_slipped_into_decode_steps():
    engine = neuron_engine(max_num_seqs=8)
    engine.add("a", prompt(100, 1), max_tokens=5)
    engine.step()
    holder = engine.add("remote", prompt(64, 2), max_tokens=1)
    engine.scheduler.waiting.remove_request(holder)
    # A request whose KV is still arriving from a remote connector.
    holder.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.scheduler._enqueue_waiting_request(holder)
    for _ in range(3):
        output, _ = engine.step()
        assert "remote" not in output.num_scheduled_tokens
        assert engine.scheduler.last_step.kind.value == "decode"
        assert [
            r
            for r in waiting_requests(engine.scheduler)
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ] == [holder]
    engine.abort(["remote"])
    engine.run()
    assert len(engine.tokens["a"]) == 5


def test_abort_while_held_back_or_mid_prefill_frees_everything():
    engine = neuron_engine(max_num_seqs=4, max_num_batched_tokens=512)
    engine.add("long", prompt(2000, 1), max_tokens=3)
    engine.add("waiting", prompt(100, 2), max_tokens=3)
    engine.step()  # long: first chunk
    engine.abort(["long", "waiting"])
    assert not engine.scheduler.waiting and not engine.scheduler.running
    engine.add("next", prompt(100, 3), max_tokens=2)
    engine.run()
    assert len(engine.tokens["next"]) == 2
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_mixed_batch_is_detected():
    from neuron_scheduler.step import MixedBatchError, ScheduledRequest, describe_step

    requests = [ScheduledRequest("p", 0, 500, 500), ScheduledRequest("d", 10, 10, 1)]
    with pytest.raises(RuntimeError, match="1 prefill and 1 decode") as error:
        describe_step(requests, (512,), (1, 2))
    assert isinstance(error.value, MixedBatchError)


def test_parent_mixing_raises_runtime_error():
    """If the parent ever mixes (here: hiding disabled), schedule() raises."""

    class NoHiding(NeuronScheduler):
        def _plan(self, throttle_prefills):
            plan = super()._plan(throttle_prefills)
            return dataclasses.replace(plan, hidden=[], fallback=None)

    engine = neuron_engine(NoHiding, max_num_seqs=4)
    engine.add("a", prompt(100, 1), max_tokens=4)
    engine.step()
    engine.add("b", prompt(100, 2), max_tokens=4)
    with pytest.raises(RuntimeError, match="1 prefill and 1 decode"):
        engine.step()
