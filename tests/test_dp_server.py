"""NeuronScheduler under vLLM's data parallelism: the OpenAI server with
``--data-parallel-size 2`` (dense model: two independent engine cores, each
with its own scheduler and KV cache) under 64 concurrent clients; each
engine's metrics on /metrics under its DP index, consistent with what it
served; snapshots removed when the server stops on SIGTERM or SIGINT."""

import json
import os
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import scrape_metrics
from neuron_scheduler.offline.server import ServerProcess
from neuron_scheduler.offline.tinymodel import make_tiny_llama

pytestmark = pytest.mark.slow

MAX_TOKENS = 5
NUM_REQUESTS = 256


def _per_engine(samples, name, **match):
    totals = {}
    for (sample, labels), value in samples.items():
        labels = dict(labels)
        if sample == name and all(labels.get(k) == v for k, v in match.items()):
            totals[labels["engine"]] = totals.get(labels["engine"], 0) + value
    return totals


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_two_dp_engines_serve_and_publish_their_own_metrics(tmp_path, stop):
    metrics_dir = tmp_path / "metrics"
    model = str(make_tiny_llama(tmp_path / "model"))
    args = [
        "--served-model-name", "tiny", "--max-model-len", "2048",
        "--max-num-batched-tokens", "512", "--max-num-seqs", "8",
        "--kv-cache-memory-bytes", str(64 << 20), "--dtype", "float32",
        "--enforce-eager", "--scheduler-cls", "neuron_scheduler.NeuronScheduler",
        "--data-parallel-size", "2",
    ]  # fmt: skip
    env = {"NEURON_SCHEDULER_METRICS_DIR": str(metrics_dir)}
    server = ServerProcess(model, args, tmp_path / "server.log", env=env).start()
    try:

        def complete(i):
            prompt = [(i * 7 + j) % 140 + 4 for j in range(20 + i % 50)]
            body = json.dumps(
                {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                 "ignore_eos": True, "temperature": 0}
            ).encode()  # fmt: skip
            request = urllib.request.Request(
                f"{server.base_url}/v1/completions",
                body,
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=300) as response:
                return json.loads(response.read())["usage"]["completion_tokens"]

        with ThreadPoolExecutor(max_workers=64) as pool:
            tokens = list(pool.map(complete, range(NUM_REQUESTS)))
        assert tokens == [MAX_TOKENS] * NUM_REQUESTS  # no errors, every token

        # Each engine publishes when it goes idle; both files, both labels.
        # (A publish in flight shows as its writer's ``.*.tmp`` until it is
        # renamed into place: not a snapshot.)
        assert sorted(p.name[-7:] for p in metrics_dir.glob("*.json")) == [
            "-0.json",
            "-1.json",
        ]
        samples = scrape_metrics(server.base_url)
        served = _per_engine(
            samples, "vllm:request_success_total", finished_reason="length"
        )
        decode_slots = _per_engine(samples, "neuron_scheduler:decode_slots_total")
        prefill_steps = _per_engine(samples, "neuron_scheduler:prefill_steps_total")
        assert set(served) == set(decode_slots) == {"0", "1"}
        assert all(served[e] > 0 for e in served)  # both engines serve
        assert sum(served.values()) == NUM_REQUESTS
        for engine, requests in served.items():
            # Every request: one prefill step of its own (no packing), then
            # MAX_TOKENS - 1 decode rows, counted by the engine that ran it.
            assert decode_slots[engine] == requests * (MAX_TOKENS - 1)
            assert prefill_steps[engine] == requests
        assert list(metrics_dir.glob("*.json"))
        # A normal stop: SIGTERM (or Ctrl-C) to the API server only.
        os.kill(server.process.pid, stop)
        server.process.wait(timeout=60)
        assert os.listdir(metrics_dir) == []
    finally:
        server.stop()
