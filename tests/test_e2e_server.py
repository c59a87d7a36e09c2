"""End to end: the OpenAI-compatible server with our scheduler, on
127.0.0.1, answering concurrent completions. The test starts the server and
stops it (by its PID's process group) itself."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240
NEURON_CONFIG = {"num_seqs_buckets": [2, 4, 8]}


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
    from neuron_scheduler.tinymodel import make_tiny_llama

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
        "--additional-config", json.dumps({"neuron_config": NEURON_CONFIG}),
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1")
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
        yield base, log_path
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def test_server_answers_concurrent_completions(server):
    base, log_path = server
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
