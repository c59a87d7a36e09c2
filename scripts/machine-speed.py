"""How steady this machine's own speed is, with nothing of vLLM running.

docs/ground-truth.md finds that each start of a server, and each minute of
one, has its own decode speed (about ±10%). This asks whether the machine
alone does that. Each start is a fresh process on one core (one thread, new
memory) that times six kinds of work, interleaved, for ``--seconds``:

* ``decode-l2``: 8 rows through a 1-layer model whose weights (1.3 MB)
  stay in the core's L2;
* ``decode-model``: 8 rows through the validation model's linear layers
  (Llama, hidden 512, intermediate 1536, 6 layers: 82 MB of float32
  weights, the size of the engine ``validate`` serves);
* ``prefill-model``: 512 rows through the same (compute-bound);
* ``decode-dram``: 8 rows through a model 16 times as large (1.3 GB, far
  beyond any cache);
* ``copy-dram``: a 256 MB copy (memory bandwidth);
* ``compute-l1``: 128 x 128 matmuls (the core's clock).

It prints each start's medians and how far its 10-second windows' medians
spread (largest / smallest), then the spread across starts.

Usage: .venv/bin/python scripts/machine-speed.py [--starts 8] [--seconds 60]
       [--core 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

KINDS = (
    "decode-l2",
    "decode-model",
    "prefill-model",
    "decode-dram",
    "copy-dram",
    "compute-l1",
)
WINDOW_S = 10.0


def _layers(hidden: int, intermediate: int, count: int) -> list[list[object]]:
    import torch

    return [
        [
            torch.randn(hidden, 3 * hidden),  # q, k, v
            torch.randn(hidden, hidden),  # o
            torch.randn(hidden, 2 * intermediate),  # gate, up
            torch.randn(intermediate, hidden),  # down
        ]
        for _ in range(count)
    ]


def _forward(
    layers: list[list[object]], rows: int, hidden: int, intermediate: int
) -> Callable[[], object]:
    import torch

    def step() -> object:
        x = torch.randn(rows, hidden)
        for qkv, o, gate_up, down in layers:
            x = (x @ qkv)[:, :hidden] @ o  # type: ignore[operator]
            x = (x @ gate_up)[:, :intermediate] @ down  # type: ignore[operator]
        return x

    return step


def _work() -> dict[str, Callable[[], object]]:
    import torch

    source = torch.empty(64 * 1024 * 1024)  # 256 MB
    target = torch.empty_like(source)
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    model = _layers(512, 1536, 6)
    return {
        "decode-l2": _forward(_layers(256, 512, 1), 8, 256, 512),
        "decode-model": _forward(model, 8, 512, 1536),
        "prefill-model": _forward(model, 512, 512, 1536),
        "decode-dram": _forward(_layers(2048, 6144, 6), 8, 2048, 6144),
        "copy-dram": lambda: target.copy_(source),
        "compute-l1": lambda: [a @ b for _ in range(200)],
    }


def child(seconds: float, core: int) -> None:
    """One start: time every kind, interleaved; JSON samples to stdout."""
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    work = _work()
    for step in work.values():  # warm up
        for _ in range(3):
            step()
    samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    begin = time.perf_counter()
    while time.perf_counter() - begin < seconds:
        for kind in KINDS:
            start = time.perf_counter()
            work[kind]()
            samples[kind].append((start - begin, time.perf_counter() - start))
    json.dump(samples, sys.stdout)


def _window_spread(samples: list[tuple[float, float]]) -> float:
    """Largest / smallest median over ``WINDOW_S`` windows of five or more."""
    windows: dict[int, list[float]] = {}
    for at, seconds in samples:
        windows.setdefault(int(at // WINDOW_S), []).append(seconds)
    medians = [statistics.median(w) for w in windows.values() if len(w) >= 5]
    return max(medians) / min(medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--core", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.seconds, args.core)
        return
    command = [sys.executable, __file__, "--child", "--seconds", str(args.seconds),
               "--core", str(args.core)]  # fmt: skip
    medians: dict[str, list[float]] = {kind: [] for kind in KINDS}
    spreads: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for start in range(1, args.starts + 1):
        output = subprocess.run(command, check=True, capture_output=True, text=True)
        samples = json.loads(output.stdout)
        cells = []
        for kind in KINDS:
            median = statistics.median(s for _, s in samples[kind])
            medians[kind].append(median)
            spreads[kind].append(_window_spread(samples[kind]))
            cells.append(f"{kind} {1e3 * median:.2f} ms ({spreads[kind][-1]:.3f})")
        print(f"start {start}: " + " | ".join(cells), flush=True)
    print(f"\nlargest / smallest median: across {args.starts} starts; within "
          f"a start, over its {WINDOW_S:.0f}-s windows (median, worst)")  # fmt: skip
    for kind in KINDS:
        across = max(medians[kind]) / min(medians[kind])
        within = statistics.median(spreads[kind])
        print(f"{kind:>13}: across {across:.3f}; within {within:.3f}, "
              f"worst {max(spreads[kind]):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
