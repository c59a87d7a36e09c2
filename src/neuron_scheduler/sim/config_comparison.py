"""Configs side by side on the real server (``validate --config``).

Each labelled ``neuron_config`` is validated in turn on the same engine and
workload (``sim.validation``: its own server, the same levels). One profile,
measured first, covers every config's bucket shapes (the union of their
lists): the machine's speed drifts, and configs simulated with profiles of
different moments differ by that drift (measured: a profile an hour old ran
26% fast, fresh ones within 8%). With ``--cost-profile`` that profile serves
the configs it covers, and the others are profiled on their own. Then, at
the compared level (the capacity run with ``--load-fractions``, else the last level: the
heaviest load, where configs differ most), each config's measured and
simulated output throughput and goodput, its ratio to the first config on
each side, the error of the simulated ratio, and whether the simulator
orders the configs as measured.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from neuron_scheduler.offline.engine_spec import EngineSpec
from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.validation import (
    ValidateError,
    ValidateOptions,
    check_options,
    check_profile_engine,
    measure_profile,
    validate_with_profile,
)
from neuron_scheduler.sim.validation_metrics import format_report


def covers(profile: Profile, spec: EngineSpec, identity: dict[str, Any]) -> bool:
    """Whether ``profile`` (same model and engine) has every bucket shape
    ``spec``'s config can produce."""
    try:
        check_profile_engine(profile, spec, identity)
    except ValidateError:
        return False
    config = spec.resolved_config()
    missing = ProfileCostModel(profile).missing_shapes(
        config.num_batched_tokens_buckets,
        config.num_seqs_buckets,
        config.decode_context_length_buckets,
    )
    return not missing


def compare_configs(
    options: ValidateOptions, configs: list[tuple[str, dict[str, Any]]]
) -> dict[str, Any]:
    """Validate each labelled config (all checked before anything starts);
    the report has each config's validation and the ``comparison``."""
    from neuron_scheduler.offline.profiler import model_identity

    labels = [label for label, _ in configs]
    if len(set(labels)) < len(labels) or len(configs) < 2:
        raise ValidateError(f"--config needs two or more distinct labels, got {labels}")
    runs = [
        (label, replace(options, engine=replace(options.engine, neuron_config=config)))
        for label, config in configs
    ]
    for _, run in runs:
        check_options(run)
    identity = model_identity(options.engine.model)
    if options.cost_profile:
        profiles = [(Profile.load(options.cost_profile), options.cost_profile)]
    else:
        union = union_spec([run.engine for _, run in runs])
        measured = measure_profile(union, options.save_profile, options.progress)
        profiles = [(measured, "measured for every config")]
    reports = []
    for label, run in runs:
        print(f"config {label} ...", file=sys.stderr)
        found = [(p, s) for p, s in profiles if covers(p, run.engine, identity)]
        if found:
            profile, source = found[0]
        else:
            path = _save_path(options.save_profile, label)
            profile = measure_profile(run.engine, path, options.progress)
            source = "measured for this config"
            profiles.append((profile, source))
        report = validate_with_profile(run, profile, identity, f"server-{label}.log")
        reports.append({"label": label, **report, "profile": source})
    return {"configs": reports, "comparison": ranking(reports)}


def union_spec(specs: list[EngineSpec]) -> EngineSpec:
    """The first engine with every bucket of every spec's config (each list
    the union of theirs): one profile of it covers them all."""
    configs = [spec.resolved_config() for spec in specs]
    keys = (
        "num_batched_tokens_buckets",
        "num_seqs_buckets",
        "decode_context_length_buckets",
    )
    union = {
        key: sorted({size for config in configs for size in getattr(config, key)})
        for key in keys
    }
    return replace(specs[0], neuron_config=union)


def _save_path(save_profile: str | None, label: str) -> str | None:
    """``--save-profile P``: each config's profile beside it, ``P-LABEL``."""
    if save_profile is None:
        return None
    path = Path(save_profile)
    return str(path.with_name(f"{path.stem}-{label}{path.suffix}"))


def compared_level(report: dict[str, Any]) -> dict[str, Any]:
    """The level configs are compared at: the capacity run, else the last."""
    return report["levels"][0] if "capacity" in report else report["levels"][-1]


def ranking(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Per config at the compared level: measured and simulated output
    throughput and goodput, each side's ratio to the first config, the
    simulated ratio's error; and both orders (best first)."""
    rows = []
    for report in reports:
        level = compared_level(report)
        measured, simulated = level["measured"], level["simulated"]
        rows.append(
            {
                "label": report["label"],
                "level": level["level"],
                "measured_output_throughput": measured["output_throughput"],
                "simulated_output_throughput": simulated["output_throughput"],
                "measured_goodput": measured["request_goodput"],
                "simulated_goodput": simulated["request_goodput"],
            }
        )
    first = rows[0]
    for row in rows:
        for side in ("measured", "simulated"):
            key = f"{side}_output_throughput"
            row[f"{side}_ratio"] = row[key] / first[key]
        row["ratio_error"] = row["simulated_ratio"] / row["measured_ratio"] - 1
    orders = {
        side: [
            r["label"]
            for r in sorted(rows, key=lambda r: -r[f"{side}_output_throughput"])
        ]
        for side in ("measured", "simulated")
    }
    return {
        "configs": rows,
        "measured_order": orders["measured"],
        "simulated_order": orders["simulated"],
        "same_order": orders["measured"] == orders["simulated"],
    }


def format_comparison(report: dict[str, Any]) -> str:
    """Each config's validation, then the comparison table."""
    parts = [f"== config {r['label']}\n{format_report(r)}" for r in report["configs"]]
    comparison = report["comparison"]
    lines = [
        f"== configs side by side ({comparison['configs'][0]['level']} ...)",
        f"{'config':<20}{'measured tok/s':>15}{'simulated':>11}{'ratio m':>9}"
        f"{'ratio s':>9}{'error':>8}{'goodput m':>11}{'goodput s':>11}",
    ]
    for row in comparison["configs"]:
        lines.append(
            f"{row['label']:<20}{row['measured_output_throughput']:>15.2f}"
            f"{row['simulated_output_throughput']:>11.2f}{row['measured_ratio']:>9.3f}"
            f"{row['simulated_ratio']:>9.3f}{100 * row['ratio_error']:>7.1f}%"
            f"{row['measured_goodput']:>11.3f}{row['simulated_goodput']:>11.3f}"
        )
    same = "yes" if comparison["same_order"] else "NO"
    lines.append(
        f"order measured {' > '.join(comparison['measured_order'])}; simulated "
        f"{' > '.join(comparison['simulated_order'])}; same order: {same}"
    )
    return "\n\n".join([*parts, "\n".join(lines)])
