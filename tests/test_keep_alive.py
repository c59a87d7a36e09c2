"""Idle connections are dropped by the client before the server closes them.

A request sent on a connection the server is closing fails in the client
without reaching the engine (``scripts/keep-alive-race.py`` shows it). The
servers started here hold idle connections longer than vLLM's benchmark
client keeps them; the P/D proxy keeps its own shorter than a vLLM server's
default. Checked against each supported vLLM, whose client and server set
these in code.
"""

from __future__ import annotations

import inspect
import re

import pytest

from neuron_scheduler.offline.pd_proxy import BACKEND_KEEPALIVE_S
from neuron_scheduler.offline.server import (
    KEEP_ALIVE_ENV,
    SERVER_KEEP_ALIVE_S,
    ServerProcess,
)


def _benchmark_client_keepalive_s() -> float:
    """The seconds vLLM's benchmark client keeps an idle connection."""
    from vllm.benchmarks.serve import benchmark

    found = re.findall(
        r"keepalive_timeout=(\d+(?:\.\d+)?)", inspect.getsource(benchmark)
    )
    assert len(found) == 1, f"vLLM's benchmark client sets keepalive_timeout {found}"
    return float(found[0])


def _vllm_default_keep_alive_s(monkeypatch: pytest.MonkeyPatch) -> float:
    import vllm.envs

    monkeypatch.delenv(KEEP_ALIVE_ENV, raising=False)
    return float(vllm.envs.environment_variables[KEEP_ALIVE_ENV]())


@pytest.mark.matrix
def test_the_server_outlasts_the_benchmark_clients_idle_connections(monkeypatch):
    assert _vllm_default_keep_alive_s(monkeypatch) < _benchmark_client_keepalive_s()
    assert _benchmark_client_keepalive_s() < SERVER_KEEP_ALIVE_S
    monkeypatch.delenv(KEEP_ALIVE_ENV, raising=False)
    server = ServerProcess("model", [], log_path=None)  # type: ignore[arg-type]
    assert server.env[KEEP_ALIVE_ENV] == str(SERVER_KEEP_ALIVE_S)


@pytest.mark.matrix
def test_the_proxy_drops_idle_connections_before_a_vllm_server_does(monkeypatch):
    assert 0 < BACKEND_KEEPALIVE_S < _vllm_default_keep_alive_s(monkeypatch)


def test_a_keep_alive_named_in_the_environment_is_kept(monkeypatch):
    monkeypatch.setenv(KEEP_ALIVE_ENV, "7")
    server = ServerProcess("model", [], log_path=None)  # type: ignore[arg-type]
    assert server.env[KEEP_ALIVE_ENV] == "7"
    server = ServerProcess(
        "model",
        [],
        log_path=None,  # type: ignore[arg-type]
        env={KEEP_ALIVE_ENV: "11"},
    )
    assert server.env[KEEP_ALIVE_ENV] == "11"
