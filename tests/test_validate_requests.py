"""``validate``'s requests kept one by one, and the request a missed mean
hangs on (``largest_request``)."""

import json

import numpy as np
import pytest

from neuron_scheduler.sim.calibration import scaled
from neuron_scheduler.sim.results import compute_metrics, latencies_by_request
from neuron_scheduler.sim.validation import LevelRun, _simulated_again
from neuron_scheduler.sim.validation_metrics import (
    client_latencies,
    compare,
    format_report,
    judge,
    largest_request,
    one_sided_failures,
    request_columns,
)
from neuron_scheduler.sim.workload import RequestSpec
from test_validate import _judged_level, _twelve_at_once


def test_the_clients_requests_are_kept_in_the_order_sent():
    # vLLM's benchmark client's per-request lists (seconds); one failed, one
    # with a single output token (no TPOT, as vLLM defines it).
    result = {
        "errors": ["", "timeout", "", ""],
        "ttfts": [0.1, 0.0, 0.3, 0.2],
        "latencies": [1.1, 0.0, 0.7, 0.2],
        "output_lens": [11, 0, 5, 1],
    }
    each = client_latencies(result)
    assert each[1] is None
    assert each[0] == pytest.approx({"ttft": 100.0, "e2el": 1100.0, "tpot": 100.0})
    assert each[2] == pytest.approx({"ttft": 300.0, "e2el": 700.0, "tpot": 100.0})
    assert each[3] == pytest.approx({"ttft": 200.0, "e2el": 200.0})


def test_the_simulated_requests_are_those_its_means_are_of():
    options, _, specs, run = _twelve_at_once()
    metrics = compute_metrics(run, options.goodput)
    each = latencies_by_request(run)
    assert len(each) == len(specs) == 12
    for name in ("ttft", "tpot", "e2el"):
        values = [values[name] for values in each if values and name in values]
        assert np.mean(values) == pytest.approx(metrics[f"mean_{name}_ms"])
    # One never finished: none, and the order of the rest is kept.
    run.records[4].finish_s = -1.0
    again = latencies_by_request(run)
    assert again[4] is None and again[:4] == each[:4] and again[5:] == each[5:]


def test_a_level_simulated_again_keeps_its_requests_in_step():
    options, profile, specs, run = _twelve_at_once()
    simulated = compute_metrics(run, options.goodput, percentiles=(90.0,))
    first = latencies_by_request(run)
    entry = {
        "measured": simulated,
        "max_concurrency": None,
        "requests": request_columns(specs, first, first),
    }
    done = LevelRun(entry, specs, [], [], profile=profile)
    # Sent at once, every latency moves with the step costs exactly.
    _simulated_again(options, scaled(profile, 1.1), done)
    requests = entry["requests"]
    assert requests["measured"] == first
    for before, after in zip(first, requests["simulated"], strict=True):
        assert after["e2el"] == pytest.approx(1.1 * before["e2el"])
    values = [each["ttft"] for each in requests["simulated"]]
    assert np.mean(values) == pytest.approx(entry["simulated"]["mean_ttft_ms"])


def test_requests_sent_measured_and_simulated_must_be_the_same_ones():
    specs = [RequestSpec(0.0, 10, 5)] * 3
    with pytest.raises(ValueError, match="3 requests sent, 2 measured, 3 simulated:"):
        request_columns(specs, [None, None], [None] * 3)
    with pytest.raises(ValueError, match="3 simulated, 4 client errors: they must"):
        request_columns(specs, [None] * 3, [None] * 3, [""] * 4)


def test_a_request_failed_on_one_side_only_is_named_with_the_clients_error():
    specs = [RequestSpec(0.0, 100 + n, 10 + n) for n in range(4)]
    served = {"ttft": 50.0, "e2el": 500.0, "tpot": 50.0}
    # 0 served on both sides, 1 failed on both (over max_model_len), 2
    # failed on the server only, 3 in the simulation only.
    level = _judged_level("80%", 0.8, {})
    level["requests"] = request_columns(
        specs,
        [served, None, None, served],
        [served, None, served, None],
        ["", "Bad Request: too long", "Traceback ...\nClientOSError: reset", ""],
    )
    assert level["requests"]["client_errors"] == [
        None, "Bad Request: too long", "Traceback ...\nClientOSError: reset", None
    ]  # fmt: skip
    assert one_sided_failures(level) == [
        "request 2 (102 + 12 tokens) failed on the server, completed simulated: "
        "ClientOSError: reset",
        "request 3 (103 + 13 tokens) completed on the server, failed simulated",
    ]
    text = format_report({"levels": [level]}).splitlines()
    assert text[1].startswith("request 2 (102 + 12 tokens) failed on the server")
    # A level kept without the client's errors still names them.
    del level["requests"]["client_errors"]
    assert one_sided_failures(level)[0].endswith(
        "failed on the server, completed simulated"
    )
    assert one_sided_failures({"level": "50%"}) == []


def _level_with_requests(measured_tpot, simulated_tpot, errors=None):
    """A 50% level whose requests' TPOTs are those given (``None``: not
    completed on that side), its means and errors theirs."""
    count = len(measured_tpot)
    specs = [RequestSpec(0.0, 100 + n, 10 + n) for n in range(count)]

    def each(tpots):
        return [None if t is None else {"ttft": 50.0, "e2el": 500.0, "tpot": t}
                for t in tpots]  # fmt: skip

    paired = [
        (m, s)
        for m, s in zip(measured_tpot, simulated_tpot, strict=True)
        if m is not None and s is not None
    ]
    measured = np.mean([m for m, _ in paired])
    simulated = np.mean([s for _, s in paired])
    level = _judged_level(
        "50%", 0.5, {"mean_tpot_ms": simulated / measured - 1, **(errors or {})}
    )
    level["measured"]["mean_tpot_ms"] = measured
    level["simulated"]["mean_tpot_ms"] = simulated
    level["requests"] = request_columns(
        specs, each(measured_tpot), each(simulated_tpot)
    )
    return level


def test_a_missed_mean_names_the_request_that_carries_most_of_it():
    # Ten requests at 100 ms; one simulated at 300 (one stalled behind a
    # long prefill), one at 90: the mean is 19% high, 20 points of it one
    # request's.
    simulated = [100.0] * 10
    simulated[3], simulated[5] = 300.0, 90.0
    level = _level_with_requests([100.0] * 10, simulated, {"p99_tpot_ms": 0.5})
    report = {"levels": [level]}
    (judged,) = judge(report)["levels"]
    mean, p99 = judged["missed"]
    assert (mean["metric"], p99["metric"]) == ("mean_tpot_ms", "p99_tpot_ms")
    largest = mean["largest_request"]
    assert (largest["request"], largest["prompt_tokens"], largest["output_tokens"]) == (
        3, 103, 13,
    )  # fmt: skip
    assert (largest["measured_ms"], largest["simulated_ms"]) == (100.0, 300.0)
    assert largest["carried"] == pytest.approx(0.20)
    assert largest["error_without"] == pytest.approx(-10 / 900)
    assert largest["met_without"] is True
    assert "largest_request" not in p99  # a tail is no sum of requests
    report["verdict"] = judge(report)
    assert (
        "mean_tpot_ms +19.0% (target 10%; request 3 (103 + 13 tokens) carries "
        "+20.0 points of it, 300 ms simulated against 100 measured; -1.1% "
        "without it, within the target)"
    ) in format_report(report)
    assert json.loads(json.dumps(report["verdict"])) == report["verdict"]


def test_the_largest_requests_share_and_the_rest_add_up_to_the_means_error():
    rng = np.random.default_rng(3)
    measured = list(rng.uniform(20, 60, size=16))
    simulated = [m * rng.uniform(0.7, 1.6) for m in measured]
    # Not completed on one side or the other: left out of both means.
    measured[2], simulated[7] = None, None
    level = _level_with_requests(measured, simulated)
    error = level["relative_error"]["mean_tpot_ms"]
    largest = largest_request(level, "mean_tpot_ms")
    assert largest is not None and largest["request"] not in (2, 7)
    number = largest["request"]
    differences = [
        abs(s - m) for m, s in zip(measured, simulated, strict=True) if m and s
    ]
    assert abs(simulated[number] - measured[number]) == max(differences)
    rest = [
        (m, s)
        for n, (m, s) in enumerate(zip(measured, simulated, strict=True))
        if m and s and n != number
    ]
    without = np.mean([s for _, s in rest]) / np.mean([m for m, _ in rest]) - 1
    assert largest["error_without"] == pytest.approx(without)
    share_of_rest = sum(m for m, _ in rest) / (
        sum(m for m, _ in rest) + measured[number]
    )
    assert largest["carried"] + without * share_of_rest == pytest.approx(error)


def test_a_miss_spread_over_the_level_is_still_one_without_its_largest_request():
    # Every request simulated 20% slow, one of them 200%: without it the
    # mean is still 20% high.
    simulated = [120.0] * 10
    simulated[3] = 300.0
    level = _level_with_requests([100.0] * 10, simulated)
    report = {"levels": [level]}
    (judged,) = judge(report)["levels"]
    (miss,) = judged["missed"]
    largest = miss["largest_request"]
    assert largest["request"] == 3 and largest["carried"] == pytest.approx(0.2)
    assert largest["error_without"] == pytest.approx(0.2)
    assert largest["met_without"] is False
    report["verdict"] = judge(report)
    assert "+20.0% without it, still beyond the target)" in format_report(report)


def test_a_level_that_keeps_no_requests_names_none():
    level = _judged_level("50%", 0.5, {"mean_ttft_ms": 0.3})
    (judged,) = judge({"levels": [level]})["levels"]
    assert "largest_request" not in judged["missed"][0]
    # Too few requests with the latency on both sides to say.
    level = _level_with_requests([100.0, None, 80.0], [300.0, 90.0, None])
    assert largest_request(level, "mean_tpot_ms") is None
    assert compare(level["measured"], level["simulated"])["mape"] > 0
    one_token = RequestSpec(0.0, 10, 1)
    level["requests"] = request_columns(
        [one_token] * 3,
        [{"ttft": 1.0, "e2el": 1.0}] * 3,
        [{"ttft": 2.0, "e2el": 2.0}] * 3,
    )
    assert largest_request(level, "mean_tpot_ms") is None
    assert largest_request(level, "mean_ttft_ms")["carried"] == pytest.approx(1 / 3)
