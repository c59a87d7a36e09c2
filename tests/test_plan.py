"""neuron-scheduler plan: SLO parsing, the early stop, and answers that agree
with bench runs (N meets, N-1 does not; more traffic never needs fewer
replicas; the highest rate is sustained and one step more is not)."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_scheduler.cli import main
from neuron_scheduler.sim.planner import (
    DisaggregatedSearch,
    Evaluation,
    SLOWatch,
    plan_entry,
)
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


# ------------------------------------------------------- disaggregated plans


def _drive(search, meets, bound=lambda x: True):
    """Run ``search`` to its end, a point meeting where ``meets(x, y)``, a
    prefill-only bound (0 decode engines) where ``bound(x)``."""
    while not search.done():
        for point in search.next_points(2):
            if point.replicas == 0:
                ok = bound(point.prefill_engines)
            else:
                ok = meets(point.prefill_engines, point.replicas)
            search.record(Evaluation(point, ok, False, {}))


def test_the_disaggregated_search_finds_the_cheapest_pools_and_prunes():
    # Prefill engines cost 2 chips, decode engines 1: 2P3D (7 chips) meets,
    # so does 1P6D (8) and 3P2D (8); nothing cheaper does.
    def meets(x, y):
        return (x >= 2 and y >= 3) or (x == 1 and y >= 6) or (x >= 3 and y >= 2)

    search = DisaggregatedSearch(None, 16, prefill_chips=2.0, decode_chips=1.0)
    _drive(search, meets)
    best = search.answer.point
    assert (best.prefill_engines, best.replicas) == (2, 3)
    # 1P6D (8 chips) was found first; with 2 prefill engines only decode
    # counts strictly cheaper were tried, and 3 prefill engines (6 chips)
    # plus one decode engine cannot beat 7: never tried.
    assert all(
        search.chips(e.point) < 8
        for e in search.evaluations
        if e.point.prefill_engines == 2
    )
    searched = {e.point.prefill_engines for e in search.evaluations if e.point.replicas}
    assert searched == {1, 2}


def test_prefill_counts_whose_ttft_bound_misses_get_no_decode_search():
    search = DisaggregatedSearch(None, 16, prefill_chips=1.0, decode_chips=1.0)
    _drive(search, lambda x, y: x >= 2 and y >= 2, bound=lambda x: x >= 2)
    best = search.answer.point
    assert (best.prefill_engines, best.replicas) == (2, 2)
    decode_runs = [e.point for e in search.evaluations if e.point.replicas]
    assert all(p.prefill_engines == 2 for p in decode_runs)
    bounds = [
        e.point.prefill_engines for e in search.evaluations if not e.point.replicas
    ]
    assert bounds == [1, 2]  # 3 prefill engines and 1 decode cannot beat 4 chips


def test_the_disaggregated_search_without_an_answer_says_so():
    search = DisaggregatedSearch(None, 4, prefill_chips=1.0, decode_chips=1.0)
    _drive(search, lambda x, y: False)
    assert search.answer is None
    plan = plan_entry("disaggregated", search, [], 1.0, None, 1.0)
    assert plan["replicas"] is None and "at most 4 engines" in plan["note"]


def _bench_disaggregated_meets(tmp_path, sizes, rate, extra=()):
    out = tmp_path / "pd.json"
    main(["bench", "--no-progress", "--disaggregated", sizes, *WORKLOAD,
          "--request-rate", str(rate), "--metric-percentiles", "90",
          "--json", str(out), *extra])  # fmt: skip
    (run,) = json.loads(out.read_text())["runs"]
    return run["p90_ttft_ms"] <= 1500 and run["p99_tpot_ms"] <= 60


def test_plan_disaggregated_compares_pools_with_colocated_and_agrees_with_bench(
    tmp_path, capsys
):
    colocated, pools = _plan(tmp_path, "--policy", "seed", "--rate", "4",
                             "--disaggregated")  # fmt: skip
    assert colocated["label"] == "seed" and colocated["replicas"] >= 1
    assert pools["label"] == "disaggregated"
    x, y = pools["prefill_engines"], pools["decode_engines"]
    assert x >= 1 and y >= 1 and pools["chips"] == x + y  # trn2 TP4: one chip
    assert f"{x}P{y}D" in capsys.readouterr().out
    assert _bench_disaggregated_meets(tmp_path, f"{x}P{y}D", 4)
    if y > 1:
        assert not _bench_disaggregated_meets(tmp_path, f"{x}P{y - 1}D", 4)
    evaluated = {
        (e["prefill_engines"], e["replicas"]): e["meets"]
        for e in pools["evaluations"]
        if not e.get("prefill_bound")
    }
    assert evaluated[(x, y)]
    # No cheaper pair the search evaluated met the SLOs.
    assert not any(ok and p + d < x + y for (p, d), ok in evaluated.items())


PADDED = '{"num_batched_tokens_buckets": [4096]}'


def test_plan_searches_every_prefill_config_with_every_decode_config(tmp_path, capsys):
    """Two prefill configs (the design's buckets, and every prompt padded
    to 4096 tokens) with one decode config: a search per pair, each answer
    agreeing with bench --disaggregated under that pair's configs."""
    design, padded = _plan(
        tmp_path, "--policy", "seed", "--rate", "4", "--disaggregated",
        "--prefill-config", "{}", "--prefill-config", f"padded={PADDED}",
    )[1:]  # fmt: skip
    assert design["label"] == "disaggregated P:prefill1 D:design"
    assert padded["label"] == "disaggregated P:padded D:design"
    assert padded["prefill_config"] == json.loads(PADDED)
    assert design["prefill_config"] == {} == padded["decode_config"]
    for plan, config in ((design, "{}"), (padded, PADDED)):
        x, y = plan["prefill_engines"], plan["decode_engines"]
        sizes = ["--prefill-config", config]
        assert _bench_disaggregated_meets(tmp_path, f"{x}P{y}D", 4, sizes)
        if x > 1:  # one prefill engine fewer misses, whatever the decode pool
            assert not _bench_disaggregated_meets(
                tmp_path, f"{x - 1}P{4 * y}D", 4, sizes
            )
    # Padding every prompt to the largest bucket only adds prefill work.
    assert padded["prefill_engines"] >= design["prefill_engines"]
    assert padded["chips"] >= design["chips"]
    assert padded["metrics"]["mean_ttft_ms"] > design["metrics"]["mean_ttft_ms"]
    best = min((design, padded), key=lambda plan: plan["chips"])
    assert (
        f"cheapest xPyD: {best['label']}, {best['prefill_engines']}P"
        f"{best['decode_engines']}D, {best['chips']:g} chips"
    ) in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--decode-tensor-parallel-size", "8"],
         "--decode-tensor-parallel-size applies only with --disaggregated"),
        (["--prefill-config", "{}"], "--prefill-config applies only with"),
        (["--disaggregated", "--decode-config", "a={}", "--decode-config", "a={}"],
         "--decode-config label 'a' is given twice"),
        (["--disaggregated", "--prefill-config", "p=[1]"],
         "--prefill-config p: JSON must be an object"),
        (["--disaggregated", "--prefill-config", "{x"], "--prefill-config: invalid JSON"),
        (["--disaggregated", "--decode-config", "nolabel"],
         "--decode-config 'nolabel' must be LABEL=JSON"),
        (["--disaggregated", "--replicas", "2"], "--replicas does not apply"),
        (["--disaggregated", "--kv-link-gb-per-s", "-1"], "bandwidth must be > 0"),
    ],
)  # fmt: skip
def test_bad_disaggregated_plan_input_is_refused_by_name(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--num-requests", "5", "--slo", "ttft:p90:2000", *argv])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err
