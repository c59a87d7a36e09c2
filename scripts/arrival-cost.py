"""Does a request's arrival cost the server's step it lands in?

On two shared cores the API server parses, tokenizes and hands each new
request to the engine core while the worker runs a step. If that cost
showed in the step times, ``validate``'s refit (``served = scale x
profiled + overhead``, a kind: ``sim.calibration``) would need a third
term and the simulator a charge per arrival. This reads saved ``validate``
runs (the profile ``--save-profile`` kept, the server's step log from
``--log-dir``) and fits each kind's busy steps, over all levels, by least
squares three ways: the refit's line; with the arrivals during the step
(its requests, running and waiting, at the next step, less those at its
own start, plus those it finished: a request is finished after the last
step that names it, and nothing is preempted); and with the arrivals
during the step before. Each coefficient is printed with its standard
error (seconds), and the residuals' root mean square.

A busy step's next step holds one of its requests, so a decode step during
which a request arrived is mostly left out of those fits (its next step
prefills the new request). Last, the direct look: the median of served
less profiled of the decode steps followed by a prefill of new requests
(a request arrived while they ran; some of their requests run on, so the
engine was busy throughout) beside that of the decode steps followed by a
decode step. And the other way round: the decode steps that follow a
prefill step (the prefill's activations have taken the core's caches)
against those that follow a decode step, each as served over profiled,
and what the difference costs as a share of the decode steps' served time
(were it large, the simulator would have to charge the step after a
prefill apart).

Usage: .venv/bin/python scripts/arrival-cost.py RUN_DIR [RUN_DIR ...]
  each RUN_DIR holding profile.json and logs/steps-server.jsonl
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.calibration import busy_lines, line_shape, read_step_log
from neuron_scheduler.sim.profile_cost import ProfileCostModel

Lines = Sequence[dict[str, Any]]

#: Each fit's regressors besides the intercept: columns of ``_rows``.
FITS = {
    "line": (0,),
    "+ during": (0, 2),
    "+ before": (0, 3),
}
NAMES = ("profiled", "intercept", "arrivals during", "arrivals before")


def _last_steps(lines: Lines) -> dict[str, int]:
    """Each request's last step: it finished there (nothing is preempted)."""
    last: dict[str, int] = {}
    for index, line in enumerate(lines):
        for request in line["ids"]:
            last[request] = index
    return last


def _arrivals(lines: Lines) -> list[int]:
    """Requests that arrived while each step ran (the last step: 0)."""
    last = _last_steps(lines)
    arrived = []
    for index, (line, following) in enumerate(zip(lines, lines[1:], strict=False)):
        finished = sum(1 for r in line["ids"] if last[r] == index)
        before = line["running"] + line["waiting"]
        after = following["running"] + following["waiting"]
        arrived.append(after - before + finished)
    return [*arrived, 0]


def _rows(cost: ProfileCostModel, lines: Lines) -> dict[str, np.ndarray]:
    """Per kind, a row per busy step: profiled s, served s, arrivals
    during it, arrivals during the step before it."""
    arrived = _arrivals(lines)
    rows: dict[str, list[tuple[float, float, int, int]]] = {
        "prefill": [],
        "decode": [],
    }
    for index, shape, served in busy_lines(lines):
        before = arrived[index - 1] if index else 0
        row = (cost.estimate(shape), served, arrived[index], before)
        rows[lines[index]["kind"]].append(row)
    return {kind: np.array(found) for kind, found in rows.items() if found}


def _fit(rows: np.ndarray, columns: tuple[int, ...]) -> str:
    """Least squares of served on ``columns`` and an intercept: each
    coefficient +- its standard error, and the residuals' rms."""
    x = np.column_stack([rows[:, list(columns)], np.ones(len(rows))])
    coefficients, *_ = np.linalg.lstsq(x, rows[:, 1], rcond=None)
    residuals = rows[:, 1] - x @ coefficients
    variance = residuals @ residuals / max(len(rows) - x.shape[1], 1)
    try:
        errors = np.sqrt(np.diag(variance * np.linalg.inv(x.T @ x)))
    except np.linalg.LinAlgError:  # a column without variation (no arrival)
        return "no arrival to fit"
    names = [NAMES[c] for c in columns] + ["intercept"]
    terms = ", ".join(
        f"{name} {value:.4f} ± {error:.4f}"
        for name, value, error in zip(names, coefficients, errors, strict=True)
    )
    return f"{terms}; rms {1000 * np.sqrt(variance):.1f} ms"


def _decode_then(cost: ProfileCostModel, lines: Lines) -> dict[str, list[float]]:
    """Served less profiled seconds of each decode step some of whose
    requests run on, by what follows it: ``decode`` or ``prefill``."""
    last = _last_steps(lines)
    found: dict[str, list[float]] = {"decode": [], "prefill": []}
    for index, (line, following) in enumerate(zip(lines, lines[1:], strict=False)):
        shape = line_shape(line)
        runs_on = any(last[r] > index for r in line["ids"])
        if line["kind"] != "decode" or shape is None or not runs_on:
            continue
        if following["kind"] in found:
            served = following["t"] - line["t"]
            found[following["kind"]].append(served - cost.estimate(shape))
    return found


def _decode_after(cost: ProfileCostModel, lines: Lines) -> dict[str, np.ndarray]:
    """(profiled, served) seconds of each busy decode step, by the kind of
    the step before it: ``decode`` or ``prefill``."""
    found: dict[str, list[tuple[float, float]]] = {"decode": [], "prefill": []}
    for index, shape, served in busy_lines(lines):
        before = lines[index - 1]["kind"] if index else None
        if lines[index]["kind"] == "decode" and before in found:
            found[before].append((cost.estimate(shape), served))
    return {kind: np.array(pairs).reshape(-1, 2) for kind, pairs in found.items()}


def after_prefill_line(after: dict[str, np.ndarray]) -> str | None:
    """The decode steps after a prefill against those after a decode (the
    median served / profiled of each), and the share of all decode steps'
    served time that the first ones take beyond the second ones' ratio;
    ``None`` without steps of both."""
    prefill, decode = after["prefill"], after["decode"]
    if not len(prefill) or not len(decode):
        return None
    ratio_p = float(np.median(prefill[:, 1] / prefill[:, 0]))
    ratio_d = float(np.median(decode[:, 1] / decode[:, 0]))
    excess = float(np.sum(prefill[:, 1] - ratio_d * prefill[:, 0]))
    served = float(prefill[:, 1].sum() + decode[:, 1].sum())
    share = len(prefill) / (len(prefill) + len(decode))
    return (
        f"  decode steps after a prefill: {len(prefill)} ({share:.1%}), served "
        f"/ profiled {ratio_p:.3f} against {ratio_d:.3f} after a decode "
        f"({ratio_p / ratio_d - 1:+.1%}); beyond that ratio they take "
        f"{excess / served:+.2%} of the decode steps' served time"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+")
    args = parser.parse_args()
    for run in args.run_dirs:
        cost = ProfileCostModel(Profile.load(run / "profile.json"), interpolate=True)
        lines = read_step_log(run / "logs" / "steps-server.jsonl")
        print(run)
        for kind, rows in _rows(cost, lines).items():
            print(
                f"  {kind}: {len(rows)} busy steps, {int(rows[:, 2].sum())} "
                f"arrivals during them, {int(rows[:, 3].sum())} just before"
            )
            for name, columns in FITS.items():
                print(f"    {name:<9} {_fit(rows, columns)}")
        for then, extra in _decode_then(cost, lines).items():
            if extra:
                print(
                    f"  decode steps followed by {then}: {len(extra)}, served "
                    f"less profiled: median {1000 * np.median(extra):+.1f} ms"
                )
        after = after_prefill_line(_decode_after(cost, lines))
        if after is not None:
            print(after)


if __name__ == "__main__":
    main()
