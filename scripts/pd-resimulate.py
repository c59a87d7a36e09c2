"""A saved ``validate --disaggregated`` run's levels simulated again: with
each role's profile refitted to the calibration run (the prediction, as
``validate`` makes it with the code checked out) and refitted to the
level's own steps (the diagnostic ``own_steps``), each beside what was
measured.

The run must have been made with ``--calibrate``, ``--save-profile
RUN_DIR/NAME.json`` (it keeps ``NAME-prefill.json`` and
``NAME-decode.json``, as measured), ``--json RUN_DIR/report.json`` and
``--log-dir`` (``RUN_DIR/logs``, or ``RUN_DIR`` itself). A level's
requests are not saved: they are drawn again from the flags the run was
given, which follow the run directory.

Usage: .venv/bin/python scripts/pd-resimulate.py RUN_DIR [VALIDATE_FLAGS ...]
  e.g. RUN_DIR --disaggregated 1P1D --num-requests 40
       --request-rate 0.25 0.4 0.6 --calibrate
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from saved_run import options_of

from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.calibration import level_lines, read_step_log
from neuron_scheduler.sim.kv_transfer import TransferMode, TransferModel
from neuron_scheduler.sim.validation import ValidateOptions, with_decode_plane
from neuron_scheduler.sim.validation_disaggregated import (
    connector_seconds,
    pair_of,
    refitted,
    role_fits,
    simulate_pair,
)
from neuron_scheduler.sim.validation_metrics import compare
from neuron_scheduler.sim.validation_plan import Level, level_requests

ROLES = ("prefill", "decode")
MEANS = ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms")


@dataclass(frozen=True)
class Resimulated:
    """One level: its label, and ``compare``'s errors predicted (the
    calibration run's refit) and at its own steps' costs."""

    level: str
    predicted: dict[str, Any]
    own_steps: dict[str, Any]


def _transfer(report: dict[str, Any]) -> TransferModel:
    """The transfer model the run measured and simulated with."""
    saved = report["disaggregated"]["transfer"]
    return TransferModel(
        TransferMode(saved["mode"]),
        saved["link_bytes_per_s"],
        saved["latency_s"],
        saved["read_bytes_per_s"],
    )


def _profiles(run: Path, options: ValidateOptions) -> dict[str, Profile]:
    """Each role's profile as measured (the decode engine's on its plane
    where the flags ask for one)."""
    (decode_path,) = sorted(run.glob("*-decode.json"))
    stem = decode_path.name.removesuffix("-decode.json")
    profiles = {role: Profile.load(run / f"{stem}-{role}.json") for role in ROLES}
    profiles["decode"] = with_decode_plane(options, profiles["decode"], {})
    return profiles


def _lines_by_level(
    run: Path, report: dict[str, Any]
) -> list[dict[str, list[dict[str, Any]]]]:
    """Each level's lines of each role's step log (``RUN_DIR/logs``, or
    ``RUN_DIR`` itself), as ``validate`` read them (``level_lines``)."""
    logs = run / "logs" if (run / "logs").is_dir() else run
    served = [level["measured"]["completed"] for level in report["levels"]]
    by_level: list[dict[str, list[dict[str, Any]]]] = [{} for _ in served]
    for role in ROLES:
        lines = read_step_log(logs / f"steps-{role}-0.jsonl")
        for index, level in enumerate(level_lines(lines, served)):
            by_level[index][role] = level
    return by_level


def resimulate(run: Path, validate_flags: list[str]) -> list[Resimulated]:
    """Each level after the calibration run, simulated again (see module)."""
    options = options_of(validate_flags)
    report = json.loads((run / "report.json").read_text())
    if not report["levels"][0]["level"].startswith("calibration run"):
        raise SystemExit(f"{run}: not a --calibrate run")
    pair, transfer = pair_of(options), _transfer(report)
    by_level = _lines_by_level(run, report)
    measured = _profiles(run, options)
    connector_s = connector_seconds(pair, transfer)
    predicting = refitted(measured, role_fits(measured, by_level[0], connector_s))
    results = []
    for entry, own_lines in zip(report["levels"][1:], by_level[1:], strict=True):
        rate = entry["request_rate"]
        level = Level(math.inf if rate is None else rate, entry["max_concurrency"])
        workload = replace(options.workload, request_rate=level.request_rate)
        specs, _ = level_requests(
            workload, level.request_rate, pair.prefill.max_model_len
        )
        if len(specs) != entry["num_requests"]:
            raise SystemExit(f"{run}: {entry['level']} sent {entry['num_requests']} "
                             f"requests, these flags draw {len(specs)}")  # fmt: skip
        simulate = partial(simulate_pair, options, pair, transfer, specs, level)
        own = refitted(predicting, role_fits(predicting, own_lines, connector_s))
        results.append(
            Resimulated(
                entry["level"],
                compare(entry["measured"], simulate(predicting)),
                compare(entry["measured"], simulate(own)),
            )
        )
    return results


def _means(errors: dict[str, Any]) -> str:
    means = " / ".join(f"{100 * errors['relative_error'][key]:+.1f}" for key in MEANS)
    return f"{means}% (mape {errors['mape']:.1f}%)"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        raise SystemExit(__doc__.split("Usage: ")[1])
    run = Path(args[0])
    print(f"{run}: mean TTFT / TPOT / E2EL errors, predicted; at own steps' costs")
    for level in resimulate(run, args[1:]):
        print(f"  {level.level}: {_means(level.predicted)}; {_means(level.own_steps)}")


if __name__ == "__main__":
    main()
