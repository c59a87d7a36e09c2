"""A saved ``validate`` run, read back by the scripts that re-simulate it.

``validate --save-profile RUN_DIR/profile.json --json RUN_DIR/report.json
--log-dir RUN_DIR/logs`` keeps what they need: the profile before any
refit, the report (each level's measured figures), and the server's step
log (``logs/steps-server.jsonl``). A level's requests are not saved; they
are drawn again from the flags the run was given, and checked against the
report (``rebuilt_requests``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from neuron_scheduler.cli.validate import add_arguments, validate_options
from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.calibration import (
    Calibration,
    CalibrationError,
    calibrated,
    fit,
    level_spans,
    read_step_log,
    scaled,
)
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.validation import ValidateOptions, with_decode_plane
from neuron_scheduler.sim.validation_metrics import COMPARED, PERCENTILES, compare
from neuron_scheduler.sim.validation_plan import level_requests, simulate_level
from neuron_scheduler.sim.workload import RequestSpec, build_workload


@dataclass(frozen=True)
class SavedRun:
    """The run's options, report, profile (as measured; with its decode
    plane where the flags ask for one), step log, and each level's first
    and last line in it."""

    options: ValidateOptions
    report: dict[str, Any]
    profile: Profile
    lines: list[dict[str, Any]]
    spans: list[tuple[int, int]]

    @property
    def levels(self) -> list[dict[str, Any]]:
        return self.report["levels"]

    def others(self, index: int) -> list[dict[str, Any]]:
        """The step log without level ``index``'s lines."""
        first, last = self.spans[index]
        return [*self.lines[:first], *self.lines[last + 1 :]]

    def adjacent(self, index: int) -> list[dict[str, Any]]:
        """The lines of the levels served just before and just after level
        ``index`` (one of them for the first and the last)."""
        near = [i for i in (index - 1, index + 1) if 0 <= i < len(self.spans)]
        return [line for i in near for line in self.own(i)]

    def own(self, index: int) -> list[dict[str, Any]]:
        """Level ``index``'s lines of the step log."""
        first, last = self.spans[index]
        return self.lines[first : last + 1]


def options_of(validate_flags: list[str]) -> ValidateOptions:
    """The options ``validate`` ran with, from the flags it was given."""
    flags = argparse.ArgumentParser()
    add_arguments(flags)
    return validate_options(flags.parse_args(validate_flags))


def load_run(run_dir: Path, validate_flags: list[str]) -> SavedRun:
    """The run saved in ``run_dir`` by ``validate`` with ``validate_flags``
    (its workload and engine flags; none for the defaults); exits naming
    the run where its step log and report disagree."""
    options = options_of(validate_flags)
    report = json.loads((run_dir / "report.json").read_text())
    profile = with_decode_plane(options, Profile.load(run_dir / "profile.json"), {})
    lines = read_step_log(run_dir / "logs" / "steps-server.jsonl")
    served = [level["measured"]["completed"] for level in report["levels"]]
    try:
        spans = level_spans(lines, served)
    except CalibrationError as error:
        raise SystemExit(f"{run_dir}: {error}") from None
    return SavedRun(options, report, profile, lines, spans)


def without_jitter(calibration: Calibration) -> Calibration:
    """``calibration`` charging every decode step as fitted, undrawn."""
    steady = replace(calibration.decode_steps, jitter=())
    return replace(calibration, decode_steps=steady)


def validates_refits(
    profile: Profile, lines: Sequence[dict[str, Any]]
) -> list[Profile]:
    """``profile`` refitted to ``lines`` as ``validate`` refits it (the
    decode steps drawn about their fit), then as it did before commit
    d39f0c9 (undrawn): a saved run's levels were simulated with one of them."""
    calibration = fit(profile, lines)
    return [
        calibrated(profile, calibration),
        calibrated(profile, without_jitter(calibration)),
    ]


def rebuilt_requests(
    options: ValidateOptions,
    refits: Sequence[Profile],
    level: dict[str, Any],
    first: dict[str, Any],
) -> list[RequestSpec]:
    """``level``'s requests as ``validate`` built them: ``level_requests``
    (the first of the ``first`` level's sample where it sent fewer), or,
    for a run all at once saved before ``level_requests`` (4 December), the
    built-in workload drawn at an infinite rate (other lengths). Whichever
    gives the report's errors again with one of ``refits`` (the profile
    the report simulated the level with, as validate refits now or
    refitted when the run was saved); none: stop."""
    rate = level["request_rate"] or math.inf
    sample = max(level["num_requests"], first["num_requests"])
    workload = replace(options.workload, num_requests=sample)
    max_model_len = options.engine.max_model_len
    ways = [level_requests(workload, rate, max_model_len, level["num_requests"])[0]]
    if math.isinf(rate):
        at_once = replace(
            workload, num_requests=level["num_requests"], request_rate=rate
        )
        ways.append(build_workload(at_once, max_model_len)[0])
    for specs in ways:
        for refitted in refits:
            entry, _ = simulated(options, refitted, level, specs)
            if math.isclose(entry["mape"], level["mape"], rel_tol=1e-6):
                return specs
    raise SystemExit(
        f"{level['level']}: re-simulated with validate's refit, mape "
        f"{entry['mape']:.3f}% against the report's {level['mape']:.3f}%: the "
        "run's requests were not rebuilt (pass the flags it was given)"
    )


def simulated(
    options: ValidateOptions,
    profile: Profile,
    level: dict[str, Any],
    specs: list[RequestSpec],
) -> tuple[dict[str, Any], list[float]]:
    """``specs`` (``level``'s requests) simulated with ``profile``: the
    level's entry with these errors, and each served request's finish
    time."""
    run, _ = simulate_level(options.engine, profile, specs, level["max_concurrency"])
    metrics = compute_metrics(run, options.goodput, percentiles=PERCENTILES)
    entry = {**level, "simulated": metrics, **compare(level["measured"], metrics)}
    finish_s = [r.finish_s for r in run.records if not r.failed]
    return entry, finish_s


def ensembled(
    options: ValidateOptions,
    profile: Profile,
    level: dict[str, Any],
    specs: list[RequestSpec],
    factors: Sequence[float],
) -> tuple[dict[str, Any], list[float]]:
    """``specs`` simulated with ``profile``'s every step times each of
    ``factors``: the level's entry with each compared metric the mean over
    them (``averaged``) and its errors, and the finish times at the middle
    factor."""
    runs = [simulated(options, scaled(profile, f), level, specs) for f in factors]
    metrics = averaged([entry["simulated"] for entry, _ in runs])
    entry = {**level, "simulated": metrics, **compare(level["measured"], metrics)}
    return entry, runs[len(runs) // 2][1]


def averaged(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The first of ``runs``' metrics, each compared one (``COMPARED``)
    the mean over all of them."""
    return {
        **runs[0],
        **{key: sum(run[key] for run in runs) / len(runs) for key in COMPARED},
    }
