"""Does vLLM's server slow down with the time it has served?

In saved ``validate`` runs the server's decode steps ran further above the
profile level by level (e.g. 1.05 / 1.09 / 1.13 / 1.13x), and the levels
run in one order, so a server that slowed with the time or the requests it
had served would read as the later levels' cost. This tells that apart:
it starts ``validate``'s default server (the static-shape worker, the
validation model, the step log on), then for ``--minutes`` alternates a
probe (``--probe-requests`` identical requests sent at once: 600-token
prompts, 120 tokens out, so every decode step has the same rows) with a
burst of ``AGING_REQUESTS`` requests of mixed lengths (which churn the KV
cache's blocks and the server's state); then it stops that server, starts
a fresh one and probes it ``--restart-probes`` times. Each probe's figure
is the median of its full decode steps (step log: the time from one step's
start to the next's). A server that ages shows a rising first series and
a restarted one back at its start.

Usage: .venv/bin/python scripts/server-aging.py [--minutes 10]
       [--restart-probes 2] [--probe-requests 5]
  Alone on the machine; the default server admits 5 requests at once (its
  KV cache at max_model_len), so a probe of 5 fills its decode steps.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from neuron_scheduler.offline.child_processes import signals_raise
from neuron_scheduler.offline.cpu_binding import keep_off_worker_cores
from neuron_scheduler.offline.engine_spec import (
    CPU_STATIC_WORKER,
    EngineSpec,
    server_args,
)
from neuron_scheduler.offline.server import ServerProcess
from neuron_scheduler.offline.tinymodel import VALIDATION_ENGINE
from neuron_scheduler.sim.calibration import read_step_log
from neuron_scheduler.sim.validation import validation_model
from neuron_scheduler.step_log import STEP_LOG_ENV

#: Requests of the burst between probes, and their length ranges.
AGING_REQUESTS = 24
AGING_PROMPT = (50, 2500)
AGING_OUTPUT = (10, 300)
PROBE_PROMPT, PROBE_OUTPUT = 600, 120
#: Token ids the validation model's vocabulary holds.
TOKEN_IDS = (5, 150)
#: A gap longer than this between two steps is idle time, not a step.
LONGEST_STEP_S = 1.0

Request = tuple[list[int], int]


def probe_decode_ms(lines: Sequence[dict[str, Any]], rows: int) -> tuple[float, int]:
    """The median milliseconds of the decode steps with ``rows`` real rows
    among ``lines`` (a step's time: to the next line's start, if that is
    within ``LONGEST_STEP_S``), and how many there were; ``ValueError`` if
    none."""
    times = [
        (after["t"] - step["t"]) * 1000
        for step, after in zip(lines, lines[1:], strict=False)
        if step["kind"] == "decode"
        and step.get("rows_actual") == rows
        and after["t"] - step["t"] < LONGEST_STEP_S
    ]
    if not times:
        raise ValueError(f"no decode step with {rows} real rows in the probe")
    return statistics.median(times), len(times)


def trend_per_minute(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of (minutes, ms) points as a share of their
    mean per minute; ``ValueError`` for fewer than two distinct minutes."""
    minutes = [m for m, _ in points]
    if len(set(minutes)) < 2:
        raise ValueError("a trend needs probes at two times at least")
    mean_m = statistics.fmean(minutes)
    mean_ms = statistics.fmean(ms for _, ms in points)
    slope = sum((m - mean_m) * (ms - mean_ms) for m, ms in points) / sum(
        (m - mean_m) ** 2 for m in minutes
    )
    return slope / mean_ms


def _requests(
    rng: random.Random, count: int, prompt: tuple[int, int], output: tuple[int, int]
) -> list[Request]:
    return [
        (
            [rng.randrange(*TOKEN_IDS) for _ in range(rng.randint(*prompt))],
            rng.randint(*output),
        )
        for _ in range(count)
    ]


def _send_at_once(base_url: str, requests: list[Request]) -> None:
    def send(request: Request) -> None:
        prompt, max_tokens = request
        body = {
            "model": "validate",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        post = urllib.request.Request(
            f"{base_url}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(post, timeout=600) as response:
            response.read()

    with ThreadPoolExecutor(len(requests)) as pool:
        list(pool.map(send, requests))


def serve(
    args: argparse.Namespace,
    minutes: float,
    probes: int | None,
    log_dir: Path,
    label: str,
) -> list[tuple[float, float]]:
    """Start a server and alternate probes and aging bursts for ``minutes``
    (or run ``probes`` probes back to back); each probe's (minutes since
    the first, median decode ms), printed as it comes."""
    spec = EngineSpec(
        model=validation_model(),
        worker_cls=CPU_STATIC_WORKER,
        **VALIDATION_ENGINE,  # type: ignore[arg-type]
    )
    log = log_dir / f"steps-{label}.jsonl"
    server = ServerProcess(
        spec.model,
        server_args(spec),
        log_dir / f"{label}.log",
        env={STEP_LOG_ENV: str(log)},
    )
    server.start()
    assert server.process is not None
    rng, probe_rng = random.Random(0), random.Random(1)
    probe = _requests(
        probe_rng, args.probe_requests, (PROBE_PROMPT,) * 2, (PROBE_OUTPUT,) * 2
    )
    points: list[tuple[float, float]] = []
    try:
        with keep_off_worker_cores(server.process.pid):
            began = time.monotonic()
            while (probes is None and time.monotonic() - began < minutes * 60) or (
                probes is not None and len(points) < probes
            ):
                offset = log.stat().st_size if log.exists() else 0
                at = (time.monotonic() - began) / 60
                _send_at_once(server.base_url, probe)
                ms, steps = probe_decode_ms(
                    read_step_log(log, offset), args.probe_requests
                )
                points.append((at, ms))
                print(
                    f"{label}: {at:5.2f} min, probe decode {ms:.2f} ms "
                    f"(median of {steps})",
                    flush=True,
                )
                if probes is None:
                    _send_at_once(
                        server.base_url,
                        _requests(rng, AGING_REQUESTS, AGING_PROMPT, AGING_OUTPUT),
                    )
    finally:
        server.stop()
    return points


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--restart-probes", type=int, default=2)
    parser.add_argument("--probe-requests", type=int, default=5)
    args = parser.parse_args(argv)
    for name in ("minutes", "restart_probes", "probe_requests"):
        if not getattr(args, name) > 0:
            parser.error(
                f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}"
            )
    # A SIGTERM, as Ctrl-C, runs the ``finally`` that stops the server.
    with (
        signals_raise(),
        tempfile.TemporaryDirectory(prefix="server-aging-") as directory,
    ):
        first = serve(args, args.minutes, None, Path(directory), "first")
        again = serve(args, 0.0, args.restart_probes, Path(directory), "restarted")
    early = statistics.fmean(ms for _, ms in first[:2])
    late = statistics.fmean(ms for _, ms in first[-2:])
    fresh = statistics.fmean(ms for _, ms in again)
    print(
        f"first server: {len(first)} probes over {first[-1][0]:.1f} min, trend "
        f"{trend_per_minute(first):+.2%}/min; its first two {early:.2f} ms, "
        f"last two {late:.2f} ms ({late / early - 1:+.1%}); restarted "
        f"{fresh:.2f} ms ({fresh / late - 1:+.1%} of the last two)"
    )


if __name__ == "__main__":
    main()
