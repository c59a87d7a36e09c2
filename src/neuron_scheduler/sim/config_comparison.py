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
orders the configs as measured. With a time budget (``--time-budget``,
no ``--num-requests``), the whole comparison is sized to it: what the profile
left is split over the servings by each config's levels as simulated, and
the first serving's count of requests, sized to its share, is every
serving's, each within its own share (with load fractions, the levels
after its capacity run cut to end by it: ``_ServingBudget``).

The machine also drifts while the configs are served, one after the other
(measured: the same decode steps ran 1.19x the profile while the first
config was served and 0.95x minutes later), and a one-pass comparison
cannot call configs closer than that. With ``rounds`` > 1 the configs are
served in that many rounds, every other round in reverse order (A B C, C B
A, ...: a drift steady over the comparison reaches every config alike);
each side's figure is the median over the rounds, and the report says in
how many rounds the measured order was that of the medians, which pairs of
configs the rounds tell apart (medians further apart than either config's
spread over its rounds) and whether the simulator orders those pairs as
measured; the
other pairs are ties, closer than the server's spread between starts
(measured: the same steps 0.86-1.15x the profile from one start to the
next), which no simulator can be asked to order. Where the servings'
step logs say how fast their steps ran against the profile, a pair is
also a tie when its gap is within how far that speed moved over the
pair's servings: the reversed order serves the last config of one round
first in the next, and on 6 December both of one config's servings fell in one slow
stretch of the machine (its decode steps 1.30-1.33x the profile, two
others' 1.14-1.16x), agreed with each other, and ranked it last.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median
from typing import Any

from neuron_scheduler.config import SHAPE_BUCKET_KEYS
from neuron_scheduler.offline.engine_spec import EngineSpec
from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.validation import (
    ValidateError,
    ValidateOptions,
    check_options,
    check_profile_engine,
    measure_profile,
    predicted_levels,
    profile_share,
    validate_with_profile,
)
from neuron_scheduler.sim.validation_metrics import format_report, step_fits
from neuron_scheduler.sim.validation_plan import LevelsCost

#: Seconds a serving's server is taken to need to start, when a time budget
#: is shared by the servings (measured: about 25 s on an Intel Xeon model
#: 167, 32 s on an AMD EPYC of family 25).
SERVER_START_S = 30.0


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
    options: ValidateOptions, configs: list[tuple[str, dict[str, Any]]], rounds: int = 1
) -> dict[str, Any]:
    """Validate each labelled config (all checked before anything starts)
    ``rounds`` times (``serving_order``); the report has each config's
    validations (the first round's at the top, the others in ``repeats``)
    and the ``comparison`` (with ``options.time_budget_s`` and no request
    count, its ``sizing``: ``_ServingBudget``)."""
    from neuron_scheduler.offline.profiler import model_identity

    labels = [label for label, _ in configs]
    if len(set(labels)) < len(labels) or len(configs) < 2:
        raise ValidateError(f"--config needs two or more distinct labels, got {labels}")
    if rounds < 1:
        raise ValidateError(f"--rounds must be 1 or more, got {rounds}")
    runs = {
        label: replace(options, engine=replace(options.engine, neuron_config=config))
        for label, config in configs
    }
    for run in runs.values():
        check_options(run)
    started = time.monotonic()
    identity = model_identity(options.engine.model)
    if options.cost_profile:
        profiles = [(Profile.load(options.cost_profile), options.cost_profile)]
    else:
        union = union_spec([run.engine for run in runs.values()])
        measured = measure_profile(
            union,
            options.save_profile,
            options.progress,
            fit_seconds=profile_share(options),
        )
        profiles = [(measured, "measured for every config")]
    # Each config's profile, found or measured once for every round.
    chosen = {
        label: _profile_for(options, run, label, identity, profiles)
        for label, run in runs.items()
    }
    orders = serving_order(labels, rounds)
    budget = None
    if profile_share(options) is not None:  # a time budget, no request count
        costs = {
            label: predicted_levels(runs[label], chosen[label][0]) for label in labels
        }
        budget = _ServingBudget.of(options, started, orders, costs)
    validations: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for round_index, order in enumerate(orders):
        for label in order:
            profile, source = chosen[label]
            suffix = f"-round{round_index + 1}" if rounds > 1 else ""
            print(f"config {label}{suffix} ...", file=sys.stderr)
            log_name = f"server-{label}{suffix}.log"
            run = budget.first_serving(runs[label]) if budget else runs[label]
            report = validate_with_profile(
                run, profile, identity, log_name, started=time.monotonic()
            )
            validations[label].append({**report, "profile": source})
            if budget and budget.requests_per_level is None:
                runs = budget.fix_count(runs, report)
    reports = [
        {"label": label, **runs_of[0], "repeats": runs_of[1:]}
        for label, runs_of in validations.items()
    ]
    comparison = ranking(reports)
    comparison["serving_order"] = orders
    if budget:
        comparison["sizing"] = budget.report()
    return {"configs": reports, "comparison": comparison}


@dataclass
class _ServingBudget:
    """A comparison's ``--time-budget`` shared by its servings: what the
    profile left of it, split over the servings by each config's levels
    as simulated (``shares_s``); the first serving sizes its levels to its
    share (its server's start included, as ``validate`` sizes one
    config's), and every later serving sends that many requests a level,
    so that every config is measured on the same requests, within its own
    share (``fix_count``). Each later server's start is taken to be the
    first's."""

    budget_s: float
    servings: int
    #: Each config's share of a serving, by label (the first's sizes them).
    shares_s: dict[str, float]
    requests_per_level: int | None = None

    @classmethod
    def of(
        cls,
        options: ValidateOptions,
        started: float,
        orders: list[list[str]],
        costs: dict[str, LevelsCost],
    ) -> _ServingBudget:
        """The budget left since ``started`` (``time.monotonic``) over the
        servings of ``orders``, shared by ``costs`` (``serving_shares``)."""
        budget_s = options.time_budget_s
        assert budget_s is not None
        left = budget_s - (time.monotonic() - started)
        served = [label for order in orders for label in order]
        shares = serving_shares(max(left, 0.0), served, costs)
        if left > 0:
            spent = f"{left / 60:.1f} min left after the profile"
        else:
            spent = f"the profile ran {-left / 60:.1f} min past it"
        each = _minutes_each(shares)
        print(
            f"--time-budget {budget_s / 60:g} min: {spent} for {len(served)} "
            f"servings (min each, by their levels simulated: {each}); the first "
            "sizes the levels for every one",
            file=sys.stderr,
        )
        return cls(budget_s, len(served), shares)

    @property
    def share_s(self) -> float:
        """The first config's share: the one its serving sizes to."""
        return next(iter(self.shares_s.values()))

    def first_serving(self, run: ValidateOptions) -> ValidateOptions:
        """``run`` as served: sized to its share until a count is fixed."""
        if self.requests_per_level is not None:
            return run
        return replace(run, time_budget_s=self.share_s)

    def fix_count(
        self, runs: dict[str, ValidateOptions], first: dict[str, Any]
    ) -> dict[str, ValidateOptions]:
        """``runs`` sending the ``first`` serving's requests a level, each
        within its config's share (``validation.GivenCount``: with load
        fractions, its levels after the capacity run cut to end by it)."""
        self.requests_per_level = first["sizing"]["requests_per_level"]
        return {
            label: replace(
                run,
                workload=replace(run.workload, num_requests=self.requests_per_level),
                time_budget_s=self.shares_s[label],
            )
            for label, run in runs.items()
        }

    def report(self) -> dict[str, Any]:
        return {
            "budget_s": self.budget_s,
            "servings": self.servings,
            "share_s": round(self.share_s, 1),
            "shares_s": {label: round(t, 1) for label, t in self.shares_s.items()},
            "requests_per_level": self.requests_per_level,
        }


def serving_shares(
    left_s: float, served: list[str], costs: dict[str, LevelsCost]
) -> dict[str, float]:
    """Each config's seconds of ``left_s`` for one serving, in proportion
    to what its serving is predicted to take (the ``served`` configs in
    order, a label once per serving): its levels, at the count one would
    send if every serving fitted ``left_s``, and ``SERVER_START_S``."""
    starts = len(served) * SERVER_START_S
    together = LevelsCost(
        sum(costs[label].per_request_s for label in served),
        sum(costs[label].overhead_s for label in served),
    )
    count = together.fitting_count(left_s - starts)
    predicted = {
        label: cost.at(count) + SERVER_START_S for label, cost in costs.items()
    }
    total = sum(predicted[label] for label in served)
    return {label: left_s * t / total for label, t in predicted.items()}


def _minutes_each(shares_s: dict[str, float]) -> str:
    """Each config's share, in minutes: ``a 3.8, b 3.4``."""
    return ", ".join(f"{label} {share / 60:.1f}" for label, share in shares_s.items())


def serving_order(labels: list[str], rounds: int) -> list[list[str]]:
    """The configs of each round in the order they are served: as given,
    reversed every other round."""
    return [labels if r % 2 == 0 else labels[::-1] for r in range(rounds)]


def _profile_for(
    options: ValidateOptions,
    run: ValidateOptions,
    label: str,
    identity: dict[str, Any],
    profiles: list[tuple[Profile, str]],
) -> tuple[Profile, str]:
    """The first of ``profiles`` that covers ``run``'s config, else one
    measured for it (added to ``profiles``)."""
    found = [(p, s) for p, s in profiles if covers(p, run.engine, identity)]
    if found:
        return found[0]
    path = _save_path(options.save_profile, label)
    profiles.append(
        (
            measure_profile(run.engine, path, options.progress),
            "measured for this config",
        )
    )
    return profiles[-1]


def union_spec(specs: list[EngineSpec]) -> EngineSpec:
    """The first engine with every bucket of every spec's config (each list
    the union of theirs): one profile of it covers them all."""
    configs = [spec.resolved_config() for spec in specs]
    union = {
        key: sorted({size for config in configs for size in getattr(config, key)})
        for key in SHAPE_BUCKET_KEYS
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


def _compared_figures(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The compared level of each of a config's validations (its rounds)."""
    return [compared_level(r) for r in (report, *report.get("repeats", ()))]


def ranking(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Per config at the compared level: measured and simulated output
    throughput and goodput (medians over its rounds, each round's measured
    throughput beside), each side's ratio to the first config, the simulated
    ratio's error and how far the step speed moved over its and the first
    config's servings (``step_speed_spread_to_first``: a measured ratio
    can be that far off the configs' own); both orders (best first), and
    the rounds whose own measured order was the medians'."""
    rows = []
    for report in reports:
        levels = _compared_figures(report)
        row: dict[str, Any] = {"label": report["label"], "level": levels[0]["level"]}
        for side in ("measured", "simulated"):
            row[f"{side}_output_throughput"] = median(
                level[side]["output_throughput"] for level in levels
            )
            row[f"{side}_goodput"] = median(
                level[side]["request_goodput"] for level in levels
            )
        row["measured_by_round"] = [
            level["measured"]["output_throughput"] for level in levels
        ]
        row["step_speed_by_round"] = [_step_speed(level) for level in levels]
        rows.append(row)
    first = rows[0]
    for row in rows:
        for side in ("measured", "simulated"):
            key = f"{side}_output_throughput"
            row[f"{side}_ratio"] = row[key] / first[key]
        row["ratio_error"] = row["simulated_ratio"] / row["measured_ratio"] - 1
        row["step_speed_spread_to_first"] = step_speed_spread(first, row)
    orders = {
        side: _best_first([(r["label"], r[f"{side}_output_throughput"]) for r in rows])
        for side in ("measured", "simulated")
    }
    by_round = [
        _best_first([(r["label"], r["measured_by_round"][i]) for r in rows])
        for i in range(len(rows[0]["measured_by_round"]))
    ]
    result = {
        "configs": rows,
        "measured_order": orders["measured"],
        "simulated_order": orders["simulated"],
        "same_order": orders["measured"] == orders["simulated"],
        "rounds": len(by_round),
        "rounds_in_measured_order": sum(o == orders["measured"] for o in by_round),
    }
    if len(by_round) > 1:
        result.update(_apart_and_tied(rows))
    result.update(_as_profiled(reports, rows, orders["measured"]))
    return result


def _as_profiled(
    reports: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    measured_order: list[str],
) -> dict[str, Any]:
    """Where every config's compared level was also simulated with the
    profile as measured (``as_profiled``: the levels simulated with another,
    e.g. ``--decode-plane``): that simulation's throughput, ratio to the
    first config and ratio error in each row, its order and whether it is
    ``measured_order``; else nothing."""
    figures = []
    for report in reports:
        levels = _compared_figures(report)
        found = [level.get("as_profiled", {}).get("simulated") for level in levels]
        if any(metrics is None for metrics in found):
            return {}
        figures.append(median(metrics["output_throughput"] for metrics in found))
    for row, throughput in zip(rows, figures, strict=True):
        row["as_profiled_output_throughput"] = throughput
        row["as_profiled_ratio"] = throughput / figures[0]
        row["as_profiled_ratio_error"] = (
            row["as_profiled_ratio"] / row["measured_ratio"] - 1
        )
    order = _best_first(
        [(r["label"], r["as_profiled_output_throughput"]) for r in rows]
    )
    return {
        "as_profiled_order": order,
        "as_profiled_same_order": order == measured_order,
    }


def _step_speed(level: dict[str, Any]) -> dict[str, float]:
    """How fast a serving's steps ran: per kind of step (``prefill``,
    ``decode``), the median of served / profiled over its busy steps (the
    kinds the level's step log measured; empty without one)."""
    served = level.get("served_vs_profiled", {})
    if "decode_steps" not in served:  # no step log, or its error
        return {}
    return {kind: fit["median_ratio"] for kind, fit in step_fits(served)}


def step_speeds(*rows: dict[str, Any]) -> dict[str, list[float]]:
    """Per kind of step every one of ``rows``' servings measured (prefill
    first), the servings' served / profiled."""
    servings = [speed for row in rows for speed in row.get("step_speed_by_round", ())]
    if not servings:
        return {}
    kinds = set.intersection(*(set(speed) for speed in servings))
    return {
        kind: [speed[kind] for speed in servings]
        for kind in sorted(kinds, reverse=True)
    }


def step_speed_spread(*rows: dict[str, Any]) -> float | None:
    """How far the step speed moved over ``rows``' servings: per kind of
    step every serving measured, largest / smallest of the servings'
    served / profiled, and the larger over the kinds (``None``: no kind
    measured in every serving)."""
    speeds = step_speeds(*rows).values()
    return max((max(v) / min(v) for v in speeds), default=None)


def _apart_and_tied(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over two or more rounds: the pairs of configs the measurement tells
    apart, the higher first, the pairs it does not (ties), and whether the
    simulator orders every pair told apart as measured. A pair is told
    apart when its medians are further apart than either config's spread
    over its rounds (largest less smallest: the server's own spread
    between starts) and, where the step logs say how fast the servings'
    steps ran against the profile, their ratio is above how far that
    speed moved over the pair's servings (``step_speed_spread``: the
    machine's speed, and whatever else moved a step's cost, in the
    minutes each config was served; two servings side by side in time
    share one moment of the machine, so their agreement alone does not
    rule it out)."""
    apart: list[list[str]] = []
    tied: list[list[str]] = []
    for index, one in enumerate(rows):
        for other in rows[index + 1 :]:
            high, low = sorted(
                (one, other), key=lambda r: -r["measured_output_throughput"]
            )
            top, bottom = (
                high["measured_output_throughput"],
                low["measured_output_throughput"],
            )
            speed = step_speed_spread(high, low)
            if top - bottom > max(_spread(high), _spread(low)) and (
                speed is None or top / bottom > speed
            ):
                apart.append([high["label"], low["label"]])
            else:
                tied.append([one["label"], other["label"]])
    simulated = {r["label"]: r["simulated_output_throughput"] for r in rows}
    agreed = sum(simulated[high] > simulated[low] for high, low in apart)
    return {
        "measured_apart": apart,
        "measured_ties": tied,
        "simulated_agrees_where_apart": agreed,
        "step_speed_spread": step_speed_spread(*rows),
    }


def _spread(row: dict[str, Any]) -> float:
    """A config's measured throughput over its rounds, largest less
    smallest."""
    return max(row["measured_by_round"]) - min(row["measured_by_round"])


def _best_first(throughputs: list[tuple[str, float]]) -> list[str]:
    """The labels of ``(label, throughput)`` pairs, highest first."""
    return [label for label, _ in sorted(throughputs, key=lambda pair: -pair[1])]


def format_comparison(report: dict[str, Any]) -> str:
    """Each config's validations, then the comparison table."""
    parts = [
        f"== config {r['label']}{_round_name(i, r)}\n{format_report(v)}"
        for r in report["configs"]
        for i, v in enumerate((r, *r.get("repeats", ())))
    ]
    comparison = report["comparison"]
    rounds = comparison.get("rounds", 1)
    by_round = f"{'measured by round':>20}" if rounds > 1 else ""
    lines = [
        f"== configs side by side ({comparison['configs'][0]['level']} ...)"
        + (f", medians of {rounds} rounds" if rounds > 1 else ""),
        f"{'config':<20}{'measured tok/s':>15}{'simulated':>11}{'ratio m':>9}"
        f"{'ratio s':>9}{'error':>8}{'goodput m':>11}{'goodput s':>11}{by_round}",
    ]
    for row in comparison["configs"]:
        each = " / ".join(f"{v:.1f}" for v in row.get("measured_by_round", ()))
        lines.append(
            f"{row['label']:<20}{row['measured_output_throughput']:>15.2f}"
            f"{row['simulated_output_throughput']:>11.2f}{row['measured_ratio']:>9.3f}"
            f"{row['simulated_ratio']:>9.3f}{100 * row['ratio_error']:>7.1f}%"
            f"{row['measured_goodput']:>11.3f}{row['simulated_goodput']:>11.3f}"
            + (f"{each:>20}" if rounds > 1 else "")
        )
    same = "yes" if comparison["same_order"] else "NO"
    lines.append(
        f"order measured {' > '.join(comparison['measured_order'])}; simulated "
        f"{' > '.join(comparison['simulated_order'])}; same order: {same}"
    )
    if "as_profiled_order" in comparison:
        lines.append(_as_profiled_line(comparison))
    speeds = _ratio_speed_line(comparison["configs"])
    if speeds:
        lines.append(speeds)
    if rounds > 1:
        served = " | ".join(" ".join(o) for o in comparison["serving_order"])
        lines.append(
            f"the measured order held in {comparison['rounds_in_measured_order']} "
            f"of {rounds} rounds (served: {served})"
        )
        lines.append(_apart_line(comparison))
    else:
        lines.append(
            "one round: configs closer than the server's own spread between "
            "starts (a few per cent) cannot be told apart; --rounds 2 or more "
            "says which pairs the measurement separates"
        )
    if "sizing" in comparison:
        lines.append(_budget_line(comparison["sizing"]))
    return "\n\n".join([*parts, "\n".join(lines)])


def _budget_line(sizing: dict[str, Any]) -> str:
    """How ``_ServingBudget`` sized the servings, in one line."""
    each = _minutes_each(sizing["shares_s"])
    return (
        f"sized to --time-budget {sizing['budget_s'] / 60:g} min: "
        f"{sizing['requests_per_level']} requests a level in each of "
        f"{sizing['servings']} servings, shared by their levels as simulated "
        f"(min a serving: {each}; sized on the first)"
    )


def _as_profiled_line(comparison: dict[str, Any]) -> str:
    """The ratios and order simulated with the profile as measured."""
    ratios = ", ".join(
        f"{row['label']} {row['as_profiled_ratio']:.3f} "
        f"({100 * row['as_profiled_ratio_error']:+.1f}%)"
        for row in comparison["configs"][1:]
    )
    same = "yes" if comparison["as_profiled_same_order"] else "NO"
    return (
        f"simulated with the profile as measured: ratios {ratios}; order "
        f"{' > '.join(comparison['as_profiled_order'])}; same order: {same}"
    )


def _ratio_speed_line(rows: list[dict[str, Any]]) -> str:
    """Each ratio's error beside how far the step speed moved over that
    config's and the first's servings, and the errors beyond it (empty
    without step logs)."""
    judged = [r for r in rows[1:] if r.get("step_speed_spread_to_first")]
    if not judged:
        return ""
    each = ", ".join(
        f"{r['label']} {100 * r['ratio_error']:+.1f}% "
        f"({r['step_speed_spread_to_first']:.2f}x)"
        for r in judged
    )
    beyond = [
        r["label"]
        for r in judged
        if abs(math.log1p(r["ratio_error"])) > math.log(r["step_speed_spread_to_first"])
    ]
    return (
        "ratio errors, and how far the step speed moved over the servings of "
        f"each config and {rows[0]['label']}: {each}; errors beyond it: "
        f"{', '.join(beyond) or 'none'}"
    )


def _apart_line(comparison: dict[str, Any]) -> str:
    """The pairs the rounds tell apart, the simulator's agreement on them,
    and the ties."""
    apart = comparison["measured_apart"]
    told = ", ".join(f"{high} > {low}" for high, low in apart) or "none"
    ties = ", ".join(f"{a} ~ {b}" for a, b in comparison["measured_ties"]) or "none"
    speed = comparison.get("step_speed_spread")
    moved = ""
    if speed is not None:
        moved = (
            ", or than the step speed moved over the pair's servings; over "
            f"all: {_speed_range(comparison['configs'])}"
        )
    return (
        f"told apart by the rounds: {told} (simulated in that order: "
        f"{comparison['simulated_agrees_where_apart']} of {len(apart)}); "
        f"ties (closer than a config's spread over its rounds{moved}): {ties}"
    )


def _speed_range(rows: list[dict[str, Any]]) -> str:
    """The servings' served / profiled step times, per kind, least to most."""
    return "; ".join(
        f"{kind} steps {min(speeds):.2f}-{max(speeds):.2f}x the profile"
        for kind, speeds in step_speeds(*rows).items()
    )


def _round_name(index: int, report: dict[str, Any]) -> str:
    """`` (round N)`` where a config was served in several rounds."""
    return f" (round {index + 1})" if report.get("repeats") else ""
