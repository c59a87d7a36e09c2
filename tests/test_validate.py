"""``neuron-scheduler validate``: its parts, its refusals, and one real run."""

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from helpers import TINY_ENGINE_ARGV, still_alive_after
from neuron_scheduler.cli import build_parser, main
from neuron_scheduler.cli.validate import validate_options
from neuron_scheduler.offline.cpu_binding import process_tree
from neuron_scheduler.offline.engine_spec import (
    EngineSpec,
    profile_command,
    server_args,
)
from neuron_scheduler.offline.profiler import cpu_capability, model_identity
from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim import validation
from neuron_scheduler.sim.calibration import Calibration, FitMethod, StepFit, calibrated
from neuron_scheduler.sim.decode_plane import fit_plane, on_plane
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.validation import (
    ValidateError,
    ValidateOptions,
    check_options,
    check_profile_matches,
    measure_profile,
    profile_share,
)
from neuron_scheduler.sim.validation_metrics import (
    COMPARED,
    INTERVAL_CONFIDENCE,
    MAPE_METRICS,
    PERCENTILES,
    STEP_COST_CHANGE,
    Targets,
    compare,
    format_report,
    interval_key,
    judge,
    measured_metrics,
    p99_interval,
    steady_rate,
    step_cost_spread,
)
from neuron_scheduler.sim.validation_plan import (
    DEFAULT_LOAD_FRACTIONS,
    DEFAULT_TIME_BUDGET_S,
    FEWEST_REQUESTS,
    HEADROOM,
    LEVEL_OVERHEAD_S,
    MOST_REQUESTS,
    PROFILE_SHARE,
    Level,
    Sizing,
    level_requests,
    levels_of,
    simulate_level,
    size_levels,
)
from neuron_scheduler.sim.workload import WorkloadOptions, build_workload
from test_cost_profile import synthetic_profile


def _options(*argv: str) -> ValidateOptions:
    args = build_parser(["validate"]).parse_args(["validate", *argv])
    return validate_options(args)


def test_by_default_loads_are_shares_of_capacity_sized_to_ten_minutes():
    default = _options("--model", "m")
    assert default.load_fractions == list(DEFAULT_LOAD_FRACTIONS) == [0.5, 0.8, 0.95]
    assert default.calibrate is True  # on the capacity run
    assert default.time_budget_s == DEFAULT_TIME_BUDGET_S == 600
    assert default.workload.num_requests is None  # sized once the profile is in
    assert _options("--model", "m", "--no-calibrate").calibrate is False
    fixed = _options("--model", "m", "--num-requests", "30")
    assert (fixed.time_budget_s, fixed.workload.num_requests) == (None, 30)
    assert _options("--model", "m", "--time-budget", "2.5").time_budget_s == 150
    # Named levels replace the fractions; calibration stays off unless asked.
    rated = _options("--model", "m", "--request-rate", "1", "2")
    assert (rated.load_fractions, rated.request_rates) == (None, [1.0, 2.0])
    assert rated.calibrate is False and rated.time_budget_s == 600
    # Several configs or a pair keep fixed loads and 100 requests a level.
    pair = _options("--model", "m", "--disaggregated", "1P1D")
    assert (pair.load_fractions, pair.time_budget_s) == (None, None)
    assert pair.workload.num_requests == MOST_REQUESTS == 100
    configs = ("--config", "a={}", "--config", "b={}")
    assert _options("--model", "m", *configs).workload.num_requests == 100
    # A budget given to a comparison is the whole comparison's, sized later.
    compared = _options("--model", "m", *configs, "--time-budget", "30")
    assert (compared.time_budget_s, compared.workload.num_requests) == (1800, None)
    assert profile_share(compared) == PROFILE_SHARE * 1800
    # At shares of each config's capacity too: each serving cuts its own
    # levels to its share (config_comparison).
    at_capacity = _options(
        "--model", "m", *configs, "--time-budget", "30", "--load-fractions", "0.5,0.9"
    )
    assert (at_capacity.time_budget_s, at_capacity.load_fractions) == (1800, [0.5, 0.9])
    assert levels_of(None, None) == [Level(0.5), Level(1.0), Level(math.inf, 8)]
    # Decode shapes as measured unless put on their plane (a pair's too).
    assert default.decode_plane is False and pair.decode_plane is False
    assert _options("--model", "m", "--decode-plane").decode_plane is True
    on_plane = _options("--model", "m", "--disaggregated", "1P1D", "--decode-plane")
    assert on_plane.decode_plane is True
    assert levels_of([2.0], [3]) == [Level(2.0), Level(math.inf, 3)]


def test_the_profile_may_fill_a_share_of_the_time_budget():
    default = _options("--model", "m")
    assert profile_share(default) == PROFILE_SHARE * 600 == 180
    assert profile_share(_options("--model", "m", "--time-budget", "20")) == 360
    # A fixed request count, or several configs: no budget, every repetition.
    assert profile_share(_options("--model", "m", "--num-requests", "30")) is None
    assert profile_share(_options("--model", "m", "--disaggregated", "1P1D")) is None
    # The child process is told the share.
    command = profile_command(default.engine, Path("p.json"), progress=False,
                              fit_seconds=180.0)  # fmt: skip
    assert command[command.index("--fit-seconds") + 1] == "180"
    assert "--fit-seconds" not in profile_command(default.engine, Path("p.json"),
                                                  progress=False)  # fmt: skip
    assert Level(math.inf, 3).label == "concurrency 3"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--time-budget", "0"], "--time-budget: must be a number of minutes > 0"),
        (["--time-budget", "x"], "got 'x'"),
        (["--time-budget", "5", "--num-requests", "10"], "one or the other"),
        (
            ["--time-budget", "5", "--disaggregated", "1P1D"],
            "--time-budget 5 sizes colocated levels; with --disaggregated give",
        ),
    ],
)
def test_options_that_cannot_apply_together_are_refused(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", "--model", "m", *argv])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_a_workload_that_fails_whole_is_not_sized_by_zero():
    # Every prompt longer than max_model_len: nothing runs, nothing to time.
    workload = WorkloadOptions(random_input_len=600, random_output_len=4)
    sizing = size_levels(
        _small_engine("m"), synthetic_profile(), workload, [], [0.5], 600.0,
        time.monotonic(),
    )  # fmt: skip
    assert sizing.requests_per_level == MOST_REQUESTS


def test_the_report_says_how_the_levels_were_sized():
    sizing = _sized(synthetic_profile(), budget_s=1.0)
    text = format_report({"levels": [], "sizing": sizing.report()})
    assert text.startswith(
        f"{FEWEST_REQUESTS} requests a level, sized to the time budget "
        "(0.0166667 min): 0 s before the levels, about"
    )
    assert "timed each shape" not in text  # the profile does not say
    # A profile fitted to its share of the budget says how many times.
    fitted = replace(synthetic_profile(), meta={"repetitions": 3})
    sizing = _sized(fitted, budget_s=1.0)
    assert sizing.describe().endswith(
        "past the budget); the profile timed each shape 3 times"
    )
    text = format_report({"levels": [], "sizing": sizing.report()})
    assert "predicted for them; the profile timed each shape 3 times" in text
    assert "speed moved" not in text  # the profile does not say
    # One that timed the machine's speed between its blocks says how far it
    # moved while it profiled.
    drift = {"slowest_x": 1.2345, "fastest_x": 0.8765}
    timed = replace(synthetic_profile(), meta={"repetitions": 5, "drift": drift})
    sizing = _sized(timed, budget_s=1.0)
    moved = "the machine's speed moved 0.88-1.23x its median while it profiled"
    assert moved in sizing.describe()
    assert moved in format_report({"levels": [], "sizing": sizing.report()})


def _sized(profile, budget_s: float, spent_s: float = 0.0):
    spec = _small_engine("m")
    workload = WorkloadOptions(random_input_len=200, random_output_len=40, seed=1)
    started = time.monotonic() - spent_s
    return size_levels(spec, profile, workload, [], [0.5, 0.8, 0.95], budget_s, started)


def _slower(profile, factor: float):
    timings = tuple(
        replace(t, samples_s=tuple(factor * x for x in t.samples_s))
        for t in profile.timings
    )
    return replace(profile, timings=timings)


def test_levels_get_as_many_requests_as_the_budget_leaves_room_for():
    profile = synthetic_profile()
    roomy = _sized(profile, budget_s=1e6)
    assert roomy.requests_per_level == MOST_REQUESTS
    # The prediction is linear in the count: size for a third of that time.
    per_request = (roomy.predicted_s - 4 * LEVEL_OVERHEAD_S) / MOST_REQUESTS
    budget = (4 * LEVEL_OVERHEAD_S + 50 * per_request) / HEADROOM
    half = _sized(profile, budget_s=budget)
    assert 45 <= half.requests_per_level <= 50
    assert half.spent_s + half.predicted_s <= budget
    # Time already spent (the profile, the server's start) counts.
    later = _sized(profile, budget_s=budget, spent_s=0.3 * budget)
    assert FEWEST_REQUESTS <= later.requests_per_level < half.requests_per_level
    # A machine whose steps take three times as long gets fewer requests.
    slow = _sized(_slower(profile, 3.0), budget_s=budget)
    assert slow.requests_per_level < half.requests_per_level
    assert slow.predicted_s == pytest.approx(half.predicted_s, rel=0.25)
    # Never fewer than FEWEST_REQUESTS, and the description says it overruns.
    tight = _sized(profile, budget_s=1.0)
    assert tight.requests_per_level == FEWEST_REQUESTS
    assert "past the budget" in tight.describe()
    assert "past the budget" not in half.describe()
    # A comparison's share of its budget is no round number of minutes.
    share = Sizing(40, budget_s=202.709, spent_s=30.0, predicted_s=100.0)
    assert "of the --time-budget's 3.38 min" in share.describe()


def test_only_levels_sized_to_the_budget_keep_to_its_end():
    from neuron_scheduler.sim.validation import _sized as sized_options
    from neuron_scheduler.sim.validation_plan import MOST_REQUESTS

    profile = synthetic_profile()
    options = replace(
        _options("--model", "m", "--random-input-len", "200",
                 "--random-output-len", "40", "--seed", "1"),
        engine=_small_engine("m"),
    )  # fmt: skip
    report: dict = {}
    sized, deadline = sized_options(options, profile, report, 100.0)
    assert deadline == 100.0 + options.time_budget_s
    assert sized.workload.num_requests == report["sizing"]["requests_per_level"]
    # A count named, or no budget: no deadline, and nothing said of sizing.
    counted = replace(options, workload=replace(options.workload, num_requests=30))
    for unsized, count in (
        (replace(counted, time_budget_s=None), 30),
        (replace(options, time_budget_s=None), MOST_REQUESTS),
    ):
        report = {}
        sized, deadline = sized_options(unsized, profile, report, 100.0)
        assert deadline is None and "sizing" not in report
        assert sized.workload.num_requests == count
    # A count given with a budget (a comparison's later serving): that count,
    # by the budget's end, and the report says it was given.
    report = {}
    sized, deadline = sized_options(replace(counted, time_budget_s=200.0), profile,
                                    report, 100.0)  # fmt: skip
    assert (sized.workload.num_requests, deadline) == (30, 300.0)
    assert report["sizing"] == {
        "requests_per_level": 30,
        "budget_s": 200.0,
        "given": True,
    }
    text = format_report({"levels": [], "sizing": report["sizing"]})
    assert text.startswith("30 requests a level, as given, to end within its time "
                           "budget (3.33 min)")  # fmt: skip
    cut = {**report["sizing"], "after_capacity": {"requests_per_level": 20,
           "sample": 30, "predicted_levels_s": 150.0, "left_s": 160.0}}  # fmt: skip
    assert "the first 20 of the 30 a level" in format_report(
        {"levels": [], "sizing": cut}
    )


def test_measured_metrics_use_the_simulators_definitions():
    # Two requests served, one failed: vLLM's benchmark client's per-request
    # lists (seconds).
    result = {
        "errors": ["", "", "timeout"],
        "ttfts": [0.1, 0.3, 0.0],
        "latencies": [1.1, 0.7, 0.0],
        "output_lens": [11, 5, 0],
        "itls": [[0.1] * 10, [0.1] * 4, []],
        "duration": 2.0,
    }
    metrics = measured_metrics(result)
    assert (metrics["completed"], metrics["failed"]) == (2, 1)
    assert metrics["output_throughput"] == pytest.approx(16 / 2.0)
    assert metrics["mean_ttft_ms"] == pytest.approx(200.0)
    assert metrics["mean_tpot_ms"] == pytest.approx(100.0)  # (1.1-0.1)/10, (0.7-0.3)/4
    assert metrics["mean_e2el_ms"] == pytest.approx(900.0)
    # Tails as the simulator reports them (numpy's linear interpolation).
    assert metrics["p90_ttft_ms"] == pytest.approx(100 + 0.9 * 200)
    assert metrics["p90_e2el_ms"] == pytest.approx(1100 - 0.1 * 400)
    assert metrics["p90_itl_ms"] == pytest.approx(100.0)
    # Two TTFTs bound their p99 from below only: both are below it 98% of
    # the time, so the larger bounds it.
    assert metrics[interval_key("ttft")] == [300.0, None]
    assert json.loads(json.dumps(metrics)) == metrics  # the report's --json


def test_the_measured_p99s_interval_holds_it_as_often_as_it_says():
    # Exponential values: the true p99 is ln(100). Over many samples of each
    # size the interval holds it at least 95% of the time, and it narrows.
    rng = np.random.default_rng(7)
    true_p99 = math.log(100)
    widths = []
    for n in (400, 4000):
        intervals = [p99_interval(rng.exponential(size=n)) for _ in range(400)]
        held = [low <= true_p99 <= high for low, high in intervals]
        assert sum(held) / len(held) >= INTERVAL_CONFIDENCE - 0.02
        widths.append(np.median([high - low for low, high in intervals]))
    assert widths[1] < widths[0] / 2


def test_too_few_values_bound_the_p99_only_from_below():
    values = np.arange(1.0, 368.0)  # 367: below the p99 2.5% of the time
    low, high = p99_interval(values)
    assert high is None and low < values[-1]
    low, high = p99_interval(np.arange(1.0, 369.0))
    assert high == 368.0  # the largest, now it bounds it
    with pytest.raises(ValueError, match="no values"):
        p99_interval(np.array([]))


def test_a_p99_row_says_whether_the_simulated_one_is_within_the_measured_interval():
    measured = {key: 100.0 for key in COMPARED}
    measured["completed"] = measured["failed"] = 0
    measured[interval_key("itl")] = [80.0, 150.0]
    measured[interval_key("ttft")] = [90.0, None]
    simulated = dict(measured, p99_itl_ms=60.0, p99_ttft_ms=400.0)
    level = {"level": "50%", "measured": measured, "simulated": simulated}
    level.update(compare(measured, simulated))
    rows = {
        line.split()[0]: line
        for line in format_report({"levels": [level]}).splitlines()
    }
    assert rows["p99_itl_ms"].endswith("80.00 to 150.00: simulated outside")
    assert rows["p99_ttft_ms"].endswith("90.00 to unbounded: simulated within")
    assert rows["mean_itl_ms"].endswith("0.0%")  # only p99 rows have one


def _judged_level(label, fraction, errors, interval=None):
    """A level entry whose simulated figures are ``errors`` off 100."""
    measured = {key: 100.0 for key in COMPARED}
    measured.update(completed=10, failed=0)
    if interval is not None:
        measured[interval_key("ttft")] = interval
    simulated = dict(measured)
    for key, error in errors.items():
        simulated[key] = 100.0 * (1 + error)
    level = {"level": label, "load_fraction": fraction}
    level.update(measured=measured, simulated=simulated, **compare(measured, simulated))
    return level


def test_each_share_of_capacity_is_held_to_its_targets_and_the_capacity_to_its_own():
    levels = [
        _judged_level("capacity (all at once)", None, {"mean_ttft_ms": 0.5}),
        _judged_level(
            "50%",
            0.5,
            {"mean_ttft_ms": 0.12, "median_ttft_ms": 0.5, "mean_itl_ms": 0.5},
        ),
        _judged_level(
            "95%", 0.95, {"mean_ttft_ms": 0.12, "p99_ttft_ms": -0.3}, [90.0, None]
        ),
        _judged_level("concurrency 8", None, {"mean_tpot_ms": 0.9}),
    ]
    capacity = {"measured_req_s": 1.0, "simulated_req_s": 0.89, "rule": "at once"}
    report = {"levels": levels, "capacity": dict(capacity, relative_error=-0.11)}
    verdict = judge(report)
    assert verdict["capacity_met"] is False
    # The capacity run and the closed loop have no share of capacity to judge.
    judged = {level["level"]: level["missed"] for level in verdict["levels"]}
    assert set(judged) == {"50%", "95%"}
    # 12% misses 10% at half load; near saturation the means get 15%; a
    # median and the mean ITL are reported but have no target.
    assert [(m["metric"], m["target"]) for m in judged["50%"]] == [
        ("mean_ttft_ms", 0.1)
    ]
    (p99,) = judged["95%"]
    assert (p99["metric"], p99["target"], p99["within_interval"]) == (
        "p99_ttft_ms",
        0.2,
        False,  # 70 is below the measured p99's lower bound, 90
    )
    report["verdict"] = verdict
    text = format_report(report).splitlines()
    assert "  capacity: missed (-11.0%)" in text
    assert "  50%: missed mean_ttft_ms +12.0% (target 10%)" in text
    assert (
        "  95%: missed p99_ttft_ms -30.0% (target 20%, outside the measured p99's "
        "interval)" in text
    )
    assert judge(report, Targets(mean=0.15, p99=0.35, capacity=0.2)) == {
        "targets": Targets(mean=0.15, p99=0.35, capacity=0.2).describe(),
        "capacity_met": True,
        "levels": [{"level": "50%", "missed": []}, {"level": "95%", "missed": []}],
    }


def test_a_miss_says_whether_the_measured_figure_lies_in_the_step_cost_spread():
    level = _judged_level(
        "80%", 0.8, {"mean_tpot_ms": -0.12, "mean_e2el_ms": -0.2, "p99_e2el_ms": 0.3}
    )
    cheaper = dict(level["simulated"])
    dearer = dict(level["simulated"], mean_tpot_ms=101.0, mean_e2el_ms=95.0)
    level["step_cost_spread"] = step_cost_spread(level["simulated"], cheaper, dearer)
    spread = level["step_cost_spread"]
    assert spread["change"] == STEP_COST_CHANGE
    # Each metric's least and most of the three, whichever run gave them.
    assert (spread["low"]["mean_tpot_ms"], spread["high"]["mean_tpot_ms"]) == (
        pytest.approx(88.0),
        101.0,
    )
    assert (spread["low"]["mean_e2el_ms"], spread["high"]["mean_e2el_ms"]) == (
        pytest.approx(80.0),
        95.0,
    )
    report = {"levels": [level]}
    (judged,) = judge(report)["levels"]
    within = {miss["metric"]: miss["within_spread"] for miss in judged["missed"]}
    # 100 measured: within 88-101, beyond 80-95, beyond 130-130.
    assert within == {"mean_tpot_ms": True, "mean_e2el_ms": False, "p99_e2el_ms": False}
    report["verdict"] = judge(report)
    text = format_report(report)
    assert (
        "mean_tpot_ms -12.0% (target 10%; measured within the simulated spread at "
        f"step costs ±{100 * STEP_COST_CHANGE:g}%)" in text
    )
    row = next(line for line in text.splitlines() if line.startswith("mean_e2el_ms"))
    assert row.split()[-3:] == ["80.00", "to", "95.00"]
    # A level without one (older reports): no column, no word of it.
    del level["step_cost_spread"]
    assert "step costs" not in format_report({"levels": [level]})


def _twelve_at_once():
    """Options of ``_small_engine``, ``synthetic_profile``, twelve random
    requests sent at once, and their run simulated with that profile."""
    options = _options("--model", "m", "--random-input-len", "100",
                       "--random-output-len", "12")  # fmt: skip
    options = replace(options, engine=_small_engine("m"))
    profile = synthetic_profile()
    specs, _ = build_workload(
        replace(options.workload, num_requests=12, request_rate=math.inf),
        options.engine.max_model_len,
    )
    run, _ = simulate_level(options.engine, profile, specs, None)
    return options, profile, specs, run


def test_the_step_cost_spread_simulates_every_step_cheaper_and_dearer():
    from neuron_scheduler.sim.validation import LevelRun, _add_step_cost_spread

    # Sent at once: the schedule does not depend on the clock, so every
    # latency moves with the step costs exactly.
    options, profile, specs, run = _twelve_at_once()
    simulated = compute_metrics(run, options.goodput, percentiles=(90.0,))
    entry = {"simulated": simulated, "max_concurrency": None}
    _add_step_cost_spread(options, LevelRun(entry, specs, [], [], profile=profile))
    spread = entry["step_cost_spread"]
    for key in ("mean_ttft_ms", "mean_e2el_ms", "p99_itl_ms"):
        assert spread["low"][key] == pytest.approx(
            (1 - STEP_COST_CHANGE) * simulated[key]
        )
        assert spread["high"][key] == pytest.approx(
            (1 + STEP_COST_CHANGE) * simulated[key]
        )
    # No profile to move (a level simulated elsewhere): none.
    bare: dict = {"simulated": simulated, "max_concurrency": None}
    _add_step_cost_spread(options, LevelRun(bare, specs, [], []))
    assert "step_cost_spread" not in bare


@pytest.mark.parametrize(
    "source",
    [{}, {"random_input_len": 300, "random_output_len": 80, "random_range_ratio": 0.5}],
)
def test_the_capacity_run_and_every_level_replay_the_same_requests(source):
    workload = WorkloadOptions(num_requests=30, seed=3, **source)
    at_once, _ = level_requests(workload, math.inf, 4096)
    at_rates = [level_requests(workload, rate, 4096)[0] for rate in (0.2, 0.5)]

    def lengths(specs):
        return [(s.input_len, s.output_len, s.rejected) for s in specs]

    assert all(s.arrival_s == 0.0 for s in at_once)
    for at_rate in at_rates:
        assert lengths(at_rate) == lengths(at_once)
        assert at_rate[-1].arrival_s > 0
    # What it guards against: the built-in workload drawn with no arrival
    # gaps to draw draws other lengths.
    if not source:
        drawn, _ = build_workload(replace(workload, request_rate=math.inf), 4096)
        assert lengths(drawn) != lengths(at_once)


def test_compare_gives_relative_errors_and_mape_over_the_three_means():
    measured = {key: 100.0 for key in COMPARED}
    simulated = dict(measured, mean_ttft_ms=110.0, mean_tpot_ms=80.0, p99_itl_ms=300.0)
    comparison = compare(measured, simulated)
    assert comparison["relative_error"]["mean_ttft_ms"] == pytest.approx(0.10)
    assert comparison["relative_error"]["p99_itl_ms"] == pytest.approx(2.0)
    # p99 ITL is reported, not averaged: (10 + 20 + 0) / 3.
    assert comparison["mape"] == pytest.approx(10.0)


def _small_engine(model: str) -> EngineSpec:
    """The engine of ``synthetic_profile``'s shapes."""
    return EngineSpec(
        model=model,
        max_model_len=512,
        max_num_batched_tokens=256,
        max_num_seqs=4,
        kv_cache_memory_bytes=64 << 20,
    )


def _spec_and_identity(tmp_path: Path) -> tuple[EngineSpec, dict]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64}))
    return _small_engine(str(model)), model_identity(str(model))


def _matching_profile(spec: EngineSpec, identity: dict):
    config = spec.resolved_config()
    return replace(
        synthetic_profile(),
        model=identity,
        engine={
            "max_model_len": spec.max_model_len,
            "max_num_batched_tokens": spec.max_num_batched_tokens,
            "max_num_seqs": spec.max_num_seqs,
            "kv_cache_memory_bytes": spec.kv_cache_memory_bytes,
            "dtype": spec.dtype,
            "enforce_eager": spec.enforce_eager,
        },
        neuron_config={
            "num_batched_tokens_buckets": list(config.num_batched_tokens_buckets),
            "num_seqs_buckets": list(config.num_seqs_buckets),
            "decode_context_length_buckets": list(config.decode_context_length_buckets),
        },
    )


def test_a_cpu_profile_of_other_kernels_is_refused_naming_both(tmp_path):
    spec, identity = _spec_and_identity(tmp_path)
    profile = _matching_profile(spec, identity)
    here = cpu_capability()
    same = replace(
        profile, platform={"name": "cpu", "processor": "P", "cpu_capability": here}
    )
    check_profile_matches(same, spec, identity)
    check_profile_matches(profile, spec, identity)  # kernels not recorded
    elsewhere = replace(
        profile,
        platform={"name": "cpu", "processor": "Q", "cpu_capability": f"NOT{here}"},
    )
    with pytest.raises(
        ValidateError,
        match=f"ran torch's NOT{here} CPU kernels \\(on Q\\); this machine runs {here}",
    ):
        check_profile_matches(elsewhere, spec, identity)


def test_the_avx2_only_script_loads_the_avx2_kernels_of_torch_and_vllm():
    """scripts/avx2-only/sitecustomize.py: what validate's profile records,
    and the build of vLLM's CPU kernels its platform loads."""
    probe = (
        "import re\n"
        "from neuron_scheduler.offline.profiler import cpu_capability\n"
        "from vllm.platforms.cpu import CpuPlatform\n"
        "CpuPlatform.import_kernels()\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(cpu_capability(), sorted(set(re.findall(r'vllm/(_C\\w*)\\.abi3', maps))))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("CPU_ISA")}
    env.pop("ATEN_CPU_CAPABILITY", None)
    env["PYTHONPATH"] = str(
        Path(__file__).resolve().parents[1] / "scripts" / "avx2-only"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split(None, 1) == ["AVX2", "['_C_AVX2']\n"]


def test_a_profile_of_another_model_or_engine_is_refused_naming_the_difference(
    tmp_path,
):
    spec, identity = _spec_and_identity(tmp_path)
    profile = _matching_profile(spec, identity)
    check_profile_matches(profile, spec, identity)  # the same: accepted

    other_model = replace(profile, model={**identity, "config_sha256": "0" * 16})
    with pytest.raises(ValidateError, match="measured on model"):
        check_profile_matches(other_model, spec, identity)
    other_engine = replace(profile, engine={**profile.engine, "max_num_seqs": 8})
    with pytest.raises(ValidateError, match="max_num_seqs = 8"):
        check_profile_matches(other_engine, spec, identity)
    other_buckets = replace(
        profile,
        neuron_config={**profile.neuron_config, "num_seqs_buckets": [4]},
    )
    with pytest.raises(ValidateError, match="num_seqs_buckets"):
        check_profile_matches(other_buckets, spec, identity)


def test_a_server_runs_every_bucket_shape_once_before_it_serves():
    def neuron_config(spec: EngineSpec) -> dict:
        args = server_args(spec)
        return json.loads(args[args.index("--additional-config") + 1])["neuron_config"]

    spec = EngineSpec(model="m", neuron_config={"num_seqs_buckets": [2, 4]})
    assert neuron_config(spec) == {"num_seqs_buckets": [2, 4], "compile_buckets": True}
    # What the user set is kept; the profile's engine is not touched.
    off = replace(spec, neuron_config={"compile_buckets": False})
    assert neuron_config(off) == {"compile_buckets": False}
    assert "compile_buckets" not in spec.neuron_config


def _servers_running(model: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in command and model in command:
            pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize("exit_code", [0, 1])
def test_a_profile_not_asked_to_be_kept_leaves_no_file(
    exit_code, tmp_path, monkeypatch
):
    # The child process is the profile command; here it writes the
    # profile it was given (or fails), as `neuron-scheduler profile` does.
    written = synthetic_profile()

    def child(command, **popen):
        if exit_code == 0:
            written.save(command[command.index("--output") + 1])
        return exit_code

    monkeypatch.setattr(validation, "run_in_group", child)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spec = _small_engine(str(tmp_path / "model"))
    if exit_code == 0:
        assert measure_profile(spec, None, progress=False) == written
        assert list(tmp_path.iterdir()) == []
        kept = tmp_path / "kept.json"
        assert measure_profile(spec, str(kept), progress=False) == written
        assert list(tmp_path.iterdir()) == [kept]
    else:
        with pytest.raises(ValidateError, match="profiling failed \\(exit 1\\)"):
            measure_profile(spec, None, progress=False)
        assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_server_that_fails_to_start_reports_its_log_and_leaves_nothing(
    tmp_path, capsys
):
    # A model directory with a config but no weights: the profile is given,
    # so the server is the first to load it, and fails.
    spec, identity = _spec_and_identity(tmp_path)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 512,
    }
    (Path(spec.model) / "config.json").write_text(json.dumps(config))
    profile = _matching_profile(spec, model_identity(spec.model))
    profile_path = tmp_path / "profile.json"
    profile.save(profile_path)
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "validate", "--model", spec.model, "--cost-profile", str(profile_path),
                *TINY_ENGINE_ARGV,
                "--num-requests", "2", "--log-dir", str(tmp_path),
            ]
        )  # fmt: skip
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "the vLLM server exited" in error and "its log ends" in error
    assert _servers_running(spec.model) == []


@pytest.mark.slow
@pytest.mark.timing
def test_validate_end_to_end_on_a_few_requests(tiny_model_dir, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    code = main(
        [
            "validate", "--model", str(tiny_model_dir),
            *TINY_ENGINE_ARGV,
            "--num-requests", "12", "--load-fractions", "0.8",
            "--max-concurrency", "2", "--calibrate", "--decode-plane",
            "--random-input-len", "100", "--random-output-len", "12",
            "--save-profile", str(tmp_path / "profile.json"),
            "--json", str(report_path), "--log-dir", str(tmp_path), "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(report_path.read_text())
    output = capsys.readouterr().out
    # The capacity run first, then 80% of the capacity it measured, then
    # the closed loop.
    capacity = report["capacity"]
    assert capacity["measured_req_s"] > 0 and capacity["simulated_req_s"] > 0
    error = (capacity["simulated_req_s"] - capacity["measured_req_s"]) / capacity[
        "measured_req_s"
    ]
    assert capacity["relative_error"] == pytest.approx(error)
    assert f"capacity: measured {capacity['measured_req_s']:.3f} req/s" in output
    first, rated, closed = report["levels"]
    assert first["level"] == "capacity (all at once)"
    assert rated["load_fraction"] == 0.8
    assert rated["request_rate"] == pytest.approx(0.8 * capacity["measured_req_s"])
    assert closed["max_concurrency"] == 2
    for level in report["levels"]:
        measured, simulated = level["measured"], level["simulated"]
        assert measured["completed"] == simulated["completed"] == 12
        for key in COMPARED:
            if key == "request_goodput":  # none may meet the SLOs: 0 counts
                assert measured[key] >= 0 and simulated[key] >= 0
                continue
            assert measured[key] > 0 and simulated[key] > 0
            error = (simulated[key] - measured[key]) / measured[key]
            assert level["relative_error"][key] == pytest.approx(error)
        mape = 100 * sum(abs(level["relative_error"][k]) for k in MAPE_METRICS) / 3
        assert level["mape"] == pytest.approx(mape)
        assert f"mape {mape:.1f}%" in output
        spread = level["step_cost_spread"]
        for key in COMPARED:
            assert spread["low"][key] <= simulated[key] <= spread["high"][key]
        # Each request on both sides, those the means are of (the
        # simulated ones those of the simulation reported: the last refit).
        requests = level["requests"]
        assert requests["client_errors"] == [None] * 12  # none failed
        for side, figures in (("measured", measured), ("simulated", simulated)):
            assert len(requests[side]) == 12
            for name in ("ttft", "tpot", "e2el"):
                values = [each[name] for each in requests[side]]
                assert np.mean(values) == pytest.approx(figures[f"mean_{name}_ms"])
        # 12 x 11 ITLs (< 368) bound their p99 from below only, by one of
        # the largest few.
        low, high = measured[interval_key("itl")]
        assert high is None and measured["p90_itl_ms"] <= low <= measured["p99_itl_ms"]
    assert "interval" in output and "to unbounded: simulated" in output
    assert f"simulated at step costs ±{100 * STEP_COST_CHANGE:g}%" in output
    # Held to the targets: the capacity, and the one level at a share of it.
    verdict = report["verdict"]
    assert [level["level"] for level in verdict["levels"]] == [rated["level"]]
    assert verdict["capacity_met"] == (abs(capacity["relative_error"]) <= 0.10)
    assert f"targets: {verdict['targets']}" in output
    # Where it was measured, named first.
    machine = report["machine"]
    assert machine["cpu_capability"] == cpu_capability()
    assert machine["cores"] == len(os.sched_getaffinity(0))
    assert (
        f"measured on {machine['processor']} ({machine['cores']} cores, torch's "
        f"{cpu_capability()} CPU kernels), vLLM {machine['vllm_version']}\n"
    ) in output
    assert os.path.exists(tmp_path / "profile.json")
    # The serving path (API server, engine core, client) off the worker's core.
    if len(os.sched_getaffinity(0)) > 1:
        cores = set(report["serving_path_cores"])
        assert cores and cores < os.sched_getaffinity(0)
    # Calibrated on the capacity run, from the server's own step log; the
    # refitted profile is kept beside the measured one.
    # Decode steps (dozens) are fitted; 12 prompts make too few prefill
    # steps to fit, so those keep their profiled times.
    calibration = report["calibration"]
    assert calibration["level"] == "capacity (all at once)"
    decode = calibration["decode_steps"]
    assert decode["method"] in ("line", "ratio")
    assert decode["scale"] > 0 and decode["steps"] >= 20
    assert calibration["prefill_steps"]["method"] == "kept"
    assert calibration == {"level": first["level"], **first["served_vs_profiled"]}
    refitted = json.loads((tmp_path / "profile-calibrated.json").read_text())
    assert refitted["meta"]["calibration"]["decode_steps"] == decode
    assert (tmp_path / "steps-server.jsonl").exists()
    assert "calibrated on capacity (all at once): prefill steps as profiled" in output
    assert f"decode steps served = {decode['scale']:.3f} x profiled" in output
    # Once every level has run, each is simulated again with the profile
    # refitted to every other level's served steps (all their busy steps,
    # none of its own); the capacity with it, and as profiled beside it.
    served = [
        level["served_vs_profiled"]["decode_steps"]["steps"]
        for level in report["levels"]
    ]
    for index, level in enumerate(report["levels"]):
        refit = level["refit_on_the_others"]
        assert refit["decode_steps"]["steps"] == sum(served) - served[index]
    for level in (rated, closed):
        before = level["on_the_first_level"]["mape"]
        assert f"(with the first level's fit: mape {before:.1f}%)" in output
        # Its metrics too: those its errors are of, not the refit's.
        first_fit = level["on_the_first_level"]
        measured_ttft = level["measured"]["mean_ttft_ms"]
        assert first_fit["relative_error"]["mean_ttft_ms"] == pytest.approx(
            first_fit["simulated"]["mean_ttft_ms"] / measured_ttft - 1
        )
    assert output.count("calibrated on the other levels' steps: ") == 3
    # Every level's decode speed against one yardstick, the profile before
    # any fit: the capacity run was simulated with it, so its own fit agrees.
    decode_fit = first["served_vs_profiled"]["decode_steps"]
    assert first["decode_speed_x"] == decode_fit["median_ratio"]
    timed = [level for level in report["levels"] if "decode_speed_x" in level]
    speed = report["verdict"]["decode_speed"]
    assert len(timed) >= 2
    assert [row["served_x"] for row in speed["levels"]] == [
        level["decode_speed_x"] for level in timed
    ]
    assert "the server's decode steps ran " in output
    assert capacity["as_profiled"]["simulated_req_s"] != capacity["simulated_req_s"]
    measured_profile = Profile.load(tmp_path / "profile.json")
    modelled = on_plane(measured_profile, fit_plane(measured_profile))
    refit = first["refit_on_the_others"]
    fits = {
        kind: StepFit(**{**refit[kind], "method": FitMethod(refit[kind]["method"])})
        for kind in ("prefill_steps", "decode_steps")
    }
    engine = EngineSpec(**report["engine"])
    workload = _options("--random-input-len", "100", "--random-output-len", "12")
    specs, _ = build_workload(
        replace(workload.workload, num_requests=12, request_rate=math.inf),
        engine.max_model_len,
    )
    refitted_profile = calibrated(modelled, Calibration(**fits))
    run, _ = simulate_level(engine, refitted_profile, specs, None)
    assert steady_rate([r.finish_s for r in run.records]) == pytest.approx(
        capacity["simulated_req_s"]
    )
    # As profiled: the profile as measured, not its decode plane.
    run, _ = simulate_level(engine, measured_profile, specs, None)
    assert steady_rate([r.finish_s for r in run.records]) == pytest.approx(
        capacity["as_profiled"]["simulated_req_s"]
    )
    assert (
        f"(as profiled: {capacity['as_profiled']['simulated_req_s']:.3f} req/s"
        in output
    )
    # Each level is also simulated at its own steps' costs (a diagnostic).
    for level in report["levels"]:
        own = level["own_steps"]
        mape = 100 * sum(abs(own["relative_error"][k]) for k in MAPE_METRICS) / 3
        assert own["mape"] == pytest.approx(mape)
        assert f"simulated at these steps' own costs: mape {mape:.1f}%" in output
    # Simulated with the decode shapes on their plane, recorded in the
    # refitted profile; every level also with the profile as measured.
    plane = report["decode_plane"]
    assert plane["shapes"] >= 4
    assert refitted["meta"]["decode_plane"] == plane
    assert "decode shapes on one plane: " in output
    for level in report["levels"]:
        before = level["as_profiled"]
        assert set(before["relative_error"]) == set(COMPARED)
        mape = 100 * sum(abs(before["relative_error"][k]) for k in MAPE_METRICS) / 3
        assert before["mape"] == pytest.approx(mape)
        assert f"(as profiled: mape {mape:.1f}%;" in output
    assert _servers_running(str(tiny_model_dir)) == []


def test_a_level_whose_others_have_too_few_steps_stays_as_it_was_and_says_why(
    tmp_path,
):
    from neuron_scheduler.sim.validation import LevelRun, _refit_on_the_others

    step_log = tmp_path / "steps.jsonl"
    step_log.write_text("")
    entries = [
        {"level": "capacity (all at once)", "mape": 1.0, "relative_error": {}},
        {"level": "rate 1", "mape": 2.0, "relative_error": {}},
    ]
    runs = [LevelRun(entry, [], [1.0, 2.0], [1.5, 2.5]) for entry in entries]
    options = _options("--model", "m")
    refitted = _refit_on_the_others(
        options, synthetic_profile(), runs, [(0, 0), (0, 0)], step_log
    )
    assert refitted == runs
    for entry in entries:
        assert "0 busy steps" in entry["refit_on_the_others"]["error"]
        assert "as_profiled" not in entry and "on_the_first_level" not in entry


def test_capacity_is_the_completion_rate_between_the_10_and_90_percent_marks():
    # One completion every 0.5 s after a slow start and before a drain.
    times = [5.0] + [5.0 + 0.5 * i for i in range(1, 19)] + [40.0]
    assert steady_rate(times) == pytest.approx(2.0)
    assert steady_rate([1.0, 2.0, 4.0]) == pytest.approx(3 / 4.0)  # < 10: all
    with pytest.raises(ValueError, match="no request completed"):
        steady_rate([])


@pytest.mark.parametrize("text", ["0", "0.5,1.5", "-0.2", "x"])
def test_load_fractions_outside_0_to_1_are_refused_naming_the_value(text, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", "--load-fractions", text])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--load-fractions" in error and repr(text) in error


def test_load_fractions_and_request_rates_are_refused_together(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["validate", "--load-fractions", "0.5", "--request-rate", "1",
             "--model", str(tmp_path)]
        )  # fmt: skip
    assert exit_info.value.code == 2
    assert "set by one or the other" in capsys.readouterr().err


def test_a_missing_log_dir_is_made_before_anything_starts(tmp_path):
    # A --log-dir that did not exist once failed after the profile, at the
    # server's start.
    logs = tmp_path / "new" / "logs"
    check_options(_options("--model", str(tmp_path), "--log-dir", str(logs)))
    assert logs.is_dir()


@pytest.mark.parametrize(
    "extra", [[], ["--config", "a={}", "--config", "b={}"], ["--disaggregated", "1P1D"]]
)
def test_a_log_dir_that_cannot_be_one_is_refused_naming_it(extra, tmp_path, capsys):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("kept")
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["validate", "--model", str(tmp_path), "--log-dir", str(in_the_way), *extra]
        )
    assert exit_info.value.code == 2
    assert (
        f"--log-dir {str(in_the_way)!r} cannot be a directory"
        in capsys.readouterr().err
    )
    assert in_the_way.read_text() == "kept"


def test_a_fraction_level_says_its_share_of_capacity():
    assert Level(1.234, load_fraction=0.8).label == "rate 1.23 (80% of capacity)"
    assert Level(math.inf).label == "capacity (all at once)"


@pytest.mark.parametrize("command", ["validate", "profile"])
@pytest.mark.parametrize(
    ("text", "fragment"),
    [("{", "invalid JSON"), ("[1]", "must be a JSON object, got [1]")],
)
def test_a_bad_neuron_config_is_refused_before_any_engine_starts(
    command, text, fragment, capsys
):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--neuron-config", text])
    assert exit_info.value.code == 2
    assert f"argument --neuron-config: {fragment}" in capsys.readouterr().err


def _descendants(pid: int) -> set[int]:
    """Every living process under ``pid`` (its own groups included)."""
    return set(process_tree(pid)) - {pid}


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("phase", "sig"),
    [("profiling", signal.SIGINT), ("serving", signal.SIGTERM)],
)
def test_validate_stopped_from_outside_leaves_no_process(
    tiny_model_dir, tmp_path, phase, sig
):
    from neuron_scheduler.cli import build_parser
    from neuron_scheduler.cli.validate import validate_options

    argv = [
        "validate", "--model", str(tiny_model_dir),
        *TINY_ENGINE_ARGV,
        "--num-requests", "200", "--request-rate", "1",
        "--log-dir", str(tmp_path), "--no-progress",
    ]  # fmt: skip
    if phase == "serving":  # skip profiling: a profile that matches the engine
        spec = validate_options(build_parser(["validate"]).parse_args(argv)).engine
        profile_path = tmp_path / "profile.json"
        _matching_profile(spec, model_identity(spec.model)).save(profile_path)
        argv += ["--cost-profile", str(profile_path)]
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        tool = subprocess.Popen(
            [sys.executable, "-m", "neuron_scheduler", *argv],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            # SIGINT as a terminal delivers it: a shell starts background
            # jobs with SIGINT ignored, Python then keeps it ignored, and a
            # suite run from such a job would send its SIGINT into nothing.
            preexec_fn=_default_sigint,
        )
    try:
        # The phase has begun once its processes are there: the profiler
        # (a child), or the server and the first level's requests.
        ready = "profiling the engine" if phase == "profiling" else "rate 1: 200"
        deadline = time.monotonic() + 300
        while ready not in stderr_path.read_text() or not _descendants(tool.pid):
            assert tool.poll() is None, stderr_path.read_text()
            assert time.monotonic() < deadline, stderr_path.read_text()
            time.sleep(0.5)
        time.sleep(3)  # let the child start its own children
        started = _descendants(tool.pid)
        tool.send_signal(sig)
        code = tool.wait(timeout=120)
    finally:
        tool.kill()
        # What the tool left running (its server has its own session) is
        # noted for the check below, then stopped by PID: a failed run
        # must not leave it to the tests after this one.
        left_running = _servers_running(str(tiny_model_dir))
        for pid in left_running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    assert code == (130 if sig == signal.SIGINT else 128 + sig)
    message = "stopped by SIGTERM" if sig == signal.SIGTERM else "interrupted"
    assert f"neuron-scheduler validate: {message}" in stderr_path.read_text()
    assert started and still_alive_after(started) == []
    assert left_running == []


def test_a_level_keeps_its_finish_times_as_profiled_simulating_again_only_if_needed(
    monkeypatch, tmp_path
):
    from types import SimpleNamespace

    from neuron_scheduler.sim import validation
    from neuron_scheduler.sim.validation import Level, LevelRun, _capacity, _level

    options, measured, specs, run = _twelve_at_once()
    finish = [r.finish_s for r in run.records if not r.failed]
    served = [f * 1.1 for f in finish]
    metrics = {key: 1.0 for key in COMPARED}

    def replayed(base_url, level, workload, spec, profile, goodput):
        """The server's side stood in: the level simulated with ``profile``."""
        ran, _ = simulate_level(spec, profile, specs, level.max_concurrency)
        simulated = [r.finish_s for r in ran.records if not r.failed]
        return LevelRun({"measured": metrics}, specs, served, simulated)

    monkeypatch.setattr(validation, "_run_level", replayed)
    server = SimpleNamespace(base_url="", step_log=tmp_path / "steps.jsonl")
    # Simulated with the profile as measured: its own finish times, no rerun.
    first = _level(options, server, Level(math.inf), measured, measured)
    assert first.as_profiled_finish_s is first.simulated_finish_s
    assert first.simulated_finish_s == pytest.approx(finish)
    assert "as_profiled" not in first.entry
    # Simulated with another (e.g. the decode plane's): simulated again.
    slower = calibrated(
        measured,
        Calibration(StepFit(2.0, 0.0, 20, 2.0), StepFit(2.0, 0.0, 20, 2.0)),
    )
    ran_slower = _level(options, server, Level(math.inf), slower, measured, measured)
    assert ran_slower.as_profiled_finish_s == pytest.approx(finish)
    assert steady_rate(ran_slower.simulated_finish_s) < steady_rate(finish)
    assert set(ran_slower.entry["as_profiled"]["relative_error"]) == set(COMPARED)
    # Its metrics too (a config comparison ranks on them): the run as measured.
    as_measured = ran_slower.entry["as_profiled"]["simulated"]
    assert as_measured["completed"] == len(finish)
    assert as_measured["duration"] == pytest.approx(max(finish))
    capacity = _capacity(ran_slower, ran_slower.as_profiled_finish_s)
    assert capacity["simulated_req_s"] == steady_rate(ran_slower.simulated_finish_s)
    assert capacity["as_profiled"]["simulated_req_s"] == pytest.approx(
        steady_rate(finish)
    )
    error = (steady_rate(finish) - steady_rate(served)) / steady_rate(served)
    assert capacity["as_profiled"]["relative_error"] == pytest.approx(error)
    assert "as_profiled" not in _capacity(first, None)


def test_a_level_may_send_the_first_requests_of_the_sample():
    workload = WorkloadOptions(num_requests=30, seed=3)
    whole, _ = level_requests(workload, 0.5, 4096)
    first, _ = level_requests(workload, 0.5, 4096, first=12)
    assert first == whole[:12]
    # Drawn as twelve, the built-in workload would draw other ones.
    drawn, _ = level_requests(replace(workload, num_requests=12), 0.5, 4096)
    assert drawn != first
    # The fit counts the requests sent, not the sample's.
    long_prompts = WorkloadOptions(
        num_requests=30, random_input_len=300, random_output_len=80,
        random_range_ratio=0.5, seed=3,
    )  # fmt: skip
    _, whole_fit = level_requests(long_prompts, 0.5, 400)
    sent, first_fit = level_requests(long_prompts, 0.5, 400, first=5)
    assert len(sent) == 5
    assert first_fit.rejected == sum(s.rejected for s in sent) < whole_fit.rejected


def test_the_levels_are_cut_to_the_time_left_never_past_the_sample():
    from neuron_scheduler.sim.validation_plan import fit_to_time_left

    spec, profile = _small_engine("m"), synthetic_profile()
    workload = WorkloadOptions(
        num_requests=60, random_input_len=200, random_output_len=40, seed=1
    )
    levels = [Level(r, load_fraction=f) for f, r in ((0.5, 1.0), (0.95, 1.9))]
    roomy = fit_to_time_left(spec, profile, workload, levels, 1e6)
    assert (roomy.requests_per_level, roomy.sample) == (60, 60)
    assert "60 requests a level" in roomy.describe()
    # Linear in the count: a third of the sample's time left.
    per_request = (roomy.predicted_s - 2 * LEVEL_OVERHEAD_S) / 60
    left = (2 * LEVEL_OVERHEAD_S + 20 * per_request) / HEADROOM
    cut = fit_to_time_left(spec, profile, workload, levels, left)
    assert 18 <= cut.requests_per_level <= 20
    assert cut.predicted_s <= HEADROOM * left
    assert f"the first {cut.requests_per_level} of them a level" in cut.describe()
    assert "past the budget" not in cut.describe()
    # No time left: the fewest, never fewer, and it says so; a sample
    # smaller than that, all.
    past = fit_to_time_left(spec, profile, workload, levels, 0.0)
    assert past.requests_per_level == FEWEST_REQUESTS
    overrun = past.predicted_s
    assert f"{FEWEST_REQUESTS} at the fewest: past the budget by about " in (
        past.describe()
    ) and past.describe().endswith(f"{overrun:.0f} s)")
    small = replace(workload, num_requests=FEWEST_REQUESTS - 4)
    none_left = fit_to_time_left(spec, profile, small, levels, 0.0)
    assert none_left.requests_per_level == FEWEST_REQUESTS - 4


def test_a_trace_holding_fewer_requests_than_asked_is_the_whole_sample(tmp_path):
    from neuron_scheduler.sim.validation_plan import fit_to_time_left

    trace = tmp_path / "lengths.csv"
    trace.write_text(
        "num_prefill_tokens,num_decode_tokens\n" + "200,40\n" * 20, encoding="utf-8"
    )
    workload = WorkloadOptions(trace=str(trace), num_requests=60, seed=1)
    levels = [Level(1.0, load_fraction=0.5)]
    spec, profile = _small_engine("m"), synthetic_profile()
    roomy = fit_to_time_left(spec, profile, workload, levels, 1e6)
    assert (roomy.requests_per_level, roomy.sample) == (20, 20)
    assert fit_to_time_left(spec, profile, workload, levels, 0.0).sample == 20


def test_a_capacity_below_the_simulated_one_cuts_the_levels_to_the_deadline(
    monkeypatch, tmp_path
):
    """The server stood in by the simulator on a profile 1.4x slower: the
    measured capacity, and so the levels' rates, fall below what the
    sizing assumed."""
    from types import SimpleNamespace

    from neuron_scheduler.sim import validation
    from neuron_scheduler.sim.validation import _run_levels

    options = _options(
        "--model", "m", "--random-input-len", "200", "--random-output-len", "40",
        "--load-fractions", "0.5,0.95", "--no-calibrate",
    )  # fmt: skip
    options = replace(
        options,
        engine=_small_engine("m"),
        workload=replace(options.workload, num_requests=40),
    )
    profile = synthetic_profile()
    server_profile = _slower(profile, 1.4)
    sent: list[list] = []

    def replay_level(base_url, level, workload, spec, goodput):
        specs, fit = level_requests(
            workload, level.request_rate, spec.max_model_len, level.first_requests
        )
        sent.append(specs)
        run, _ = simulate_level(spec, server_profile, specs, level.max_concurrency)
        result = {
            "errors": ["" for _ in run.records],
            "ttfts": [r.first_token_s - r.arrival_s for r in run.records],
            "latencies": [r.finish_s - r.arrival_s for r in run.records],
            "output_lens": [r.num_tokens for r in run.records],
        }
        return specs, fit, result, compute_metrics(run, goodput, PERCENTILES)

    monkeypatch.setattr(validation, "replay_level", replay_level)
    server = SimpleNamespace(base_url="", step_log=tmp_path / "steps.jsonl")

    def levels_run(seconds_left: float) -> dict:
        sent.clear()
        sizing = Sizing(40, budget_s=600.0, spent_s=0.0, predicted_s=100.0)
        report = {"levels": [], "sizing": sizing.report()}
        deadline = time.monotonic() + seconds_left
        _run_levels(options, server, profile, report, profile, deadline)
        return report

    roomy = levels_run(1e6)
    assert [level["num_requests"] for level in roomy["levels"]] == [40, 40, 40]
    assert roomy["sizing"]["after_capacity"]["requests_per_level"] == 40
    assert "at the measured capacity" not in format_report(roomy)
    # The capacity measured on the slower server is below the simulated one.
    capacity = roomy["capacity"]
    assert capacity["measured_req_s"] < capacity["simulated_req_s"]
    at_95 = roomy["levels"][2]
    assert at_95["request_rate"] == pytest.approx(0.95 * capacity["measured_req_s"])
    # Time left for a part of it: the levels send the first of the sample.
    tight = levels_run(0.0)
    after = tight["sizing"]["after_capacity"]
    assert after["requests_per_level"] == FEWEST_REQUESTS < after["sample"] == 40
    capacity_run, *levels = sent
    assert len(capacity_run) == 40
    for specs in levels:
        assert len(specs) == FEWEST_REQUESTS
        assert [(s.input_len, s.output_len) for s in specs] == [
            (s.input_len, s.output_len) for s in capacity_run[:FEWEST_REQUESTS]
        ]
        assert specs[-1].arrival_s > 0
    assert [level["num_requests"] for level in tight["levels"]] == [
        40,
        FEWEST_REQUESTS,
        FEWEST_REQUESTS,
    ]
    assert (
        f"at the measured capacity, the first {FEWEST_REQUESTS} of the 40 a level"
        in format_report(tight)
    )


def test_the_verdict_says_how_far_the_decode_speed_moved_between_levels():
    from neuron_scheduler.sim.validation_metrics import decode_speed_by_level

    def level(name, ratio, own_mape):
        return {"level": name, "decode_speed_x": ratio, "own_steps": {"mape": own_mape}}

    levels = [
        level("capacity (all at once)", 0.99, 4.6),
        level("rate 0.186 (50% of capacity)", 1.181, 5.5),
        level("rate 0.297 (80% of capacity)", 1.2, 8.2),
        # Too few decode steps to say: none, and left out.
        {"level": "concurrency 2", "own_steps": {"mape": 1.0}},
    ]
    speed = decode_speed_by_level(levels)
    assert [row["served_x"] for row in speed["levels"]] == [0.99, 1.181, 1.2]
    assert speed["moved_x"] == pytest.approx(1.2 / 0.99)
    judged = [{"level": "rate 0.186 (50% of capacity)", "missed": []}]
    verdict = {"targets": Targets().describe(), "levels": judged}
    text = format_report({"levels": [], "verdict": {**verdict, "decode_speed": speed}})
    assert (
        "  the server's decode steps ran 0.99 / 1.18 / 1.20x the profile, level by "
        "level (1.21x apart); at each level's own steps' costs, mape 4.6 / 5.5 / 8.2%"
    ) in text.splitlines()
    # One level alone says nothing of a move.
    assert decode_speed_by_level(levels[:1]) is None
    assert "decode steps ran" not in format_report({"levels": [], "verdict": verdict})
