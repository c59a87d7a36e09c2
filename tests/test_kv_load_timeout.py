"""A request whose KV load is never reported fails after
``kv_load_timeout_s``, its blocks freed, and the engine keeps serving; on
the real scheduler (both variants) with a simulated connector."""

import pytest
from vllm.v1.request import RequestStatus

from helpers import needs_cpu_engine, neuron_engine, prompt
from neuron_scheduler import NeuronAsyncScheduler, NeuronScheduler
from neuron_scheduler.config import EngineLimits, NeuronConfig
from neuron_scheduler.kv_load_timeout import KvLoadWatch
from neuron_scheduler.vllm_internals import num_free_blocks

pytestmark = pytest.mark.matrix

TIMEOUT_S = 5.0


class StepClock:
    """One second a step: the engine calls ``tick`` before each."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def tick(self):
        self.now += 1.0


def _engine(scheduler_cls, timeout_s=TIMEOUT_S):
    engine = neuron_engine(
        scheduler_cls,
        pipelined=scheduler_cls is NeuronAsyncScheduler,
        max_model_len=256,
        max_num_batched_tokens=256,
        num_kv_blocks=64,
        neuron_config={"kv_load_timeout_s": timeout_s},
        kv_connector={"remote_tokens": 0},
    )
    clock = StepClock()
    engine.scheduler.kv_load_watch.clock = clock
    return engine, clock


@pytest.mark.parametrize("scheduler_cls", [NeuronScheduler, NeuronAsyncScheduler])
def test_a_load_never_reported_fails_after_the_timeout_with_its_blocks_freed(
    scheduler_cls,
):
    # "lost" loads 128 remote tokens; its worker reports nothing for 40 steps
    # (far past the 5 s timeout), then reports late. "local" has no remote KV.
    engine, clock = _engine(scheduler_cls)
    free_at_start = num_free_blocks(engine.scheduler.kv_cache_manager)
    engine.add("local", prompt(60, 1), max_tokens=30)
    engine.add(
        "lost", prompt(160, 2), max_tokens=4,
        kv_transfer_params={"remote_tokens": 128, "load_steps": 40},
    )  # fmt: skip
    failed_at = None
    while engine.has_work():
        clock.tick()
        engine.step()
        if failed_at is None and "lost" in engine.finished:
            failed_at = clock.now
            # Its blocks are back in the pool at once: only "local" holds any.
            held = engine.scheduler.kv_cache_manager.get_blocks("local")
            assert num_free_blocks(engine.scheduler.kv_cache_manager) == (
                free_at_start - len(held.get_block_ids()[0])
            )
            assert "lost" not in engine.scheduler.requests
    assert engine.finished["lost"] == "error"
    assert engine.tokens["lost"] == []
    # Loading from the step it was scheduled (step 1 or 2), failed once 5 s
    # had passed, long before its late report (step 41, dropped).
    assert TIMEOUT_S + 1 <= failed_at <= TIMEOUT_S + 3
    assert engine.scheduler.kv_load_watch.abandoned == frozenset()
    assert len(engine.tokens["local"]) == 30 and engine.finished["local"] != "error"
    # The engine keeps serving: a new request completes.
    engine.add("next", prompt(40, 3), max_tokens=3)
    engine.run()
    assert len(engine.tokens["next"]) == 3
    assert num_free_blocks(engine.scheduler.kv_cache_manager) == free_at_start


def test_a_load_reported_in_time_is_not_failed():
    engine, clock = _engine(NeuronScheduler)
    engine.add(
        "slow", prompt(160, 2), max_tokens=4,
        kv_transfer_params={"remote_tokens": 128, "load_steps": 3},
    )  # fmt: skip
    while engine.has_work():
        clock.tick()
        engine.step()
    assert len(engine.tokens["slow"]) == 4 and engine.finished["slow"] != "error"


def test_without_the_option_a_lost_load_waits_as_vllm_does():
    engine = neuron_engine(
        max_model_len=256, max_num_batched_tokens=256, num_kv_blocks=64,
        kv_connector={"remote_tokens": 0},
    )  # fmt: skip
    assert engine.scheduler.kv_load_watch is None
    engine.add(
        "lost", prompt(160, 2), max_tokens=4,
        kv_transfer_params={"remote_tokens": 128, "load_steps": 10**9},
    )  # fmt: skip
    for _ in range(50):
        engine.step()
    assert engine.requests["lost"].status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_the_watch_forgets_loads_that_end_and_drops_only_late_reports():
    clock = StepClock()
    watch = KvLoadWatch(2.0, clock)
    assert watch.expired(["a", "b"]) == []
    clock.tick()
    assert watch.expired(["a"]) == []  # b's load ended: forgotten
    clock.tick()
    assert watch.expired(["a", "b"]) == ["a"]  # b seen anew at t=2
    assert watch.abandoned == {"a"}

    class Output:
        finished_recving = {"a", "c"}

    output = Output()
    assert watch.drop_late_reports(output) == {"a"}
    assert output.finished_recving == {"c"} and watch.abandoned == frozenset()


LIMITS = EngineLimits(max_num_batched_tokens=256, max_model_len=256, max_num_seqs=4)


@pytest.mark.parametrize("value", [0, -1.5, "5", True, float("inf"), float("nan")])
def test_a_timeout_that_is_not_positive_seconds_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="kv_load_timeout_s") as error:
        NeuronConfig.from_dict({"kv_load_timeout_s": value}, LIMITS)
    assert repr(value) in str(error.value)
    assert (
        NeuronConfig.from_dict({"kv_load_timeout_s": 2}, LIMITS).kv_load_timeout_s
        == 2.0
    )


@pytest.fixture
def in_process_connector():
    """Shut vLLM's in-process KV connector down after the test, passed or
    failed: vLLM 0.29 and 0.30 keep it after the engine is gone, and later
    engines in this process would find it."""
    yield
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_shutdown,
    )

    ensure_kv_transfer_shutdown()


@pytest.mark.slow
@needs_cpu_engine
def test_the_engine_fails_a_lost_load_and_keeps_serving(tmp_path, in_process_connector):
    """vllm.LLM with a connector whose worker never reports a load (the
    simulated connector's worker side does nothing): the request that
    loads fails with an error after the timeout; the others, before and
    after it, generate."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from neuron_scheduler.offline.sim_connector import CONNECTOR_MODULE, CONNECTOR_NAME
    from neuron_scheduler.offline.tinymodel import TINY_ENGINE_ARGS, make_tiny_llama

    llm = LLM(
        model=str(make_tiny_llama(tmp_path / "tiny")),
        **TINY_ENGINE_ARGS,
        scheduler_cls="neuron_scheduler.NeuronScheduler",
        additional_config={"neuron_config": {"kv_load_timeout_s": 2.0}},
        kv_transfer_config={
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
        },
    )
    greedy = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    remote = {"kv_transfer_params": {"remote_tokens": 128}}
    prompts = [
        TokensPrompt(prompt_token_ids=[(i * 31 + j) % 150 + 4 for j in range(n)])
        for i, n in enumerate([160, 40, 70])
    ]
    params = [SamplingParams(**greedy, extra_args=remote)] + [
        SamplingParams(**greedy) for _ in prompts[1:]
    ]
    started = time.monotonic()
    lost, *served = llm.generate(prompts, params, use_tqdm=False)
    waited = time.monotonic() - started
    assert lost.finished and lost.outputs[0].finish_reason == "error"
    assert list(lost.outputs[0].token_ids) == []
    assert [len(o.outputs[0].token_ids) for o in served] == [6, 6]
    assert waited >= 2.0
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.requests == {}
    manager = scheduler.kv_cache_manager
    assert num_free_blocks(manager) == manager.block_pool.num_gpu_blocks - 1
    again = llm.generate([prompts[1]], SamplingParams(**greedy), use_tqdm=False)
    assert list(again[0].outputs[0].token_ids) == list(served[0].outputs[0].token_ids)
    del llm


@pytest.mark.slow
@needs_cpu_engine
def test_the_server_answers_a_lost_load_with_an_error_and_keeps_serving(tmp_path):
    """vLLM's OpenAI server with the same connector: the request whose load
    is never reported gets an error response after the timeout, and the
    server answers the next request as usual."""
    import json
    import time
    import urllib.error
    import urllib.request

    from neuron_scheduler.offline.server import ServerProcess
    from neuron_scheduler.offline.sim_connector import CONNECTOR_MODULE, CONNECTOR_NAME
    from neuron_scheduler.offline.tinymodel import make_tiny_llama

    kv = {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
          "kv_role": "kv_both"}  # fmt: skip
    args = [
        "--max-model-len", "512", "--max-num-batched-tokens", "512",
        "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(32 << 20),
        "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
        "--scheduler-cls", "neuron_scheduler.NeuronScheduler",
        "--additional-config",
        json.dumps({"neuron_config": {"kv_load_timeout_s": 2.0}}),
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    model = str(make_tiny_llama(tmp_path / "tiny"))

    def complete(prompt_ids, **extra):
        body = {"model": model, "prompt": prompt_ids, "max_tokens": 4,
                "temperature": 0.0, "ignore_eos": True, **extra}  # fmt: skip
        request = urllib.request.Request(
            f"{server.base_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")

    with ServerProcess(model, args, tmp_path / "server.log") as server:
        started = time.monotonic()
        status, answer = complete(
            [(j * 7) % 150 + 4 for j in range(160)],
            kv_transfer_params={"remote_tokens": 128},
        )
        waited = time.monotonic() - started
        log = (tmp_path / "server.log").read_text()
        assert "kv_load_timeout_s=2.0" in log, log[-3000:]
        assert waited >= 2.0
        # The client learns it failed: an error status (vLLM 0.32: 500,
        # "Internal server error"), or a choice whose finish reason is an
        # error where a vLLM streams it so, never tokens.
        if status == 200:
            choice = answer["choices"][0]
            assert choice["finish_reason"] in ("error", "abort"), answer
            assert choice.get("token_ids") in (None, [])
        else:
            assert status >= 500, (status, answer)
        status, answer = complete([(j * 11) % 150 + 4 for j in range(40)])
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 4
        # vLLM's processes talk over IPC sockets in the server's own
        # directory, which goes with the server (in /tmp, a stopped
        # server's sockets stayed: 7 a start).
        assert server.ipc_dir is not None and any(server.ipc_dir.iterdir())
    assert not server.ipc_dir.exists()
