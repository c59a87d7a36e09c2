"""End to end: the OpenAI-compatible server with our scheduler and the
static-shape worker, on 127.0.0.1, answering concurrent completions. The
test starts the server and stops it (by its PID's process group) itself."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from helpers import scrape_metrics

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240
NEURON_CONFIG = {
    "num_seqs_buckets": [2, 4, 8],
    "kv_admission": "reserve",
    "max_prefills_per_batch": 4,
    "max_consecutive_prefill_steps": 2,
}
MAX_MODEL_LEN = 2048


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url, payload, timeout=120):
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from neuron_scheduler.offline.tinymodel import make_tiny_llama

    model = str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--max-num-batched-tokens", "512",
        "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(64 << 20),
        "--dtype", "float32", "--enforce-eager",
        "--scheduler-cls", "neuron_scheduler.NeuronScheduler",
        "--worker-cls", "neuron_scheduler.StaticShapeWorker",
        "--additional-config", json.dumps({"neuron_config": NEURON_CONFIG}),
    ]  # fmt: skip
    # Its IPC sockets go in pytest's own directory (conftest), not /tmp.
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOG_STATS_INTERVAL="1")
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited early:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"server not healthy:\n{log_path.read_text()[-3000:]}")
                time.sleep(1)
        yield base, log_path, model
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def test_server_answers_concurrent_completions(server):
    base, log_path, _ = server
    words = [
        "the",
        "world",
        "is",
        "a",
        "place",
        "where",
        "people",
        "work",
        "and",
        "study",
        "every",
        "day",
    ]

    def complete(i):
        prompt = " ".join(words[j % len(words)] for j in range(5 + 97 * (i % 8)))
        max_tokens = 3 + i % 5
        reply = _post(
            f"{base}/v1/completions",
            {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
             "ignore_eos": True, "temperature": 0},
        )  # fmt: skip
        return max_tokens, reply

    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(complete, range(32)))
    for max_tokens, reply in results:
        assert reply["usage"]["completion_tokens"] == max_tokens
        assert reply["choices"][0]["finish_reason"] == "length"
    with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
        assert response.status == 200
    assert "NeuronScheduler: token buckets" in log_path.read_text()


def _post_status(url, body, timeout=120):
    """POST raw ``body``; return (status, parsed JSON or None)."""
    request = urllib.request.Request(
        url, data=body, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, None


def _load_plan(num_requests, seed=0):
    """(kind, payload bytes, expected tokens) per request: mostly valid
    completions of mixed lengths (some chunked at 512 tokens), with invalid
    ones mixed in."""
    rng = random.Random(seed)
    plan = []
    for i in range(num_requests):
        max_tokens = rng.randint(1, 12)
        length = rng.choice([rng.randint(1, 100), rng.randint(100, 511),
                             rng.randint(513, MAX_MODEL_LEN - max_tokens)])  # fmt: skip
        payload = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True,
                   "temperature": 0,
                   "prompt": [(i * 37 + j) % 150 + 4 for j in range(length)]}  # fmt: skip
        kind = "valid"
        if i % 10 == 3:
            kind, payload["prompt"] = "too long", [5] * (MAX_MODEL_LEN + 10)
        elif i % 10 == 6:
            kind, payload["max_tokens"] = "negative max_tokens", -1
        elif i % 20 == 9:
            kind, payload["model"] = "unknown model", "no-such-model"
        body = json.dumps(payload).encode()
        if i % 20 == 19:
            kind, body = "malformed JSON", b'{"model": "tiny", "prompt": '
        plan.append((kind, body, max_tokens))
    return plan


def test_server_under_load_completes_valid_and_rejects_invalid(server):
    """64 concurrent clients, 320 requests: every valid one completes with
    its token count, every invalid one gets a 4xx, the server stays healthy
    and nothing hangs (the test bounds its own time)."""
    base, _, _ = server
    plan = _load_plan(320)
    with ThreadPoolExecutor(max_workers=64) as pool:
        futures = [
            pool.submit(_post_status, f"{base}/v1/completions", body)
            for _, body, _ in plan
        ]
        done, not_done = wait(futures, timeout=600)
        assert not not_done, f"{len(not_done)} requests hung"
    kinds = {}
    for (kind, _, max_tokens), future in zip(plan, futures, strict=True):
        status, reply = future.result()
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "valid":
            assert status == 200, (kind, status)
            assert reply["usage"]["completion_tokens"] == max_tokens
            assert reply["choices"][0]["finish_reason"] == "length"
        else:
            assert 400 <= status < 500, (kind, status)
    assert kinds["valid"] >= 200 and len(kinds) == 5
    with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
        assert response.status == 200


def _total(samples, name):
    return sum(value for (sample, _), value in samples.items() if sample == name)


def test_metrics_endpoint_reports_padding_states_and_refusals(server):
    base, log_path, _ = server
    before = scrape_metrics(base)
    lengths = [3, 129, 600, 40, 1000, 257, 77, 5]  # 600, 1000: chunked at 512
    max_tokens = [4, 2, 6, 3, 5, 1, 7, 2]

    def complete(i):
        prompt = [(1000 + 13 * i + 7 * j) % 140 + 4 for j in range(lengths[i])]
        return _post(
            f"{base}/v1/completions",
            {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens[i],
             "ignore_eos": True, "temperature": 0},
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=8) as pool:
        replies = list(pool.map(complete, range(len(lengths))))
    assert [r["usage"]["completion_tokens"] for r in replies] == max_tokens
    # The scheduler publishes when it goes idle; allow the scrape to catch up.
    expected_decodes = sum(n - 1 for n in max_tokens)
    deadline = time.monotonic() + 20
    while True:
        after = scrape_metrics(base)
        decoded = _total(after, "neuron_scheduler:decode_slots_total") - _total(
            before, "neuron_scheduler:decode_slots_total"
        )
        if decoded == expected_decodes or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert decoded == expected_decodes

    def delta(name):
        return _total(after, name) - _total(before, name)

    prefilled = delta("neuron_scheduler:prefill_tokens_total")
    padded = delta("neuron_scheduler:prefill_padded_tokens_total")
    # Prefix caching may skip some prompt tokens, never add any.
    assert 0 < prefilled <= sum(lengths)
    assert padded > prefilled  # token buckets pad (128, 256, 512)
    assert delta("neuron_scheduler:prefill_padding_tokens_sum") == padded - prefilled
    assert delta("neuron_scheduler:decode_padded_slots_total") >= expected_decodes
    buckets = {
        dict(labels)["bucket"]
        for (name, labels), _ in after.items()
        if name == "neuron_scheduler:prefill_tokens_total"
    }
    assert buckets <= {"128", "256", "512"} and buckets
    states = {
        dict(labels)["state"]: value
        for (name, labels), value in after.items()
        if name == "neuron_scheduler:steps_total"
    }
    assert states["active_prefill"] > 0 and states["active_decode"] > 0
    assert any(name == "neuron_scheduler:admission_refusals_total" for name, _ in after)
    assert _total(after, "neuron_scheduler:state_seconds_total") > 0
    assert "NeuronScheduler: Prefill padding:" in log_path.read_text()


def test_static_shape_server_matches_the_stock_engine(server):
    """Greedy completions from the server (NeuronScheduler, every forward at
    a bucket shape) equal vLLM's own engine's for the same prompts."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from neuron_scheduler.offline.tinymodel import TINY_ENGINE_ARGS

    base, _, model = server
    prompts = [
        [(i * 31 + j) % 150 + 4 for j in range(n)]
        for i, n in enumerate([5, 40, 300, 700, 1500, 20])
    ]
    with ThreadPoolExecutor(max_workers=6) as pool:
        replies = list(pool.map(
            lambda p: _post(f"{base}/v1/completions", {
                "model": "tiny", "prompt": p, "max_tokens": 10,
                "ignore_eos": True, "temperature": 0,
            }),
            prompts,
        ))  # fmt: skip
    served = [r["choices"][0]["text"] for r in replies]
    llm = LLM(model=model, **TINY_ENGINE_ARGS)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    del llm
    assert served == [o.outputs[0].text for o in outputs]
    assert all(served)


def test_every_metric_the_dashboard_queries_is_on_the_live_metrics(server):
    from helpers import dashboard_metrics, exposed_metrics

    base, _, _ = server
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        exposition = response.read().decode()
    queried = dashboard_metrics()
    assert queried and queried - exposed_metrics(exposition) == set()
