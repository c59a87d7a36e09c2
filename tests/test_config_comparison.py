"""``validate --config``: configs side by side on the real server."""

import json
import time
from dataclasses import replace

import pytest

from helpers import TINY_ENGINE_ARGV
from neuron_scheduler.cli import main
from neuron_scheduler.sim.config_comparison import (
    SERVER_START_S,
    covers,
    format_comparison,
    ranking,
    serving_order,
    serving_shares,
    step_speed_spread,
)
from neuron_scheduler.sim.validation import ValidateOptions
from neuron_scheduler.sim.validation_plan import LevelsCost
from neuron_scheduler.sim.workload import WorkloadOptions
from test_validate import (
    _matching_profile,
    _servers_running,
    _small_engine,
    _spec_and_identity,
)


def _report(label, measured, simulated, capacity=False):
    level = {
        "level": "x",
        "measured": {"output_throughput": measured, "request_goodput": measured / 10},
        "simulated": {"output_throughput": simulated, "request_goodput": simulated / 9},
    }
    other = {**level, "level": "other", "measured": {}, "simulated": {}}
    report = {"label": label, "levels": [level, other] if capacity else [other, level]}
    if capacity:
        report["capacity"] = {}
    return report


def test_ranking_gives_each_sides_ratio_to_the_first_and_both_orders():
    reports = [
        _report("a", 100.0, 110.0, capacity=True),
        _report("b", 200.0, 198.0, capacity=True),
        _report("c", 150.0, 250.0, capacity=True),
    ]
    result = ranking(reports)
    a, b, c = result["configs"]
    assert (b["measured_ratio"], b["simulated_ratio"]) == pytest.approx((2.0, 1.8))
    assert b["ratio_error"] == pytest.approx(1.8 / 2.0 - 1)
    assert a["ratio_error"] == pytest.approx(0.0)
    assert b["measured_goodput"] == pytest.approx(20.0)
    assert result["measured_order"] == ["b", "c", "a"]
    assert result["simulated_order"] == ["c", "b", "a"]
    assert result["same_order"] is False


def _simulated_as_profiled(report, throughput):
    """``report``'s compared level also simulated with the profile as
    measured, at ``throughput``."""
    level = report["levels"][0]
    level["as_profiled"] = {"simulated": {"output_throughput": throughput}}
    return report


def test_ranking_gives_the_profile_as_measured_where_every_config_has_it():
    a = _simulated_as_profiled(_report("a", 100.0, 110.0, capacity=True), 100.0)
    b = _simulated_as_profiled(_report("b", 200.0, 198.0, capacity=True), 250.0)
    c = _simulated_as_profiled(_report("c", 150.0, 250.0, capacity=True), 120.0)
    result = ranking([a, b, c])
    row_b, row_c = result["configs"][1:]
    assert row_b["as_profiled_ratio"] == pytest.approx(2.5)
    assert row_b["as_profiled_ratio_error"] == pytest.approx(2.5 / 2.0 - 1)
    assert row_c["as_profiled_ratio"] == pytest.approx(1.2)
    assert result["as_profiled_order"] == ["b", "c", "a"] == result["measured_order"]
    assert result["as_profiled_same_order"] is True
    assert result["same_order"] is False  # what the levels simulated with
    text = format_comparison({"configs": [], "comparison": result})
    assert "simulated with the profile as measured: ratios b 2.500 (+25.0%)" in text
    assert "same order: yes" in text and "same order: NO" in text
    # One config without it: nothing as measured is reported.
    result = ranking([a, b, _report("c", 150.0, 250.0, capacity=True)])
    assert "as_profiled_order" not in result
    assert "as_profiled_ratio" not in result["configs"][0]
    text = format_comparison({"configs": [], "comparison": result})
    assert "profile as measured" not in text


def test_over_rounds_each_side_is_the_median_and_the_rounds_order_is_counted():
    a = _report("a", 100.0, 110.0, capacity=True)
    a["repeats"] = [_report("a", 130.0, 110.0, capacity=True)]
    b = _report("b", 120.0, 120.0, capacity=True)
    b["repeats"] = [_report("b", 126.0, 120.0, capacity=True)]
    result = ranking([a, b])
    row_a, row_b = result["configs"]
    assert row_a["measured_by_round"] == [100.0, 130.0]
    assert row_a["measured_output_throughput"] == pytest.approx(115.0)
    assert row_b["measured_ratio"] == pytest.approx(123.0 / 115.0)
    assert row_a["measured_goodput"] == pytest.approx(11.5)
    # b was ahead in round 1, behind in round 2: one round agrees.
    assert result["measured_order"] == ["b", "a"] == result["simulated_order"]
    assert (result["rounds"], result["rounds_in_measured_order"]) == (2, 1)


def _rounds(label, measured_by_round, simulated):
    report = _report(label, measured_by_round[0], simulated, capacity=True)
    report["repeats"] = [
        _report(label, m, simulated, capacity=True) for m in measured_by_round[1:]
    ]
    return report


def test_rounds_tell_apart_only_configs_further_apart_than_their_spread():
    # The Intel Xeon's comparison: combined and reserve 0.9% apart, further
    # than either moved between its rounds; a and b moved more than that.
    result = ranking(
        [
            _rounds("defaults", [122.5, 123.5], 130.1),
            _rounds("reserve", [136.7, 137.7], 144.2),
            _rounds("combined", [138.5, 138.3], 144.7),
            _rounds("a", [131.5, 142.4], 129.0),
            _rounds("b", [135.2, 141.5], 146.0),
        ]
    )
    assert result["measured_apart"] == [
        ["reserve", "defaults"],
        ["combined", "defaults"],
        ["a", "defaults"],
        ["b", "defaults"],
        ["combined", "reserve"],
    ]
    assert result["measured_ties"] == [
        ["reserve", "a"], ["reserve", "b"], ["combined", "a"], ["combined", "b"],
        ["a", "b"],
    ]  # fmt: skip
    # a is simulated below defaults, which every round put it above.
    assert result["simulated_agrees_where_apart"] == 4


def test_rounds_that_do_not_overlap_are_still_a_tie_within_the_spread():
    # The five-config split: x's rounds 5.1 apart, its median 3.5 above y's.
    result = ranking(
        [_rounds("x", [136.8, 141.9], 143.8), _rounds("y", [135.2, 136.7], 144.0)]
    )
    assert result["measured_apart"] == []
    assert result["measured_ties"] == [["x", "y"]]
    assert result["simulated_agrees_where_apart"] == 0


def _served_at(report, speeds):
    """``report``'s rounds' steps ran ``speeds`` (one ``(prefill, decode)``
    served / profiled a round) against the profile."""
    for level_report, (prefill, decode) in zip(
        (report, *report["repeats"]), speeds, strict=True
    ):
        level_report["levels"][0]["served_vs_profiled"] = {
            "prefill_steps": {"median_ratio": prefill},
            "decode_steps": {"median_ratio": decode},
        }
    return report


def _comparison_text(result):
    """The comparison's printed lines for ``ranking``'s ``result``."""
    comparison = {**result, "serving_order": [[]] * result["rounds"]}
    return format_comparison({"configs": [], "comparison": comparison})


def test_a_pair_within_what_the_step_speed_moved_is_a_tie():
    # 6 December, model-207 Xeon: combined's two servings, one after the
    # other (the last of round 1, the first of round 2), both fell in one
    # slow stretch of the machine; their rounds agree, yet reserve's 12%
    # lead is within how far the steps' speed moved between the servings.
    reserve = _rounds("reserve", [90.5, 90.2], 108.7)
    combined = _rounds("combined", [81.1, 80.4], 111.9)
    tuned = _rounds("tuned-buckets", [85.0, 86.8], 102.4)
    # Without step logs, the rounds alone judge: reserve > combined.
    assert ranking([reserve, combined])["measured_apart"] == [["reserve", "combined"]]
    _served_at(reserve, [(1.237, 1.136), (1.307, 1.157)])
    _served_at(combined, [(1.481, 1.332), (1.510, 1.304)])
    _served_at(tuned, [(1.222, 1.149), (1.241, 1.143)])
    result = ranking([reserve, combined, tuned])
    assert result["configs"][1]["step_speed_by_round"] == [
        {"prefill": 1.481, "decode": 1.332},
        {"prefill": 1.510, "decode": 1.304},
    ]
    assert ["reserve", "combined"] in result["measured_ties"]
    assert result["measured_apart"] == []  # reserve vs tuned: prefill moved 7%
    assert result["step_speed_spread"] == pytest.approx(1.510 / 1.222)
    # Servings at one speed: the same 5% gap is told apart.
    _served_at(tuned, [(1.25, 1.15), (1.26, 1.15)])
    _served_at(reserve, [(1.25, 1.15), (1.26, 1.14)])
    result = ranking([reserve, tuned])
    assert result["measured_apart"] == [["reserve", "tuned-buckets"]]
    text = _comparison_text(result)
    assert "prefill steps 1.25-1.26x the profile; decode steps 1.14-1.15x" in text


def test_each_ratio_error_is_set_beside_how_far_the_step_speed_moved():
    # The same night: combined's ratio to defaults was simulated 13.8% high
    # while their servings' prefill steps ran 1.06-1.51x the profile.
    defaults = _rounds("defaults", [89.9, 72.4], 98.8)
    combined = _rounds("combined", [81.1, 80.4], 111.9)
    text = _comparison_text(ranking([defaults, combined]))
    assert "step speed moved over the servings" not in text
    _served_at(defaults, [(1.064, 1.043), (1.486, 1.318)])
    _served_at(combined, [(1.481, 1.332), (1.510, 1.304)])
    result = ranking([defaults, combined])
    row = result["configs"][1]
    assert row["ratio_error"] == pytest.approx(0.138, abs=0.001)
    assert row["step_speed_spread_to_first"] == pytest.approx(1.510 / 1.064)
    assert "combined +13.8% (1.42x); errors beyond it: none" in _comparison_text(result)
    # Every serving at one speed: the same error is the simulator's.
    _served_at(defaults, [(1.20, 1.10), (1.21, 1.11)])
    _served_at(combined, [(1.21, 1.10), (1.22, 1.11)])
    text = _comparison_text(ranking([defaults, combined]))
    assert "combined +13.8% (1.02x); errors beyond it: combined" in text


def test_step_speed_spread_takes_the_kinds_every_serving_measured():
    one = {"step_speed_by_round": [{"prefill": 1.0, "decode": 1.1}]}
    other = {"step_speed_by_round": [{"decode": 0.9}]}
    assert step_speed_spread(one, other) == pytest.approx(1.1 / 0.9)
    assert step_speed_spread(one) == pytest.approx(1.0)
    assert step_speed_spread({"step_speed_by_round": [{}]}, one) is None
    assert step_speed_spread({"label": "no step log"}) is None


def test_one_round_judges_no_pair_and_says_why():
    result = ranking(
        [
            _report("x", 100.0, 101.0, capacity=True),
            _report("y", 102.0, 99.0, capacity=True),
        ]
    )
    assert "measured_apart" not in result
    text = format_comparison({"configs": [], "comparison": result})
    assert "--rounds 2 or more" in text


def test_every_other_round_serves_the_configs_in_reverse():
    assert serving_order(["a", "b", "c"], 3) == [
        ["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]
    ]  # fmt: skip
    assert serving_order(["a", "b"], 1) == [["a", "b"]]


def test_rounds_serve_each_config_again_in_reverse_on_a_fresh_server(
    tmp_path, monkeypatch, capsys
):
    # The orchestration alone: each validation (server, levels) is the real
    # one in the slow test below; here it records what it was asked to run.
    from neuron_scheduler.sim import config_comparison

    spec, identity = _spec_and_identity(tmp_path)
    served = []

    def validate_with_profile(options, profile, identity, log_name, started):
        served.append((options.engine.neuron_config.get("kv_admission"), log_name))
        level = {"level": "x", "measured": {"output_throughput": 10.0 * len(served),
                 "request_goodput": 1.0}, "simulated": {"output_throughput": 5.0,
                 "request_goodput": 1.0}}  # fmt: skip
        return {"levels": [level], "engine": {}}

    monkeypatch.setattr(
        config_comparison, "validate_with_profile", validate_with_profile
    )
    monkeypatch.setattr(
        config_comparison, "measure_profile",
        lambda spec, path, progress, fit_seconds: _matching_profile(spec, identity),
    )  # fmt: skip
    monkeypatch.setattr(
        "neuron_scheduler.offline.profiler.model_identity", lambda model: identity
    )
    options = ValidateOptions(engine=spec, workload=WorkloadOptions(num_requests=4))
    configs = [("a", {}), ("b", {"kv_admission": "reserve"})]
    report = config_comparison.compare_configs(options, configs, rounds=3)
    assert "sizing" not in report["comparison"]  # the requests were counted
    assert served == [
        (None, "server-a-round1.log"), ("reserve", "server-b-round1.log"),
        ("reserve", "server-b-round2.log"), (None, "server-a-round2.log"),
        (None, "server-a-round3.log"), ("reserve", "server-b-round3.log"),
    ]  # fmt: skip
    a, b = report["configs"]
    assert len(a["repeats"]) == len(b["repeats"]) == 2
    rows = report["comparison"]["configs"]
    assert rows[0]["measured_by_round"] == [10.0, 40.0, 50.0]
    assert rows[1]["measured_by_round"] == [20.0, 30.0, 60.0]
    assert rows[1]["measured_output_throughput"] == 30.0
    assert report["comparison"]["rounds_in_measured_order"] == 1  # round 2 only
    monkeypatch.setattr(config_comparison, "format_report", lambda report: "")
    text = config_comparison.format_comparison(report)
    assert "== config b (round 3)" in text
    assert "held in 1 of 3 rounds (served: a b | b a | a b)" in text


def test_a_time_budget_is_split_over_the_servings_and_the_first_sizes_them_all(
    tmp_path, monkeypatch, capsys
):
    # The orchestration alone, as above: the first serving is given its
    # share of what the profile left (and sizes its levels to it, as the
    # real validate_with_profile does: tests/test_validate.py); every later
    # one sends the first's requests a level, within its config's share.
    from neuron_scheduler.sim import config_comparison

    spec, identity = _spec_and_identity(tmp_path)
    asked = []

    def validate_with_profile(options, profile, identity, log_name, started):
        asked.append((options.time_budget_s, options.workload.num_requests))
        level = {"level": "x", "measured": {"output_throughput": 1.0,
                 "request_goodput": 1.0}, "simulated": {"output_throughput": 1.0,
                 "request_goodput": 1.0}}  # fmt: skip
        report = {"levels": [level], "engine": {}}
        if options.time_budget_s is not None:
            report["sizing"] = {"requests_per_level": 17}
        return report

    monkeypatch.setattr(
        config_comparison, "validate_with_profile", validate_with_profile
    )
    profile_shares = []

    def measure_profile(spec, path, progress, fit_seconds):
        profile_shares.append(fit_seconds)
        return _matching_profile(spec, identity)

    monkeypatch.setattr(config_comparison, "measure_profile", measure_profile)
    monkeypatch.setattr(
        "neuron_scheduler.offline.profiler.model_identity", lambda model: identity
    )
    # b's levels simulate twice as long a request as a's.
    costs = {None: LevelsCost(2.0, 40.0), "reserve": LevelsCost(4.0, 40.0)}

    def predicted_levels(run, profile):
        return costs[run.engine.neuron_config.get("kv_admission")]

    monkeypatch.setattr(config_comparison, "predicted_levels", predicted_levels)
    options = ValidateOptions(
        engine=spec, workload=WorkloadOptions(), time_budget_s=1200.0
    )
    configs = [("a", {}), ("b", {"kv_admission": "reserve"})]
    report = config_comparison.compare_configs(options, configs, rounds=2)
    assert profile_shares == [0.3 * 1200.0]  # the profile's share, as validate's
    (share, first_count), *later = asked
    # 4 servings: a's share is its part of what the four are predicted to take.
    expected = serving_shares(1200.0, ["a", "b", "b", "a"], {"a": costs[None],
                              "b": costs["reserve"]})  # fmt: skip
    assert first_count is None
    assert expected["a"] * (1 - 5 / 1200) < share <= expected["a"] < 1200 / 4
    # Later servings: the first's count, each within its config's share.
    shares = report["comparison"]["sizing"]["shares_s"]
    assert [count for _, count in later] == [17] * 3
    assert [budget for budget, _ in later] == pytest.approx(
        [shares["b"], shares["b"], shares["a"]], abs=0.05
    )
    sizing = report["comparison"]["sizing"]
    assert (sizing["servings"], sizing["requests_per_level"]) == (4, 17)
    assert sizing["shares_s"]["b"] > sizing["shares_s"]["a"] == round(share, 1)
    assert "4 servings" in capsys.readouterr().err
    monkeypatch.setattr(config_comparison, "format_report", lambda report: "")
    text = config_comparison.format_comparison(report)
    assert "sized to --time-budget 20 min: 17 requests a level in each of 4" in text
    assert f"a {share / 60:.1f}, b {sizing['shares_s']['b'] / 60:.1f}" in text


def test_servings_share_the_time_by_their_levels_as_simulated():
    costs = {"a": LevelsCost(2.0, 40.0), "b": LevelsCost(4.0, 40.0)}
    served = ["a", "b", "b", "a"]
    shares = serving_shares(1200.0, served, costs)
    assert sum(shares[label] for label in served) == pytest.approx(1200.0)
    # At the count the four fit together (the server starts beside them):
    count = LevelsCost(12.0, 160.0).fitting_count(1200.0 - 4 * SERVER_START_S)
    a, b = (costs[x].at(count) + SERVER_START_S for x in "ab")
    assert shares["b"] / shares["a"] == pytest.approx(b / a)
    # Alike configs share alike: the even split.
    alike = serving_shares(1200.0, served, {"a": costs["a"], "b": costs["a"]})
    assert alike == pytest.approx({"a": 300.0, "b": 300.0})
    # Nothing left: nothing to share.
    assert serving_shares(0.0, served, costs) == {"a": 0.0, "b": 0.0}


def test_a_profile_past_the_budget_says_so_and_leaves_the_servings_nothing(capsys):
    from neuron_scheduler.sim.config_comparison import _ServingBudget

    options = ValidateOptions(
        engine=_small_engine("m"), workload=WorkloadOptions(), time_budget_s=60.0
    )
    costs = {"a": LevelsCost(2.0, 40.0), "b": LevelsCost(2.0, 40.0)}
    budget = _ServingBudget.of(options, time.monotonic() - 90.0, [["a", "b"]], costs)
    assert budget.share_s == 0.0
    err = capsys.readouterr().err
    assert "the profile ran 0.5 min past it for 2 servings" in err
    assert "left" not in err


def test_without_a_capacity_run_the_last_level_is_compared():
    result = ranking([_report("a", 1.0, 1.0), _report("b", 3.0, 2.0)])
    assert result["configs"][1]["measured_ratio"] == pytest.approx(3.0)
    assert result["same_order"] is True


def test_a_profile_serves_a_config_whose_shapes_it_covers(tmp_path):
    spec, identity = _spec_and_identity(tmp_path)
    profile = _matching_profile(spec, identity)
    assert covers(profile, spec, identity)
    fewer = replace(spec, neuron_config={"num_seqs_buckets": [2, 4]})
    assert covers(profile, fewer, identity)  # a subset of its batch buckets
    other = replace(spec, neuron_config={"num_batched_tokens_buckets": [100, 256]})
    assert not covers(profile, other, identity)
    assert not covers(profile, replace(spec, max_num_seqs=8), identity)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--config", "a={}"], "two or more distinct labels"),
        (["--config", "a={}", "--config", "a={}"], "two or more distinct labels"),
        (
            ["--config", "a={}", "--config", 'b={"num_seqs_buckets": [3]}'],
            "num_seqs_buckets",
        ),
        (
            ["--config", "a={}", "--config", "b={}",
             "--neuron-config", '{"max_prefills_per_batch": 2}'],
            "each --config is a whole neuron_config",
        ),
        (["--rounds", "2"], "--rounds 2 repeats the configs of --config"),
        (["--config", "a={}", "--config", "b={}", "--rounds", "0"], "--rounds"),
    ],
)  # fmt: skip
def test_bad_config_lists_are_refused_before_anything_starts(
    argv, fragment, tmp_path, capsys
):
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", "--model", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timing
def test_two_configs_side_by_side_share_a_profile(tiny_model_dir, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    code = main(
        [
            "validate", "--model", str(tiny_model_dir),
            *TINY_ENGINE_ARGV,
            "--num-requests", "8", "--max-concurrency", "4",
            "--random-input-len", "100", "--random-output-len", "12",
            "--config", "defaults={}",
            "--config", 'fewer-batches={"num_seqs_buckets": [2, 4]}',
            "--json", str(report_path), "--log-dir", str(tmp_path), "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(report_path.read_text())
    first, second = report["configs"]
    assert (first["label"], second["label"]) == ("defaults", "fewer-batches")
    # One profile, measured first, of both configs' buckets.
    assert first["profile"] == second["profile"] == "measured for every config"
    assert second["engine"]["neuron_config"] == {"num_seqs_buckets": [2, 4]}
    assert (tmp_path / "server-defaults.log").exists()
    assert (tmp_path / "server-fewer-batches.log").exists()
    rows = report["comparison"]["configs"]
    for row, config in zip(rows, (first, second), strict=True):
        level = config["levels"][-1]
        assert (
            row["measured_output_throughput"] == level["measured"]["output_throughput"]
        )
        assert level["measured"]["completed"] == level["simulated"]["completed"] == 8
        assert config["repeats"] == []
    assert rows[1]["measured_ratio"] == pytest.approx(
        rows[1]["measured_output_throughput"] / rows[0]["measured_output_throughput"]
    )
    output = capsys.readouterr().out
    assert "configs side by side" in output and "same order:" in output
    assert _servers_running(str(tiny_model_dir)) == []


def test_one_profile_of_the_union_of_the_buckets_covers_every_config(tmp_path):
    from neuron_scheduler.sim.config_comparison import union_spec

    spec, identity = _spec_and_identity(tmp_path)
    specs = [
        replace(spec, neuron_config={"num_batched_tokens_buckets": [100, 256]}),
        replace(
            spec, neuron_config={"num_seqs_buckets": [3, 4], "kv_admission": "reserve"}
        ),
    ]
    union = union_spec(specs)
    assert union.neuron_config == {
        "num_batched_tokens_buckets": [100, 128, 256],
        "num_seqs_buckets": [1, 2, 3, 4],
        "decode_context_length_buckets": [512],
    }
    assert replace(union, neuron_config={}) == replace(spec, neuron_config={})
