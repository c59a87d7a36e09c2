"""neuron-scheduler plan: SLO parsing, the early stop, and answers that agree
with bench runs (N meets, N-1 does not; more traffic never needs fewer
replicas; the highest rate is sustained and one step more is not)."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_scheduler.cli import main
from neuron_scheduler.sim.planner import SLOWatch
from neuron_scheduler.sim.records import RequestRecord
from neuron_scheduler.sim.slo import SLO, SLOError
from neuron_scheduler.sim.workload import RequestSpec

WORKLOAD = ["--num-requests", "120", "--max-model-len", "4096",
            "--max-num-seqs", "8", "--num-kv-blocks", "1100"]  # fmt: skip
SLOS = ["--slo", "ttft:p90:1500", "tpot:p99:60"]


def test_slo_parse():
    assert SLO.parse("ttft:p90:2000") == SLO("ttft", 90.0, 2000.0)
    assert SLO.parse("e2el:99.9:5000").key == "p99.9_e2el_ms"
    assert str(SLO.parse("tpot:p99:100")) == "tpot:p99:100"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("latency:p90:100", "unknown metric 'latency'"),
        ("ttft:p0:100", "'p0' is not in (0, 100]"),
        ("ttft:p101:100", "'p101' is not in (0, 100]"),
        ("ttft:p90", "expected METRIC:pPERCENTILE:MS"),
        ("ttft:pXX:100", "'pXX' is not a number"),
        ("ttft:p90:fast", "milliseconds 'fast' is not a number"),
        ("ttft:p90:0", "milliseconds must be > 0"),
    ],
)
def test_bad_slos_are_named(text, fragment):
    with pytest.raises(SLOError, match="--slo") as error:
        SLO.parse(text)
    assert fragment in str(error.value)


@settings(max_examples=200, deadline=None)
@given(
    ttfts=st.lists(st.floats(0, 4000), min_size=2, max_size=60),
    percentile=st.sampled_from([50.0, 90.0, 99.0]),
    data=st.data(),
)
def test_the_watch_stops_only_when_the_miss_is_certain(ttfts, percentile, data):
    slo = SLO("ttft", percentile, 1000.0)
    specs = [RequestSpec(0.0, 10, 1) for _ in ttfts]
    watch = SLOWatch([slo], specs)
    for seen, ttft in enumerate(ttfts, 1):
        record = RequestRecord(0.0, 10, 1, ttft / 1e3, ttft / 1e3, 1)
        if watch(record):
            # Whatever the rest turn out to be, the percentile misses.
            rest = data.draw(st.lists(st.floats(0, 1000), min_size=len(ttfts) - seen,
                                      max_size=len(ttfts) - seen))  # fmt: skip
            assert np.percentile(ttfts[:seen] + rest, percentile) > slo.ms
            return
    # Never stopped: then the final percentile may or may not meet, but the
    # watch must not have been able to tell (it saw every value).
    violations = sum(t > slo.ms for t in ttfts)
    assert violations < (1 - percentile / 100) * (len(ttfts) - 1) + 2


def _plan(tmp_path, *argv):
    out = tmp_path / "plan.json"
    assert main(["plan", "--no-progress", "--jobs", "1", *WORKLOAD, *SLOS,
                 "--json", str(out), *argv]) == 0  # fmt: skip
    return json.loads(out.read_text())["plans"]


def _bench_run(tmp_path, replicas, rate):
    out = tmp_path / "bench.json"
    main(["bench", "--no-progress", "--policy", "seed", *WORKLOAD,
          "--request-rate", str(rate), "--replicas", str(replicas),
          "--metric-percentiles", "90", "--json", str(out)])  # fmt: skip
    (run,) = json.loads(out.read_text())["runs"]
    return run


def _bench_meets(tmp_path, replicas, rate):
    run = _bench_run(tmp_path, replicas, rate)
    return run["p90_ttft_ms"] <= 1500 and run["p99_tpot_ms"] <= 60


def test_the_plan_agrees_with_bench_and_grows_with_traffic(tmp_path):
    picture = tmp_path / "plan.png"
    (light,) = _plan(tmp_path, "--policy", "seed", "--rate", "2",
                     "--plot", str(picture))  # fmt: skip
    assert picture.stat().st_size > 10_000
    (heavy,) = _plan(tmp_path, "--policy", "seed", "--rate", "6",
                     "--price-per-hour", "2.5")  # fmt: skip
    n = heavy["replicas"]
    assert n >= 2 and heavy["chips"] == n * 1.0  # trn2, TP4: one chip
    assert heavy["cost_per_hour"] == pytest.approx(2.5 * n)
    assert light["replicas"] <= n  # more traffic never needs fewer replicas
    assert all(s["met"] for s in heavy["slos"].values())
    # Every request of the workload is accounted for, at the plan's N.
    counted = heavy["metrics"]["completed"] + heavy["metrics"]["failed"]
    assert counted == int(WORKLOAD[WORKLOAD.index("--num-requests") + 1])
    # The plan's N meets the SLOs in a bench run, N - 1 does not.
    assert _bench_meets(tmp_path, n, 6)
    assert not _bench_meets(tmp_path, n - 1, 6)
    evaluated = {e["replicas"]: e["meets"] for e in heavy["evaluations"]}
    assert evaluated[n] and not evaluated[n - 1]


def test_the_highest_rate_is_sustained_and_one_step_more_is_not(tmp_path):
    (plan,) = _plan(tmp_path, "--policy", "seed", "--replicas", "2",
                    "--rate-granularity", "0.5")  # fmt: skip
    rate = plan["max_rate"]
    assert rate is not None and rate % 0.5 == 0
    assert _bench_meets(tmp_path, 2, rate)
    assert not _bench_meets(tmp_path, 2, rate + 0.5)


def test_a_plan_beyond_max_replicas_says_so(tmp_path, capsys):
    (plan,) = _plan(tmp_path, "--policy", "seed", "--rate", "20",
                    "--max-replicas", "2")  # fmt: skip
    assert plan["replicas"] is None
    assert plan["note"] == "more than --max-replicas 2 replicas needed"
    assert "more than --max-replicas 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (
            ["--slo", "ttft:p90:2000", "--replicas", "0"],
            "--replicas: must be at least 1",
        ),
        (["--slo", "ttft:p90:2000", "--router", "x"], "--router: invalid choice: 'x'"),
        (["--slo", "speed:p90:1"], "unknown metric 'speed'"),
        (["--slo", "ttft:p90:2000", "--rate", "0"], "--rate must be > 0, got 0.0"),
        (
            ["--slo", "ttft:p90:2000", "--rate", "1", "--replicas", "2"],
            "not allowed with argument",
        ),
    ],
)
def test_bad_plan_input_is_refused_by_name(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--num-requests", "5", *argv])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_parallel_search_gives_the_same_answer(tmp_path):
    out = tmp_path / "parallel.json"
    argv = ["plan", "--no-progress", *WORKLOAD, *SLOS, "--policy", "seed",
            "--config", 'packed={"max_prefills_per_batch": 4}', "--rate", "6"]  # fmt: skip
    assert main([*argv, "--jobs", "3", "--json", str(out)]) == 0
    parallel = json.loads(out.read_text())["plans"]
    assert main([*argv, "--jobs", "1", "--json", str(out)]) == 0
    serial = json.loads(out.read_text())["plans"]
    assert [p["replicas"] for p in parallel] == [p["replicas"] for p in serial]
    assert [p["label"] for p in parallel] == ["seed", "packed"]


def test_without_a_rate_the_plan_keeps_the_workloads_own_times(tmp_path):
    # The workload as bench builds it (here at --request-rate 6): the plan
    # must not re-draw arrivals at the workload's measured mean rate.
    (own,) = _plan(tmp_path, "--policy", "seed", "--request-rate", "6")
    n = own["replicas"]
    assert all(e["rate"] == pytest.approx(own["rate"]) for e in own["evaluations"])
    assert _bench_meets(tmp_path, n, 6) and not _bench_meets(tmp_path, n - 1, 6)
    # The very run bench makes, not just the same verdict.
    bench = _bench_run(tmp_path, n, 6)
    assert own["slos"]["ttft:p90:1500"]["value_ms"] == bench["p90_ttft_ms"]
    assert own["metrics"]["p99_tpot_ms"] == bench["p99_tpot_ms"]
