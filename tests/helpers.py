"""Shared test helpers: build schedulers, run them, render golden traces."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from neuron_scheduler import NeuronScheduler
from neuron_scheduler.offline.engine import (
    EngineSettings,
    OfflineEngine,
    build_scheduler,
)
from neuron_scheduler.step import StepRecord

TraceLine = tuple[str, tuple[str, ...], int, int, str]

#: ``record_property`` name whose value the run prints at its end (the
#: conformance table, the property suite's tally): ``conftest.py`` prints it
#: from the main process, so it reaches the log under pytest-xdist too,
#: where a worker's own output does not.
SUMMARY = "summary"


def cpu_engine_runs() -> bool:
    """Whether the installed vLLM can start an engine on this CPU: its
    kernels (``vllm._C``) are built. A pure-Python build (vLLM 0.33 here,
    which has no CPU wheel) runs the scheduler only."""
    return importlib.util.find_spec("vllm._C") is not None


def load_script(filename: str) -> Any:
    """The module ``scripts/<filename>`` (a file name with dashes, not
    importable by name), loaded afresh."""
    scripts = Path(__file__).parent.parent / "scripts"
    if str(scripts) not in sys.path:  # as when run: its siblings importable
        sys.path.append(str(scripts))
    path = scripts / filename
    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_"), path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # what its dataclasses look up
    spec.loader.exec_module(module)
    return module


def waiting_requests(scheduler: Any) -> list[Any]:
    """Every request in the scheduler's waiting queues, queue by queue in the
    order the parent drains them (their names differ between vLLM
    versions: ``vllm_internals.scheduler_features``)."""
    from neuron_scheduler.vllm_internals import scheduler_features

    return [
        request
        for queue in scheduler_features().waiting_queues
        for request in getattr(scheduler, queue.attribute)
    ]


#: For tests that start a vLLM engine.
needs_cpu_engine = pytest.mark.skipif(
    not cpu_engine_runs(),
    reason="this vLLM build has no CPU kernels (vllm._C): scheduler-level only",
)


def neuron_engine(
    scheduler_cls: type = NeuronScheduler, pipelined: bool = False, **settings: Any
) -> OfflineEngine:
    return OfflineEngine(
        build_scheduler(scheduler_cls, EngineSettings(**settings)), pipelined=pipelined
    )


def trace_line(record: StepRecord) -> TraceLine:
    """(kind, requests, actual, padded, state): tokens for prefill steps,
    batch size for decode steps."""
    if record.kind.value == "decode":
        actual, padded = record.num_seqs, record.num_seqs_padded
    else:
        actual, padded = record.total_actual, record.total_padded
    return (
        record.kind.value,
        tuple(sorted(record.request_ids)),
        actual,
        padded,
        record.state.name,
    )


def run_trace(engine: OfflineEngine, max_steps: int = 1000) -> list[TraceLine]:
    """Step until idle, returning one golden line per scheduled step.

    Empty steps are left out only when no request is unfinished (vLLM runs
    one to flush finished ids); an empty step with work pending is a stall
    and stays in the trace."""
    lines: list[TraceLine] = []
    for _ in range(max_steps):
        if not engine.has_work():
            return lines
        scheduled, _ = engine.step()
        if scheduled is not None:
            record = engine.scheduler.last_step  # type: ignore[attr-defined]
            idle = engine.scheduler.get_num_unfinished_requests() == 0
            if record.kind.value != "empty" or not idle:
                lines.append(trace_line(record))
    raise AssertionError(f"no completion after {max_steps} steps: {lines[-5:]}")


def prompt(n: int, offset: int = 0) -> list[int]:
    """n distinct-ish token ids (offset keeps prompts from sharing prefixes)."""
    return [(offset * 7919 + i) % 31000 + 1 for i in range(n)]


# ------------------------------------------------------- Grafana dashboard

DASHBOARD = (
    Path(__file__).resolve().parents[1] / "dashboards" / "neuron-scheduler-grafana.json"
)

#: Suffixes Prometheus adds to a family's samples, by family type.
SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def dashboard_metrics() -> set[str]:
    """Every ``neuron_scheduler:`` metric a panel or variable queries."""
    text = DASHBOARD.read_text()
    dashboard = json.loads(text)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [
        v["definition"] for v in dashboard["templating"]["list"] if "definition" in v
    ]
    return {m for e in exprs for m in re.findall(r"neuron_scheduler:[a-z_]+", e)}


def exposed_metrics(exposition: str) -> set[str]:
    """Sample names a Prometheus text exposition declares (with the
    suffixes of each declared family, whether or not it has samples yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(s.name for s in family.samples)
        names.update(family.name + s for s in SAMPLE_SUFFIXES.get(family.type, ()))
    return names


def scrape_metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    """A server's /metrics samples: {(name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def still_alive_after(pids: set[int], seconds: float = 10.0) -> list[int]:
    """The ``pids`` still running after up to ``seconds`` of waiting for
    them to die (a SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if process_alive(p)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    return alive


#: The tiny engine the validate tests serve (with ``--model``).
TINY_ENGINE_ARGV = (
    "--max-model-len", "512", "--max-num-batched-tokens", "256",
    "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(64 << 20),
)  # fmt: skip
