"""What slows a vLLM server's steps: its age, or what runs beside its worker?

``validate``'s refit charges a level the other levels' served steps. Two
things could make one level's steps slower than the others' without the
shapes being at fault, and each command here isolates one. Both start
``validate``'s default server (the static-shape worker on its own core, the
validation model, the step log on) and time a probe: ``--probe-requests``
identical requests sent at once (600-token prompts, 120 tokens out), so
every decode step has the same real rows; a probe's figure is the median
of those steps (step log: one step's start to the next's).

``aging``: for ``--minutes``, a probe, then a burst of ``AGING_REQUESTS``
requests of mixed lengths (which churn the KV cache's blocks and the
server's state), again and again; then a fresh server, probed
``--restart-probes`` times. A server that ages shows a rising first series
and a restarted one back at its start.

``neighbour``: ``--rounds`` rounds of three probes, with the other core
(the serving path's: API server, engine core, client) idle, running a
Python loop (what the serving path runs), and streaming memory (a 64 MB
copy, again and again), each neighbour at nice 19 so that the serving
path still has its core when it needs it: what the worker loses to its
neighbour through the caches and memory they share.

Usage: .venv/bin/python scripts/server-probe.py aging [--minutes 10]
           [--restart-probes 2] [--probe-requests 5] [--stream]
       .venv/bin/python scripts/server-probe.py neighbour [--rounds 3]
  Alone on the machine; the default server admits 5 requests at once (its
  KV cache at max_model_len), so a probe of 5 fills its decode steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
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
from neuron_scheduler.sim.calibration import busy_lines, read_step_log
from neuron_scheduler.sim.validation import validation_model
from neuron_scheduler.step_log import STEP_LOG_ENV

#: Requests of the burst between probes, and their length ranges.
AGING_REQUESTS = 24
AGING_PROMPT = (50, 2500)
AGING_OUTPUT = (10, 300)
PROBE_PROMPT, PROBE_OUTPUT = 600, 120
#: Token ids the validation model's vocabulary holds.
TOKEN_IDS = (5, 150)
NEIGHBOURS = ("idle", "python", "memory")
#: Floats the memory neighbour copies (64 MB), far beyond the caches.
MEMORY_FLOATS = 8 << 20

Request = tuple[list[int], int]


def probe_decode_ms(lines: Sequence[dict[str, Any]], rows: int) -> tuple[float, int]:
    """The median milliseconds of the decode steps with ``rows`` real rows
    among ``lines``, each timed as ``validate`` times a served step (to the
    next step's start, where that step holds one of its requests:
    ``calibration.busy_lines``), and how many there were; ``ValueError``
    if none."""
    times = [
        seconds * 1000
        for _, shape, seconds in busy_lines(lines)
        if not shape.prefill_chunks and shape.decode_rows_actual == rows
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
    times_ms = [ms for _, ms in points]
    slope = statistics.linear_regression(minutes, times_ms).slope
    return slope / statistics.fmean(times_ms)


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


def _send_at_once(base_url: str, requests: list[Request], stream: bool) -> None:
    def send(request: Request) -> None:
        prompt, max_tokens = request
        body = {
            "model": "validate",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
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


class ProbedServer:
    """``validate``'s default server, started; ``probe()`` times one probe."""

    def __init__(self, args: argparse.Namespace, log_dir: Path, label: str) -> None:
        spec = EngineSpec(
            model=validation_model(),
            worker_cls=CPU_STATIC_WORKER,
            **VALIDATION_ENGINE,  # type: ignore[arg-type]
        )
        self.log = log_dir / f"steps-{label}.jsonl"
        self.server = ServerProcess(
            spec.model,
            server_args(spec),
            log_dir / f"{label}.log",
            env={STEP_LOG_ENV: str(self.log)},
        )
        self.args = args
        self.probe_requests = _requests(
            random.Random(1),
            args.probe_requests,
            (PROBE_PROMPT, PROBE_PROMPT),
            (PROBE_OUTPUT, PROBE_OUTPUT),
        )

    def send(self, requests: list[Request]) -> None:
        _send_at_once(self.server.base_url, requests, self.args.stream)

    def probe(self) -> float:
        """One probe's median decode milliseconds."""
        offset = self.log.stat().st_size if self.log.exists() else 0
        self.send(self.probe_requests)
        ms, _ = probe_decode_ms(
            read_step_log(self.log, offset), self.args.probe_requests
        )
        return ms


@contextlib.contextmanager
def started(
    args: argparse.Namespace, log_dir: Path, label: str
) -> Iterator[tuple[ProbedServer, frozenset[int]]]:
    """A ``ProbedServer`` running, its serving path kept off its worker's
    core, and the cores that leaves free; stopped on exit."""
    probed = ProbedServer(args, log_dir, label)
    probed.server.start()
    try:
        assert probed.server.process is not None
        with keep_off_worker_cores(probed.server.process.pid) as free:
            yield probed, free
    finally:
        probed.server.stop()


def aging(args: argparse.Namespace, log_dir: Path) -> None:
    """Probes between bursts for ``--minutes``; then a fresh server's."""
    rng = random.Random(0)
    first: list[tuple[float, float]] = []
    with started(args, log_dir, "first") as (probed, _):
        began = time.monotonic()
        while time.monotonic() - began < args.minutes * 60:
            at = (time.monotonic() - began) / 60
            first.append((at, probed.probe()))
            print(f"first: {at:5.2f} min, probe {first[-1][1]:.2f} ms", flush=True)
            probed.send(_requests(rng, AGING_REQUESTS, AGING_PROMPT, AGING_OUTPUT))
    with started(args, log_dir, "restarted") as (probed, _):
        again = [probed.probe() for _ in range(args.restart_probes)]
    print(f"restarted: probes {', '.join(f'{ms:.2f}' for ms in again)} ms")
    print(aging_summary(first, again))


def aging_summary(first: Sequence[tuple[float, float]], again: Sequence[float]) -> str:
    """The first server's trend, its first and last two probes, and the
    restarted server's mean against those last two."""
    early = statistics.fmean(ms for _, ms in first[:2])
    late = statistics.fmean(ms for _, ms in first[-2:])
    fresh = statistics.fmean(again)
    return (
        f"first server: {len(first)} probes over {first[-1][0]:.1f} min, trend "
        f"{trend_per_minute(first):+.2%}/min; its first two {early:.2f} ms, "
        f"last two {late:.2f} ms ({late / early - 1:+.1%}); restarted "
        f"{fresh:.2f} ms ({fresh / late - 1:+.1%} of the last two)"
    )


def _python_loop(stop: Any) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _memory_copy(stop: Any) -> None:
    import numpy as np

    source = np.ones(MEMORY_FLOATS)
    target = np.empty_like(source)
    while not stop.is_set():
        np.copyto(target, source)


def _neighbour_main(kind: str, cores: frozenset[int], stop: Any) -> None:
    os.sched_setaffinity(0, cores)
    os.nice(19)
    work: Callable[[Any], None] = _python_loop if kind == "python" else _memory_copy
    work(stop)


@contextlib.contextmanager
def neighbour_running(kind: str, cores: frozenset[int]) -> Iterator[None]:
    """Within: ``kind`` (``NEIGHBOURS``) runs on ``cores`` at nice 19."""
    if kind == "idle":
        yield
        return
    stop = multiprocessing.Event()
    process = multiprocessing.Process(
        target=_neighbour_main, args=(kind, cores, stop), daemon=True
    )
    process.start()
    try:
        time.sleep(1.0)  # under way before the probe
        yield
    finally:
        stop.set()
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


def neighbour(args: argparse.Namespace, log_dir: Path) -> None:
    """``--rounds`` probes beside each neighbour, interleaved."""
    found: dict[str, list[float]] = {kind: [] for kind in NEIGHBOURS}
    with started(args, log_dir, "neighbour") as (probed, free):
        if not free:
            raise SystemExit("no core is free of the worker: no neighbour to run")
        for round_ in range(args.rounds):
            for kind in NEIGHBOURS:
                with neighbour_running(kind, free):
                    found[kind].append(probed.probe())
                print(f"round {round_}: {kind:<6} {found[kind][-1]:.2f} ms", flush=True)
    print(neighbour_summary(found))


def neighbour_summary(found: dict[str, list[float]]) -> str:
    """Each neighbour's mean probe against the idle one's."""
    idle = statistics.fmean(found["idle"])
    return "; ".join(
        f"{kind} {statistics.fmean(ms):.2f} ms ({statistics.fmean(ms) / idle - 1:+.1%})"
        for kind, ms in found.items()
    )


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--probe-requests", type=_positive_int, default=5)
    common.add_argument("--stream", action="store_true", help="stream the answers")
    commands = top.add_subparsers(dest="command", required=True)
    aging_cmd = commands.add_parser("aging", parents=[common])
    aging_cmd.add_argument("--minutes", type=_positive, default=10.0)
    aging_cmd.add_argument("--restart-probes", type=_positive_int, default=2)
    neighbour_cmd = commands.add_parser("neighbour", parents=[common])
    neighbour_cmd.add_argument("--rounds", type=_positive_int, default=3)
    return top


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run = aging if args.command == "aging" else neighbour
    # A SIGTERM, as Ctrl-C, runs the ``finally`` that stops the server.
    with signals_raise(), tempfile.TemporaryDirectory(prefix="server-probe-") as logs:
        run(args, Path(logs))


if __name__ == "__main__":
    main()
