"""One level of a saved ``validate`` run, request by request: server against simulator.

Where a level misses even at its own steps' costs (validate's
``own_steps``: the level simulated with the profile refitted to its own
served steps, one line per kind for the whole level), this says where.
It simulates the level three times: that way; with each window of
``--window`` seconds paced by its own served steps (every simulated step
that starts in the window charged the fit times the window's served over
fitted seconds of its kind: the machine's speed as it moved through the
level); and paced so with each decode step also charged a factor drawn
from the level's decode steps over their window's speed (the steps'
variation inside a window, which a simulator charging each shape one time
leaves out of its ITL tail; ``--jitter-seeds`` draws, their errors
averaged). All three are diagnostics, never predictions. For each it
prints the mape and the errors of each mean, the p90 ITL and each p99.

Then, for each request, from its arrival: the wait to its first step, its
first token (the end of its last prefill step) and its end, on the server
(its step log) and in the first simulation; the means of those beside the
client's measured TTFT and E2EL (the step log's first token against the
client's TTFT is what the serving path adds to a request); and, per
window, its decode and prefill factors and each side's steps of each kind.

Times are from each side's first step. A step's end is where the next
step starts; the server logs an empty step as soon as it runs out of work,
so the end of its last step before an idle wait is still known.

Usage: .venv/bin/python scripts/level-timeline.py RUN_DIR LEVEL
       [--window 10] [--jitter-seeds 3] [VALIDATE FLAGS]
  RUN_DIR as for refit-resimulate.py; LEVEL the level's index in the
  report (0: the capacity run); VALIDATE FLAGS the workload and engine
  flags the run was given (none for the defaults).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from saved_run import (
    load_run,
    rebuilt_requests,
    simulated,
    validates_refits,
    without_jitter,
)

from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim import engines
from neuron_scheduler.sim.calibration import busy_lines, calibrated, fit
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.step_jitter import MIN_WINDOW_STEPS, WINDOW_S
from neuron_scheduler.step import StepKind


@dataclass(frozen=True)
class Step:
    """One step on either side: its start (s), seconds, kind and the
    numbers of the requests it ran."""

    start_s: float
    seconds: float
    prefill: bool
    requests: tuple[int, ...]


@dataclass
class Times:
    """A request's first step start, last prefill step end and last step
    end (s)."""

    first_s: float
    first_token_s: float
    end_s: float


def request_number(request_id: str) -> int:
    """The request's index in its level: ``cmpl-validate-N-...`` (the
    server's id of validate's ``validate-N``), or the simulator's ``N``."""
    parts = request_id.split("-")
    return int(parts[2] if len(parts) > 2 else parts[0])


def server_steps(lines: Sequence[dict[str, Any]]) -> list[Step]:
    """The step log's non-empty steps, each ending where the next line
    starts (the last line, which has none, is left out), times from the
    first line."""
    t0 = lines[0]["t"]
    return [
        Step(
            line["t"] - t0,
            after["t"] - line["t"],
            line["kind"] == "prefill",
            tuple(request_number(r) for r in line["ids"]),
        )
        for line, after in zip(lines, lines[1:], strict=False)
        if line["kind"] != "empty"
    ]


def request_times(steps: Sequence[Step]) -> dict[int, Times]:
    """Each request's ``Times`` over ``steps``."""
    times: dict[int, Times] = {}
    for step in steps:
        end = step.start_s + step.seconds
        for number in step.requests:
            found = times.setdefault(number, Times(step.start_s, end, end))
            if step.prefill:
                found.first_token_s = end
            found.end_s = end
    return times


@contextmanager
def _charge_then(after: Callable[[Any, float], float]) -> Iterator[None]:
    """While inside, each simulated step's seconds are ``after(replica,
    seconds)`` of what the replica's cost model charged."""
    charge = engines.Replica._charge

    def charge_then(replica: Any, output: Any) -> float:
        return after(replica, charge(replica, output))

    engines.Replica._charge = charge_then  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        engines.Replica._charge = charge  # type: ignore[method-assign]


def traced(trace: list[Step]) -> AbstractContextManager[None]:
    """Every simulated step appended to ``trace`` while inside."""

    def record(replica: Any, seconds: float) -> float:
        step = replica.scheduler.last_step
        numbers = tuple(request_number(r) for r in step.request_ids)
        prefill = step.kind is StepKind.PREFILL
        trace.append(Step(replica.clock, seconds, prefill, numbers))
        return seconds

    return _charge_then(record)


def speed_by_window(
    lines: Sequence[dict[str, Any]], profile: Profile, window_s: float
) -> dict[int, dict[bool, list[tuple[float, float]]]]:
    """Per window of ``window_s`` from the first line: the served and the
    profiled seconds of each busy step (its next step holds one of its
    requests), prefill (``True``) and decode apart."""
    cost = ProfileCostModel(profile, interpolate=True)
    t0 = lines[0]["t"]
    windows: dict[int, dict[bool, list[tuple[float, float]]]] = {}
    for index, shape, served in busy_lines(lines):
        line = lines[index]
        window = windows.setdefault(int((line["t"] - t0) // window_s), {})
        prefill = line["kind"] == "prefill"
        window.setdefault(prefill, []).append((served, cost.estimate(shape)))
    return windows


def paced(
    factors: dict[int, dict[bool, float]], window_s: float
) -> AbstractContextManager[None]:
    """Every simulated step's seconds times ``factors[window][prefill]``
    (1 where none) for the window of ``window_s`` it starts in, while
    inside: the machine's speed as it moved through the level."""

    def pace(replica: Any, seconds: float) -> float:
        prefill = replica.scheduler.last_step.kind is StepKind.PREFILL
        window = factors.get(int(replica.clock // window_s), {})
        return seconds * window.get(prefill, 1.0)

    return _charge_then(pace)


def window_factors(
    speed: dict[int, dict[bool, list[tuple[float, float]]]],
) -> dict[int, dict[bool, float]]:
    """Each window's served over profiled seconds per kind (the factor that
    gives its steps' time), where it has ``MIN_WINDOW_STEPS`` steps of that
    kind."""
    return {
        window: {
            kind: sum(s for s, _ in steps) / sum(p for _, p in steps)
            for kind, steps in kinds.items()
            if len(steps) >= MIN_WINDOW_STEPS
        }
        for window, kinds in speed.items()
    }


def decode_residuals(
    speed: dict[int, dict[bool, list[tuple[float, float]]]],
    factors: dict[int, dict[bool, float]],
) -> list[float]:
    """Each busy decode step's served seconds over its fitted seconds times
    its window's decode factor (where the window has one): how a step
    varies about its window's speed."""
    return [
        served / (fitted * factors[window][False])
        for window, kinds in speed.items()
        if False in factors.get(window, {})
        for served, fitted in kinds.get(False, [])
    ]


def jittered(residuals: Sequence[float], seed: int) -> AbstractContextManager[None]:
    """Every simulated decode step's seconds times a factor drawn (seeded)
    from ``residuals``, while inside; prefill steps as charged."""
    draw = random.Random(seed)

    def jitter(replica: Any, seconds: float) -> float:
        if replica.scheduler.last_step.kind is StepKind.PREFILL:
            return seconds
        return seconds * draw.choice(residuals)

    return _charge_then(jitter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("level", type=int)
    parser.add_argument("--window", type=float, default=WINDOW_S)
    parser.add_argument(
        "--jitter-seeds", type=int, default=3,
        help="seeds of the jittered simulation, its errors averaged (0: none)",
    )  # fmt: skip
    parser.add_argument("validate_flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    run = load_run(args.run_dir, args.validate_flags)
    level = run.levels[args.level]
    refits = validates_refits(run.profile, run.others(args.level))
    specs = rebuilt_requests(run.options, refits, level, run.levels[0])
    own_lines = run.own(args.level)
    own = calibrated(run.profile, without_jitter(fit(run.profile, own_lines)))
    trace: list[Step] = []
    with traced(trace):
        entry, _ = simulated(run.options, own, level, specs)
    print(f"{level['level']}")
    print(_errors("at its own steps' costs", entry))
    own_mape = level.get("own_steps", {}).get("mape")
    if own_mape is not None and abs(own_mape - entry["mape"]) > 0.05:
        print(
            f"(the report's own_steps: mape {own_mape:.1f}%, drawn or fitted otherwise)"
        )
    speed = speed_by_window(own_lines, own, args.window)
    factors = window_factors(speed)
    with paced(factors, args.window):
        windowed, _ = simulated(run.options, own, level, specs)
    print(_errors(f"each {args.window:g}-s window at its served / fit time", windowed))
    residuals = decode_residuals(speed, factors)
    if args.jitter_seeds > 0 and residuals:
        runs = []
        for seed in range(args.jitter_seeds):
            with paced(factors, args.window), jittered(residuals, seed):
                runs.append(simulated(run.options, own, level, specs)[0])
        label = f"... and each decode step varied as its window's ({len(runs)} seeds)"
        print(_errors(label, _mean_errors(runs)))
    first, last = run.spans[args.level]
    served = server_steps(run.lines[first : last + 2])  # the next line ends the last
    _print_requests(specs, request_times(served), request_times(trace), level)
    _print_windows(factors, served, trace, args.window)


def _mean_errors(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The mape and each relative error of ``entries``, averaged."""
    keys = entries[0]["relative_error"]
    return {
        "mape": statistics.mean(e["mape"] for e in entries),
        "relative_error": {
            key: statistics.mean(e["relative_error"][key] for e in entries)
            for key in keys
        },
    }


def _errors(label: str, entry: dict[str, Any]) -> str:
    """A simulation's mape, and its errors of each mean, the p90 ITL and
    each p99 compared."""
    errors = entry["relative_error"]
    names = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}

    def cells(stat: str, keys: Sequence[str]) -> str:
        return ", ".join(
            f"{names[key]} {errors[f'{stat}_{key}_ms']:+.1%}" for key in keys
        )

    return (
        f"  {label}: mape {entry['mape']:.1f}%; means "
        f"{cells('mean', ('ttft', 'tpot', 'e2el'))}; p90 {cells('p90', ('itl',))}; "
        f"p99s {cells('p99', ('ttft', 'tpot', 'itl', 'e2el'))}"
    )


def _print_requests(
    specs: Sequence[Any],
    server: dict[int, Times],
    simulator: dict[int, Times],
    level: dict[str, Any],
) -> None:
    print("request  arrival  prompt/output | server: wait  first token  end"
          " | simulated: wait  first token  end")  # fmt: skip
    sums = {"server": [0.0, 0.0], "simulated": [0.0, 0.0]}
    shown = 0
    for number, spec in enumerate(specs):
        if number not in server or number not in simulator:
            continue  # refused on both sides (longer than max_model_len)
        arrival = spec.arrival_s
        lengths = f"{spec.input_len:7d}/{spec.output_len:<6d}"
        row = [f"{number:7d} {arrival:8.1f} {lengths}"]
        for side, times in (
            ("server", server[number]),
            ("simulated", simulator[number]),
        ):
            row.append(
                f"{times.first_s - arrival:6.2f} {times.first_token_s - arrival:11.2f}"
                f" {times.end_s - arrival:6.1f}"
            )
            sums[side][0] += times.first_token_s - arrival
            sums[side][1] += times.end_s - arrival
        shown += 1
        print("   | ".join(row))
    measured = level["measured"]
    for side, (first_token, end) in sums.items():
        print(
            f"{side}: mean first token {first_token / shown:.3f} s, "
            f"end {end / shown:.2f} s"
        )
    print(
        f"the client measured: mean TTFT {measured['mean_ttft_ms'] / 1e3:.3f} s, "
        f"E2EL {measured['mean_e2el_ms'] / 1e3:.2f} s"
    )


def _print_windows(
    factors: dict[int, dict[bool, float]],
    server: Sequence[Step],
    simulator: Sequence[Step],
    window_s: float,
) -> None:
    print(f"window ({window_s:g} s)  server's steps / own fit: decode  prefill"
          " | steps, server: decode prefill | simulated: decode prefill")  # fmt: skip
    last = int(max(s.start_s for s in (*server, *simulator)) // window_s)
    for window in range(last + 1):
        found = factors.get(window, {})
        cells = [
            f"{found[kind]:5.2f}" if kind in found else "   - "
            for kind in (False, True)
        ]
        counts = [
            f"{_count(steps, window, window_s, kind):6d}"
            for steps in (server, simulator)
            for kind in (False, True)
        ]
        print(f"{window * window_s:6.0f} s {cells[0]:>25} {cells[1]:>8} | "
              f"{counts[0]} {counts[1]} | {counts[2]} {counts[3]}")  # fmt: skip


def _count(steps: Sequence[Step], window: int, window_s: float, prefill: bool) -> int:
    """The ``steps`` of a kind starting in ``window``."""
    return sum(
        1
        for step in steps
        if int(step.start_s // window_s) == window and step.prefill is prefill
    )


if __name__ == "__main__":
    main()
