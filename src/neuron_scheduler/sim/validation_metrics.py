"""What ``validate`` measures and compares, and its report's text.

The server's side is summarised with the simulator's definitions
(``measured_metrics``, each p99 with its ``p99_interval``), each compared
metric's relative error and ``mape`` (``compare``), the capacity of a run
that sent every request at once (``steady_rate``), the report held to
``Targets`` (``judge``), and the table ``format_report`` prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from neuron_scheduler.sim.results import latency_stats
from neuron_scheduler.sim.slo import DEFAULT_GOODPUT, SLO
from neuron_scheduler.sim.step_jitter import WINDOW_S, StepJitter

if TYPE_CHECKING:
    from neuron_scheduler.sim.workload import RequestSpec

#: The means ``mape`` averages over.
MAPE_METRICS = ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms")

#: What the report compares.
COMPARED = tuple(
    f"{stat}_{metric}_ms"
    for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "p90", "p99")
) + ("output_throughput", "request_goodput")

#: The p99s the targets hold (``judge``).
P99_METRICS = tuple(key for key in COMPARED if key.startswith("p99_"))

#: Percentiles reported besides the median and p99 (``latency_stats``).
PERCENTILES = (90.0,)

#: The simulated figures a report keeps.
SIMULATED_KEYS = (*COMPARED, "completed", "failed", "duration")

#: How ``--load-fractions`` measures capacity (the report states it).
CAPACITY_RULE = (
    "every request at once; capacity = the requests completed between the "
    "10% and the 90% completion times over that time: the service rate while "
    "the queue never empties, the highest open-loop rate at which it does not grow"
)


#: How sure ``p99_interval`` is that the p99 lies within it.
INTERVAL_CONFIDENCE = 0.95


#: The share every step's cost is moved up and down for a level's
#: ``step_cost_spread``: about how far the server's median step moves
#: against the profile from one level to the next on one machine.
STEP_COST_CHANGE = 0.02


def step_cost_spread(
    reported: dict[str, Any], cheaper: dict[str, Any], dearer: dict[str, Any]
) -> dict[str, Any]:
    """A level's ``step_cost_spread``: each compared metric's least and
    most over the simulation reported and those with every step
    ``STEP_COST_CHANGE`` cheaper and dearer (near a queue's edge a small
    change in step costs moves a request past another's arrival, and a
    latency by far more than the change)."""
    runs = (reported, cheaper, dearer)
    return {
        "change": STEP_COST_CHANGE,
        "low": {key: min(run[key] for run in runs) for key in COMPARED},
        "high": {key: max(run[key] for run in runs) for key in COMPARED},
    }


def _within_spread(key: str, level: dict[str, Any]) -> bool | None:
    """Whether the measured ``key`` lies within the level's
    ``step_cost_spread`` (``None``: the level has none)."""
    spread = level.get("step_cost_spread")
    if spread is None:
        return None
    measured = level["measured"][key]
    return bool(spread["low"][key] <= measured <= spread["high"][key])


def p99_interval(values: np.ndarray) -> tuple[float, float | None]:
    """Where the p99 of what ``values`` were drawn from lies, with
    ``INTERVAL_CONFIDENCE``: two of the values, chosen by order (the count
    above the true p99 is binomial, n and 1%), so no distribution is
    assumed. ``None`` above: fewer than 368 values cannot bound it from
    above (all of them fall below it that often). It treats the values as
    independent; gaps that one step stalls together make the true spread
    wider."""
    ordered = np.sort(np.asarray(values, dtype=float))[::-1]  # largest first
    if ordered.size == 0:
        raise ValueError("no values: no p99 to bound")
    tail = (1 - INTERVAL_CONFIDENCE) / 2
    above = _binomial_cdf(ordered.size, 0.01, until=1 - tail)
    # The (j+1)-th largest value is at most the p99 when at most j lie above it.
    low = next(j for j, cdf in enumerate(above) if cdf >= 1 - tail)
    high = [j for j, cdf in enumerate(above) if cdf <= tail]
    upper = float(ordered[high[-1]]) if high else None
    return float(ordered[low]), upper


def _binomial_cdf(n: int, p: float, until: float) -> list[float]:
    """P(X <= k) for X ~ binomial(n, p), k = 0, 1, ... until it reaches
    ``until`` (or k = n - 1)."""
    cdf: list[float] = []
    total = 0.0
    for k in range(n):
        log_pmf = (
            math.lgamma(n + 1)
            - math.lgamma(k + 1)
            - math.lgamma(n - k + 1)
            + k * math.log(p)
            + (n - k) * math.log1p(-p)
        )
        total += math.exp(log_pmf)
        cdf.append(total)
        if total >= until:
            break
    return cdf


@dataclass(frozen=True)
class Targets:
    """How close ``validate`` aims to be (issue 21), as fractions of the
    measured figure: ``judge`` holds each level with a load fraction, and
    the capacity, to them. ``PAIR_TARGETS`` are the pair's."""

    mean: float = 0.10
    #: For the means at loads above ``near_saturation`` of capacity.
    mean_near_saturation: float = 0.15
    near_saturation: float = 0.9
    #: ``None``: the p99s are reported, not held to a target.
    p99: float | None = 0.20
    #: ``None``: no capacity is measured.
    capacity: float | None = 0.10
    #: Hold the levels at a set rate or concurrency too (their share of
    #: capacity unknown: to the means' target below ``near_saturation``).
    set_loads: bool = False
    #: The levels whose every mean must be met (``None``: each level's own).
    levels_meeting_means: int | None = None

    def describe(self) -> str:
        text = f"TTFT, TPOT and E2EL means within {100 * self.mean:g}%"
        if self.mean_near_saturation != self.mean:
            text += (
                f" ({100 * self.mean_near_saturation:g}% above "
                f"{100 * self.near_saturation:g}% of capacity)"
            )
        if self.levels_meeting_means is not None:
            text += f" at {self.levels_meeting_means} levels at least"
        if self.p99 is not None:
            text += f", p99s within {100 * self.p99:g}%"
        if self.capacity is not None:
            text += f", capacity within {100 * self.capacity:g}%"
        return text


#: ``validate --disaggregated``'s (issue 22): every mean within 15% at two
#: levels at least, the levels at set rates, no capacity measured.
PAIR_TARGETS = Targets(
    mean=0.15,
    mean_near_saturation=0.15,
    p99=None,
    capacity=None,
    set_loads=True,
    levels_meeting_means=2,
)


def judge(report: dict[str, Any], targets: Targets = Targets()) -> dict[str, Any]:
    """Which ``targets`` the report meets: the capacity's error and, for each
    level run at a share of capacity (with ``targets.set_loads``: every
    level but the calibration run), each mean of ``MAPE_METRICS`` and each
    of ``P99_METRICS`` beyond its target (``missed``: key, error, target,
    for a p99 whether the simulated one lies within the measured interval,
    for a mean its ``largest_request`` where the level keeps its requests,
    with whether the mean meets its target without it (``met_without``),
    and where the level has a ``step_cost_spread`` whether the measured
    figure lies within it); with ``targets.levels_meeting_means``, how many
    levels met every mean (``means_met``)."""
    verdict: dict[str, Any] = {"targets": targets.describe(), "levels": []}
    capacity = report.get("capacity")
    if capacity and targets.capacity is not None:
        error = capacity["relative_error"]
        verdict["capacity_met"] = abs(error) <= targets.capacity
    calibration = report.get("calibration", {}).get("level")
    for level in report["levels"]:
        fraction = level.get("load_fraction")
        if fraction is not None:
            near = fraction > targets.near_saturation
        elif targets.set_loads and level["level"] != calibration:
            near = False
        else:
            continue  # the targets are set at shares of capacity
        missed = _misses(level, near, targets)
        verdict["levels"].append({"level": level["level"], "missed": missed})
    if targets.levels_meeting_means is not None:
        verdict["means_met"] = _means_met(
            verdict["levels"], targets.levels_meeting_means
        )
    moved = decode_speed_by_level(report["levels"])
    if moved:
        verdict["decode_speed"] = moved
    return verdict


def _means_met(judged: list[dict[str, Any]], needed: int) -> dict[str, Any]:
    """How many of the ``judged`` levels met every mean, of how many, and
    whether that is ``needed`` at least."""
    met = sum(
        not any(miss["metric"] in MAPE_METRICS for miss in level["missed"])
        for level in judged
    )
    return {"levels": met, "of": len(judged), "needed": needed, "met": met >= needed}


def _misses(
    level: dict[str, Any], near: bool, targets: Targets
) -> list[dict[str, Any]]:
    """``judge``'s ``missed`` for ``level``, held to the means' targets near
    saturation where ``near``."""
    mean_target = targets.mean_near_saturation if near else targets.mean
    missed = []
    for key in (*MAPE_METRICS, *P99_METRICS):
        p99 = key in P99_METRICS
        target = targets.p99 if p99 else mean_target
        error = level["relative_error"][key]
        if target is None or abs(error) <= target:
            continue
        miss: dict[str, Any] = {"metric": key, "error": error, "target": target}
        if p99:
            miss["within_interval"] = _within(key, level)
        else:
            _add_largest_request(miss, level)
        within_spread = _within_spread(key, level)
        if within_spread is not None:
            miss["within_spread"] = within_spread
        missed.append(miss)
    return missed


def _add_largest_request(miss: dict[str, Any], level: dict[str, Any]) -> None:
    """A missed mean given its ``largest_request`` in ``level``, with
    ``met_without``: whether the mean meets the miss's target without it
    (none where the level keeps no requests)."""
    largest = largest_request(level, miss["metric"])
    if largest is None:
        return
    without = largest["error_without"]
    largest["met_without"] = without is not None and abs(without) <= miss["target"]
    miss["largest_request"] = largest


def decode_speed_by_level(levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How fast the server's decode steps ran at each level against one
    profile (each level's ``decode_speed_x``), with each level's mape at its
    own steps' costs: where the speed moves from one level to the next, the
    refit on the other levels charges a level its neighbours' speed, which
    is the machine's drift, not the model's error. ``None`` where fewer
    than two levels had decode steps enough to say."""
    rows = []
    for level in levels:
        if "decode_speed_x" not in level:
            continue
        own = level.get("own_steps")
        rows.append(
            {
                "level": level["level"],
                "served_x": level["decode_speed_x"],
                "own_steps_mape": own["mape"] if own else None,
            }
        )
    if len(rows) < 2:
        return None
    ratios = [row["served_x"] for row in rows]
    return {"levels": rows, "moved_x": max(ratios) / min(ratios)}


def _measured_interval(key: str, level: dict[str, Any]) -> list[Any] | None:
    """The measured interval of ``key`` (a p99 of ``P99_METRICS``) in
    ``level`` (``None``: the report has none)."""
    name = key.removeprefix("p99_").removesuffix("_ms")
    interval: list[Any] | None = level["measured"].get(interval_key(name))
    return interval


def _within(key: str, level: dict[str, Any]) -> bool | None:
    """Whether the simulated ``key`` (a p99) lies within the measured
    interval (``None``: the report has none)."""
    interval = _measured_interval(key, level)
    if interval is None:
        return None
    low, high = interval
    simulated = level["simulated"][key]
    return bool(low <= simulated and (high is None or simulated <= high))


def steady_rate(finish_times_s: list[float]) -> float:
    """Requests per second completed between the 10% and the 90% completion
    times of a run that sent every request at once (``CAPACITY_RULE``);
    with fewer than 10 requests, all of them over the last completion."""
    times = sorted(finish_times_s)
    n = len(times)
    if n == 0:
        raise ValueError("no request completed: no capacity to measure")
    first, last = int(0.1 * n), math.ceil(0.9 * n) - 1
    if n < 10 or times[last] <= times[first]:
        return n / times[-1]
    return (last - first) / (times[last] - times[first])


def client_latencies(result: dict[str, Any]) -> list[dict[str, float] | None]:
    """Each request's TTFT, E2EL and, where it had more than one output
    token, TPOT (ms) as ``vllm.benchmarks.serve.benchmark``'s per-request
    results give them, in the order sent, with the simulator's definitions
    (``RequestRecord.latencies_ms``); ``None`` where it failed."""
    each: list[dict[str, float] | None] = []
    for error, first, latency, n in zip(
        result["errors"],
        result["ttfts"],
        result["latencies"],
        result["output_lens"],
        strict=True,
    ):
        if error:
            each.append(None)
            continue
        values = {"ttft": first * 1e3, "e2el": latency * 1e3}
        if n > 1:
            values["tpot"] = (latency - first) * 1e3 / (n - 1)
        each.append(values)
    return each


def measured_metrics(
    result: dict[str, Any], goodput: tuple[SLO, ...] = DEFAULT_GOODPUT
) -> dict[str, Any]:
    """``vllm.benchmarks.serve.benchmark``'s per-request results, summarized
    with the simulator's definitions (``goodput``: the SLOs a good request
    meets)."""
    served = [
        (values, n, gaps)
        for values, n, gaps in zip(
            client_latencies(result), result["output_lens"], result["itls"], strict=True
        )
        if values is not None
    ]
    each = [values for values, _, _ in served]
    good = sum(all(slo.met_by(values) for slo in goodput) for values in each)
    metrics: dict[str, Any] = {
        "completed": len(served),
        "failed": len(result["errors"]) - len(served),
        "duration": result["duration"],
        "output_throughput": sum(n for _, n, _ in served) / result["duration"],
        "request_goodput": good / result["duration"],
    }
    itl = [gap * 1e3 for _, _, gaps in served for gap in gaps]
    for name in ("ttft", "tpot", "itl", "e2el"):
        values = itl if name == "itl" else [v[name] for v in each if name in v]
        array = np.asarray(values)
        metrics.update(latency_stats(name, array, PERCENTILES))
        if values:
            metrics[interval_key(name)] = list(p99_interval(array))
    return metrics


def request_columns(
    specs: Sequence[RequestSpec],
    measured: Sequence[dict[str, float] | None],
    simulated: Sequence[dict[str, float] | None],
    client_errors: Sequence[str] | None = None,
) -> dict[str, list[Any]]:
    """A level's ``requests``: per request sent, in order, its prompt and
    output tokens, its latencies measured (``client_latencies``) and
    simulated (``latencies_by_request``), and, given the benchmark
    client's ``client_errors``, each failed request's error text
    (``None`` where it did not fail); ``largest_request`` and
    ``one_sided_failures`` read them."""
    counts = {
        "requests sent": len(specs),
        "measured": len(measured),
        "simulated": len(simulated),
    }
    if client_errors is not None:
        counts["client errors"] = len(client_errors)
    if len(set(counts.values())) != 1:
        said = ", ".join(f"{count} {name}" for name, count in counts.items())
        raise ValueError(f"{said}: they must be the same requests")
    columns: dict[str, list[Any]] = {
        "prompt_tokens": [spec.input_len for spec in specs],
        "output_tokens": [spec.output_len for spec in specs],
        "measured": list(measured),
        "simulated": list(simulated),
    }
    if client_errors is not None:
        columns["client_errors"] = [error or None for error in client_errors]
    return columns


def one_sided_failures(level: dict[str, Any]) -> list[str]:
    """A line for each request of ``level`` that failed on one side only
    (completed on the other), naming it, its tokens and, where it failed on
    the server, the last line of the client's error text."""
    requests = level.get("requests")
    if not requests:
        return []
    errors = requests.get("client_errors") or [None] * len(requests["measured"])
    lines = []
    for number, (measured, simulated, error) in enumerate(
        zip(requests["measured"], requests["simulated"], errors, strict=True)
    ):
        if (measured is None) == (simulated is None):
            continue
        tokens = _request_name(
            number,
            requests["prompt_tokens"][number],
            requests["output_tokens"][number],
        )
        if simulated is None:
            lines.append(f"{tokens} completed on the server, failed simulated")
            continue
        said = (error or "").strip().splitlines()
        lines.append(
            f"{tokens} failed on the server, completed simulated"
            + (f": {said[-1]}" if said else "")
        )
    return lines


def _request_name(number: int, prompt_tokens: int, output_tokens: int) -> str:
    """``request 17 (212 + 22 tokens)``: a request as the report names it."""
    return f"request {number} ({prompt_tokens} + {output_tokens} tokens)"


def largest_request(level: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The request that carries most of the error of ``key`` (a mean of
    ``MAPE_METRICS``) in ``level``, from its ``requests``: its number (its
    order sent: ``validate-N`` on the server), tokens, latency measured and
    simulated, the share of the measured mean its difference carries
    (``carried``: over the requests with the latency on both sides, the
    shares add up to the mean's error) and the mean's error without it
    (``error_without``). ``None`` where the level keeps no requests or
    fewer than two have the latency on both sides."""
    requests = level.get("requests")
    if not requests:
        return None
    name = key.removeprefix("mean_").removesuffix("_ms")
    pairs = [
        (number, measured[name], simulated[name])
        for number, (measured, simulated) in enumerate(
            zip(requests["measured"], requests["simulated"], strict=True)
        )
        if measured and simulated and name in measured and name in simulated
    ]
    if len(pairs) < 2:
        return None
    measured_sum = sum(m for _, m, _ in pairs)
    simulated_sum = sum(s for _, _, s in pairs)
    number, measured, simulated = max(pairs, key=lambda pair: abs(pair[2] - pair[1]))
    rest = measured_sum - measured
    return {
        "request": number,
        "prompt_tokens": requests["prompt_tokens"][number],
        "output_tokens": requests["output_tokens"][number],
        "measured_ms": measured,
        "simulated_ms": simulated,
        "carried": (simulated - measured) / measured_sum,
        "error_without": (simulated_sum - simulated - rest) / rest if rest else None,
    }


def interval_key(name: str) -> str:
    """Where ``measured_metrics`` keeps the ``p99_interval`` of ``name``
    (``ttft``, ``tpot``, ``itl``, ``e2el``)."""
    return f"p99_{name}_ms_interval"


def compare(measured: dict[str, Any], simulated: dict[str, Any]) -> dict[str, Any]:
    """Relative error of each compared metric, and ``mape`` (percent)."""
    errors = {
        key: (simulated[key] - measured[key]) / measured[key] if measured[key] else 0.0
        for key in COMPARED
    }
    mape = 100 * float(np.mean([abs(errors[key]) for key in MAPE_METRICS]))
    return {"relative_error": errors, "mape": mape}


def repeat_of(levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The machine's own drift, where two level entries ran the same load
    (rate, users and requests: a calibration run and the level named at
    its load): each compared metric measured the second time relative to
    the first (``None``: no load ran twice). A simulator
    error below it is within what the machine repeats."""

    def load(level: dict[str, Any]) -> tuple[Any, ...]:
        return (level["request_rate"], level["max_concurrency"], level["num_requests"])

    for index, first in enumerate(levels):
        for again in levels[index + 1 :]:
            if load(again) == load(first):
                return {
                    "levels": [first["level"], again["level"]],
                    "difference": compare(first["measured"], again["measured"])[
                        "relative_error"
                    ],
                }
    return None


def profile_note(
    repetitions: int | None, speed_x: Sequence[float] | None = None
) -> str:
    """How many times the profile timed each shape, and how far the
    machine's speed moved while it did (its slowest and fastest moment
    over its median), where known."""
    text = (
        ""
        if repetitions is None
        else f"; the profile timed each shape {repetitions} times"
    )
    if speed_x:
        slowest, fastest = speed_x
        text += (
            f"; the machine's speed moved {fastest:.2f}-{slowest:.2f}x its "
            "median while it profiled (the samples scaled to the median)"
        )
    return text


def _sizing_line(sizing: dict[str, Any]) -> str:
    """How the levels' request count was come by: sized to the time
    budget, or given with one (``GivenCount``)."""
    if sizing.get("given"):
        return (
            f"{sizing['requests_per_level']} requests a level, as given, to end "
            f"within its time budget ({round(sizing['budget_s'] / 60, 2):g} min)"
        )
    return (
        f"{sizing['requests_per_level']} requests a level, sized to the time "
        f"budget ({sizing['budget_s'] / 60:g} min): {sizing['spent_s']:.0f} s "
        f"before the levels, about {sizing['predicted_levels_s']:.0f} s predicted "
        "for them"
        + profile_note(sizing.get("profile_repetitions"), sizing.get("profile_speed_x"))
    )


def format_report(report: dict[str, Any]) -> str:
    """The capacity (with load fractions), then per level: each metric
    measured, simulated, error; then ``mape``."""
    lines = _header_lines(report)
    for level in report["levels"]:
        lines += _level_lines(level)
    if report.get("verdict"):
        lines += _verdict_lines(report["verdict"], report.get("capacity"))
    return "\n".join(lines)


def _verdict_lines(
    verdict: dict[str, Any], capacity: dict[str, Any] | None
) -> list[str]:
    """``judge``'s verdict: the targets, then the capacity and each judged
    level, met or what it missed."""
    if "capacity_met" not in verdict and not verdict["levels"]:
        return []
    lines = [f"targets: {verdict['targets']}"]
    if capacity and "capacity_met" in verdict:
        met = "met" if verdict["capacity_met"] else "missed"
        lines.append(f"  capacity: {met} ({100 * capacity['relative_error']:+.1f}%)")
    for level in verdict["levels"]:
        misses = [_miss_text(miss) for miss in level["missed"]]
        lines.append(
            f"  {level['level']}: "
            + ("missed " + "; ".join(misses) if misses else "met")
        )
    means = verdict.get("means_met")
    if means:
        lines.append(
            f"  every mean met at {means['levels']} of {means['of']} levels "
            f"(target: {means['needed']} at least): "
            + ("met" if means["met"] else "missed")
        )
    speed = verdict.get("decode_speed")
    if speed:
        lines.append(_decode_speed_line(speed))
    return lines


def _decode_speed_line(speed: dict[str, Any]) -> str:
    """``decode_speed_by_level``'s figures, in one line."""
    rows = speed["levels"]
    ratios = " / ".join(f"{row['served_x']:.2f}" for row in rows)
    text = (
        f"  the server's decode steps ran {ratios}x the profile, level by level "
        f"({speed['moved_x']:.2f}x apart)"
    )
    own = [row["own_steps_mape"] for row in rows]
    if all(mape is not None for mape in own):
        mapes = " / ".join(f"{mape:.1f}" for mape in own)
        text += f"; at each level's own steps' costs, mape {mapes}%"
    return text


def _miss_text(miss: dict[str, Any]) -> str:
    """``p99_ttft_ms -21.2% (target 20%, outside the measured p99's interval)``."""
    error, target = 100 * miss["error"], 100 * miss["target"]
    text = f"{miss['metric']} {error:+.1f}% (target {target:g}%"
    within = miss.get("within_interval")
    if within is not None:
        text += f", {'within' if within else 'outside'} the measured p99's interval"
    spread = miss.get("within_spread")
    if spread is not None:
        text += (
            f"; measured {'within' if spread else 'outside'} the simulated "
            f"spread at step costs ±{100 * STEP_COST_CHANGE:g}%"
        )
    largest = miss.get("largest_request")
    if largest is not None:
        text += "; " + _largest_request_text(largest)
    return text + ")"


def _largest_request_text(largest: dict[str, Any]) -> str:
    """``request 17 (212 + 22 tokens) carries +20.3 points of it, 461 ms
    simulated against 38 measured; +3.9% without it, within the target``."""
    name = _request_name(
        largest["request"], largest["prompt_tokens"], largest["output_tokens"]
    )
    text = (
        f"{name} carries {100 * largest['carried']:+.1f} points of it, "
        f"{largest['simulated_ms']:.0f} ms simulated against "
        f"{largest['measured_ms']:.0f} measured"
    )
    without = largest["error_without"]
    if without is not None:
        beyond = "within" if largest["met_without"] else "still beyond"
        text += f"; {100 * without:+.1f}% without it, {beyond} the target"
    return text


def _header_lines(report: dict[str, Any]) -> list[str]:
    """What ``report`` says before its levels: the machine, the split, the
    sizing, the capacity, the decode plane, the calibration, the repeated load."""
    lines = []
    machine = report.get("machine")
    if machine:
        lines.append(
            f"measured on {machine['processor']} ({machine['cores']} cores, torch's "
            f"{machine['cpu_capability']} CPU kernels), vLLM {machine['vllm_version']}"
        )
    split = report.get("disaggregated")
    if split:
        prefill, decode = split["prefill_engine"], split["decode_engine"]
        lines.append(
            f"disaggregated {split['sizes']}: prefill neuron_config "
            f"{prefill['neuron_config']}, decode {decode['neuron_config']}; "
            f"{split['transfer_model']}"
        )
    sizing = report.get("sizing")
    if sizing:
        lines.append(_sizing_line(sizing))
        after = sizing.get("after_capacity")
        if after and after["requests_per_level"] < after["sample"]:
            lines.append(
                f"at the measured capacity, the first {after['requests_per_level']} "
                f"of the {after['sample']} a level, to end within the budget "
                f"(about {after['predicted_levels_s']:.0f} s of the "
                f"{after['left_s']:.0f} s left)"
            )
    capacity = report.get("capacity")
    if capacity:
        lines.append(_capacity_line(capacity))
    plane = report.get("decode_plane")
    if plane:
        lines.append(_plane_line(plane))
    calibration = report.get("calibration")
    if calibration:
        # One fit, or one a role (validate --disaggregated).
        roles = [role for role in ("prefill", "decode") if role in calibration]
        fits = {f"{role} ": calibration[role] for role in roles} or {"": calibration}
        for role, fit in fits.items():
            lines.append(_calibration_line(role, calibration["level"], fit))
    repeat = report.get("repeat")
    if repeat:
        first, again = repeat["levels"]
        lines.append(
            f"the same load measured twice ({first}, then {again}): "
            + _means(repeat["difference"])
            + " (the machine's own drift)"
        )
    return lines


def _level_lines(level: dict[str, Any]) -> list[str]:
    """One level: what completed and its ``mape`` (with the other fits'),
    its refit and its steps against the profile, then each metric."""
    measured, simulated = level["measured"], level["simulated"]
    lines = [
        f"== {level['level']}: {measured['completed']} completed, "
        f"{measured['failed']} failed (simulated {simulated['completed']} / "
        f"{simulated['failed']}); mape {level['mape']:.1f}%"
        + _as_profiled(level)
        + _on_the_first_level(level)
    ]
    refit = level.get("refit_on_the_others")
    if refit:
        lines.append(_calibration_line("", "the other levels' steps", refit))
    served = _served_line(level)
    if served:
        lines.append(served)
    lines += one_sided_failures(level)
    spread = level.get("step_cost_spread")
    spread_head = ""
    if spread:
        heading = f"simulated at step costs ±{100 * spread['change']:g}%"
        spread_head = f"{heading:>30}"
    lines.append(
        f"{'metric':<24}{'measured':>12}{'simulated':>12}{'error':>9}{spread_head}"
        f"  measured p99's {100 * INTERVAL_CONFIDENCE:g}% interval (sampling only)"
    )
    for key in COMPARED:
        error = level["relative_error"][key]
        lines.append(
            f"{key:<24}{measured[key]:>12.2f}{simulated[key]:>12.2f}"
            f"{100 * error:>8.1f}%" + _spread(key, spread) + _interval(key, level)
        )
    return lines


def _served_line(level: dict[str, Any]) -> str:
    """The level's served steps against the profile it was simulated with
    (one fit, or one a role of a disaggregated pair) and its mape at those
    steps' own costs ("": no fit)."""
    served = level.get("served_vs_profiled", {})
    roles = [role for role in ("prefill", "decode") if role in served]
    fits = {"": served} if "decode_steps" in served else {
        f"{role} engine's ": served[role] for role in roles
    }  # fmt: skip
    if not any("decode_steps" in fit for fit in fits.values()):
        return ""
    parts = []
    for role, fit in fits.items():
        if "error" in fit:
            parts.append(f"{role}none fitted ({fit['error']})")
            continue
        # An engine of a pair runs one kind of step, or nearly: its kinds
        # with busy steps (the colocated engine's: both, as always).
        kinds = [(kind, kind_fit) for kind, kind_fit in step_fits(fit)
                 if kind_fit["steps"] or not role]  # fmt: skip
        ratios = ", ".join(
            f"{kind} {kind_fit['median_ratio']:.3f}x ({kind_fit['steps']} busy steps)"
            for kind, kind_fit in kinds
        )
        parts.append(f"{role}{ratios}")
    line = "server steps, median of served / profiled: " + "; ".join(parts)
    own = level.get("own_steps")
    if own:
        line += f"; simulated at these steps' own costs: mape {own['mape']:.1f}%"
    return line


def _spread(key: str, spread: dict[str, Any] | None) -> str:
    """``  240.10 to 262.80`` right-aligned under its heading ("": none)."""
    if spread is None:
        return ""
    return f"{spread['low'][key]:>18.2f} to {spread['high'][key]:<8.2f}"


def _interval(key: str, level: dict[str, Any]) -> str:
    """``  250.10 to 1203.40: simulated within`` for a p99 row whose
    measured interval the report has (older reports have none), else ""."""
    interval = _measured_interval(key, level) if key in P99_METRICS else None
    if interval is None:
        return ""
    low, high = interval
    upper = "unbounded" if high is None else f"{high:.2f}"
    within = "within" if _within(key, level) else "outside"
    return f"  {low:.2f} to {upper}: simulated {within}"


def _capacity_line(capacity: dict[str, Any]) -> str:
    """``report["capacity"]`` as a line."""
    line = (
        f"capacity: measured {capacity['measured_req_s']:.3f} req/s, simulated "
        f"{capacity['simulated_req_s']:.3f} req/s, error "
        f"{100 * capacity['relative_error']:.1f}%"
    )
    before = capacity.get("as_profiled")
    if before:
        line += (
            f" (as profiled: {before['simulated_req_s']:.3f} req/s, error "
            f"{100 * before['relative_error']:.1f}%)"
        )
    return f"{line} ({capacity['rule']})"


def _plane_line(plane: dict[str, Any]) -> str:
    """``report["decode_plane"]`` as a line."""
    if "kept_as_measured" in plane:
        return f"decode shapes kept as measured: {plane['kept_as_measured']}"
    return (
        f"decode shapes on one plane: {plane['intercept_ms']:.2f} ms + "
        f"{plane['per_row_ms']:.3f} ms a row + {plane['per_row_token_us']:.3f} us "
        f"a row per token of context ({plane['shapes']} shapes; the largest move "
        f"{100 * plane['largest_move']:.0f}%)"
    )


def _means(relative: dict[str, float]) -> str:
    """``TTFT +1.0%, TPOT …`` for the means of ``MAPE_METRICS``."""
    return ", ".join(
        f"{key.removeprefix('mean_').removesuffix('_ms').upper()} "
        f"{100 * relative[key]:+.1f}%"
        for key in MAPE_METRICS
    )


def _as_profiled(level: dict[str, Any]) -> str:
    """`` (as profiled: mape …)`` for a level also simulated with the
    profile as measured (before the plane and calibration), else ""."""
    before = level.get("as_profiled")
    if not before:
        return ""
    means = _means(before["relative_error"])
    return f" (as profiled: mape {before['mape']:.1f}%; {means})"


def _on_the_first_level(level: dict[str, Any]) -> str:
    """`` (with the first level's fit: mape …)`` for a level simulated with
    it before its refit on the other levels, else ""."""
    before = level.get("on_the_first_level")
    if not before:
        return ""
    return f" (with the first level's fit: mape {before['mape']:.1f}%)"


def step_fits(calibration: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A calibration's step fits (``prefill_steps``, ``decode_steps``),
    named ``prefill`` and ``decode``."""
    return [
        ("prefill", calibration["prefill_steps"]),
        ("decode", calibration["decode_steps"]),
    ]


def _calibration_line(role: str, level: str, calibration: dict[str, Any]) -> str:
    """One calibration of ``report["calibration"]`` as a line (``role``: ""
    or "prefill " / "decode ", an engine of a disaggregated pair)."""
    if "error" in calibration:
        return f"{role}not calibrated: {calibration['error']}"
    fits = []
    for kind, fit in step_fits(calibration):
        if fit["method"] == "kept":
            fits.append(f"{kind} steps as profiled ({fit['steps']} busy steps)")
            continue
        text = (
            f"{kind} steps served = {fit['scale']:.3f} x profiled + "
            f"{1e3 * fit['overhead_s']:.2f} ms ({fit['steps']} steps)"
        )
        if fit["method"] == "ratio":
            text += (
                f", the median ratio: their line (slope {fit['line_slope']:.3f}) "
                "is lost in their noise"
            )
        fits.append(text + _jitter_text(fit.get("jitter", ())))
    return f"calibrated {role}on {level}: " + "; ".join(fits)


def _jitter_text(quantiles: Sequence[float]) -> str:
    """How a kind's served steps varied about their window's speed, as
    charged step by step (empty: not measured)."""
    if not quantiles:
        return ""
    jitter = StepJitter(tuple(quantiles))
    p10, p90, p99 = (jitter.quantile(share) for share in (0.1, 0.9, 0.99))
    return (
        f", each step x {p10:.2f}-{p90:.2f} (p10-p90; p99 {p99:.2f}) of its "
        f"{WINDOW_S:g}-s window's speed"
    )
