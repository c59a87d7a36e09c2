"""The server's inter-token gaps, level by level, from a validate step log.

``validate --log-dir DIR`` keeps the scheduler's step log
(``DIR/steps-server.jsonl``: each step's start, kind and request ids). A
step's tokens come out when it ends, where the next step starts; a
request's gap is the time from the end of one of its steps to the end of
its next decode step, as the server saw it (the benchmark client's ITL
adds the trip to it). A step's end is unknown where the next step starts
with nothing running (the engine may have waited idle in between), and
the last step's: their gaps are left out.
Validate numbers each level's requests from 0 and runs the levels one
after another, so a level begins where a number already seen reappears.
For each level this prints the share of gaps over ``--stall-ms`` (a
prefill step in between) and the gaps at p98.5, p99 and p99.5: where
the share of stalled gaps is near 1%, p99 sits on the edge between decode
steps and prefill steps, and the three differ by several times. Last, the
p99's 95% interval, as validate reports the client's (``p99_interval``).

Usage: .venv/bin/python scripts/step-log-gaps.py DIR/steps-server.jsonl
       [--stall-ms 200]
"""

from __future__ import annotations

import argparse

import numpy as np

from neuron_scheduler.sim.calibration import read_step_log
from neuron_scheduler.sim.validation_metrics import p99_interval

PERCENTILES = (98.5, 99.0, 99.5)


def gaps_by_level(steps: list[dict[str, object]]) -> list[list[float]]:
    """Each level's gaps in milliseconds, in the order the levels ran."""
    level_of: dict[str, int] = {}
    last_step: dict[str, float] = {}
    levels: list[list[float]] = [[]]
    numbers_seen: set[str] = set()  # in the level running
    for step, after in zip(steps, steps[1:], strict=False):
        at = float(after["t"])  # type: ignore[arg-type]  # this step's end
        ended = after["running"] != 0  # else it may have idled after the step
        for request in step["ids"]:  # type: ignore[attr-defined]
            if request not in level_of:
                number = request.split("-")[2]  # cmpl-validate-N-...
                if number in numbers_seen:
                    levels.append([])
                    numbers_seen.clear()
                numbers_seen.add(number)
                level_of[request] = len(levels) - 1
            if step["kind"] == "decode" and request in last_step and ended:
                levels[level_of[request]].append(1e3 * (at - last_step[request]))
            if ended:
                last_step[request] = at
            else:  # finished with this step (no request runs on)
                last_step.pop(request, None)
    return levels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step_log")
    parser.add_argument("--stall-ms", type=float, default=200.0)
    args = parser.parse_args()
    for index, gaps in enumerate(gaps_by_level(read_step_log(args.step_log))):
        if not gaps:
            continue
        stalled = sum(g > args.stall_ms for g in gaps) / len(gaps)
        tail = ", ".join(f"p{q:g} {np.percentile(gaps, q):.0f}" for q in PERCENTILES)
        low, high = p99_interval(np.asarray(gaps))
        upper = "unbounded" if high is None else f"{high:.0f}"
        print(f"level {index}: {len(gaps)} gaps, {100 * stalled:.2f}% over "
              f"{args.stall_ms:g} ms; {tail} ms; p99 within {low:.0f} to "
              f"{upper} ms")  # fmt: skip


if __name__ == "__main__":
    main()
