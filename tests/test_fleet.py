"""Fleet simulation: several real schedulers behind a router on one
virtual clock; per-replica load; extra latency percentiles; bad input."""

import json

import pytest

from neuron_scheduler.cli import main
from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.sim.cost_model import RooflineCostModel
from neuron_scheduler.sim.policies import SEED
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.routing import (
    EngineLoad,
    RouterKind,
    VLLMRouter,
    make_router,
)
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.workload import builtin_workload, fit_to_model_len

COST = RooflineCostModel.named("trn2", "llama-3.1-8b", 4)
SETTINGS = EngineSettings(
    max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096,
    block_size=32, num_kv_blocks=4 * 4096 // 32 + 1,
)  # fmt: skip


def _specs(n, rate, seed=0):
    return fit_to_model_len(builtin_workload(n, rate, seed=seed), 4096)[0]


def test_one_replica_is_the_plain_simulation():
    specs = _specs(60, 2.0)
    plain = compute_metrics(simulate(specs, SEED, SETTINGS, COST))
    fleet = simulate(specs, SEED, SETTINGS, COST, replicas=1)
    assert fleet.replicas == []
    again = compute_metrics(fleet)
    for key in ("duration", "mean_ttft_ms", "p99_itl_ms", "mean_running"):
        assert again[key] == plain[key]


@pytest.mark.parametrize("router", list(RouterKind))
def test_replicas_share_the_work_and_their_counters_sum_to_the_fleet(router):
    specs = _specs(120, 6.0)
    result = simulate(specs, SEED, SETTINGS, COST, replicas=3, router=router)
    metrics = compute_metrics(result)
    assert metrics["completed"] == len([s for s in specs if not s.rejected])
    loads = metrics["replicas"]
    assert len(loads) == 3 and all(load["requests"] > 10 for load in loads)
    assert sum(load["requests"] for load in loads) == metrics["completed"]
    assert sum(load["prefill_steps"] for load in loads) == result.prefill_steps
    assert sum(load["decode_steps"] for load in loads) == result.decode_steps
    assert sum(load["mean_running"] for load in loads) == pytest.approx(
        metrics["mean_running"]
    )
    assert all(load["max_running"] <= SETTINGS.max_num_seqs for load in loads)
    if router is RouterKind.ROUND_ROBIN:
        counts = [load["requests"] for load in loads]
        assert max(counts) - min(counts) <= 1


def test_more_replicas_cut_queueing_under_the_same_traffic():
    specs = _specs(150, 8.0)
    one = compute_metrics(simulate(specs, SEED, SETTINGS, COST))
    four = compute_metrics(simulate(specs, SEED, SETTINGS, COST, replicas=4))
    assert four["mean_ttft_ms"] < one["mean_ttft_ms"] / 2
    assert four["duration"] <= one["duration"]


def test_least_loaded_routes_to_the_emptiest_engine():
    router = make_router(RouterKind.LEAST_LOADED, 3)
    loads = [EngineLoad(4, 1, 0.2), EngineLoad(1, 0, 0.9), EngineLoad(2, 2, 0.1)]
    assert router.choose(0.0, loads) == 1


def test_vllm_router_rotates_ties_counts_inflight_and_penalises_kv_pressure():
    router = VLLMRouter(3)
    idle = [EngineLoad(0, 0, 0.0)] * 3
    # Equal engines: round robin (the local waiting count and rotating start).
    assert [router.choose(0.0, idle) for _ in range(3)] == [0, 1, 2]
    # Within the 100 ms snapshot window the local waiting counts tie: round.
    assert router.choose(0.05, idle) == 0
    # A new snapshot shows idle engines: the client's in-flight counts decide.
    router.finished(1)
    assert router.choose(0.2, idle) == 1
    # A fresh snapshot: waiting requests on a nearly full KV cache weigh more.
    loaded = [EngineLoad(2, 2, 0.95), EngineLoad(3, 0, 0.2), EngineLoad(3, 1, 0.5)]
    fresh = VLLMRouter(3)
    assert fresh.choose(1.0, loaded) == 1


def test_metric_percentiles_add_keys_and_rows(capsys, tmp_path):
    out = tmp_path / "fleet.json"
    code = main([
        "bench", "--no-progress", "--num-requests", "40", "--policy", "seed",
        "--replicas", "2", "--router", "round-robin",
        "--metric-percentiles", "50,90,99.9", "--json", str(out),
    ])  # fmt: skip
    assert code == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["p50_ttft_ms"] == run["median_ttft_ms"]
    assert run["p90_ttft_ms"] <= run["p99_ttft_ms"] <= run["p99.9_ttft_ms"]
    assert {"p50_itl_ms", "p90_tpot_ms", "p99.9_e2el_ms"} <= set(run)
    assert [r["requests"] for r in run["replicas"]] == [20, 20]
    table = capsys.readouterr().out
    assert "P90 TTFT (ms):" in table and "Replica 1:" in table


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--replicas", "0"], "argument --replicas: must be at least 1, got '0'"),
        (["--router", "random"], "argument --router: invalid choice: 'random'"),
        (["--metric-percentiles", "0"], "'0' is not in (0, 100]"),
        (["--metric-percentiles", "50,101"], "'101' is not in (0, 100]"),
        (["--metric-percentiles", "50,x"], "'x' is not a number"),
    ],
)
def test_bad_fleet_options_are_refused_by_name(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--num-requests", "5", *argv])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err
