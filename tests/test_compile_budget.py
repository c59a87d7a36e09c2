"""The compile budget: a Pareto frontier of bucket counts whose replayed
step time matches the simulator, chosen within the budget, with clear
errors."""

import json

import pytest

from neuron_scheduler.cli import main
from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.sim.compile_budget import (
    CompileBudgetError,
    CompileSeconds,
    pareto_frontier,
    within_budget,
)
from neuron_scheduler.sim.cost_model import RooflineCostModel
from neuron_scheduler.sim.policies import Policy
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.tuner import ObservedShapes
from neuron_scheduler.sim.workload import builtin_workload, fit_to_model_len

SETTINGS = EngineSettings(
    block_size=32, num_kv_blocks=20000, max_num_seqs=16, max_model_len=16384,
    max_num_batched_tokens=4096,
)  # fmt: skip
PACKED = {"kv_admission": "reserve", "max_prefills_per_batch": 4}


@pytest.fixture(scope="module")
def observed():
    cost = RooflineCostModel.named("trn2", "llama-3.1-8b", 4)
    specs = fit_to_model_len(builtin_workload(60, float("inf"), seed=3), 16384)[0]
    shapes = ObservedShapes()
    simulate(specs, Policy("t", NeuronScheduler, PACKED), SETTINGS, cost,
             on_step=shapes.add)  # fmt: skip
    frontier = pareto_frontier(
        shapes.prefill_tokens,
        list(zip(shapes.decode_batches, shapes.decode_contexts, strict=True)),
        cost,
        CompileSeconds(20, 40),
        maxima=(4096, 16, 16384),
        max_counts=(5, 4, 4),
        alignment=(128, 1, 32),
    )
    return cost, specs, frontier


def test_the_frontier_trades_compile_minutes_for_step_time(observed):
    _, _, frontier = observed
    assert len(frontier) > 3
    assert frontier[0].counts == (1, 1, 1)
    assert frontier[0].compile_minutes == pytest.approx((20 + 40) / 60)
    for cheaper, dearer in zip(frontier, frontier[1:], strict=False):
        assert cheaper.compile_minutes <= dearer.compile_minutes
        assert dearer.step_seconds < cheaper.step_seconds
    for row in frontier:
        p, b, c = row.counts
        assert row.compile_minutes == pytest.approx((20 * p + 40 * b * c) / 60)
        assert all(t % 128 == 0 for t in row.prefill[:-1])
        assert row.prefill[-1] == 4096 and row.context[-1] == 16384


def test_replayed_step_time_is_the_simulated_duration(observed):
    # The steps do not depend on the intermediate buckets: replaying them at
    # a row's padded shapes is the simulation of that row (all arrive at once).
    cost, specs, frontier = observed
    for row in (frontier[0], frontier[len(frontier) // 2], frontier[-1]):
        config = {**PACKED, "num_batched_tokens_buckets": list(row.prefill),
                  "num_seqs_buckets": list(row.batch),
                  "decode_context_length_buckets": list(row.context)}  # fmt: skip
        run = simulate(specs, Policy("r", NeuronScheduler, config), SETTINGS, cost)
        assert row.step_seconds == pytest.approx(run.duration_s, rel=0.02)


def test_budget_keeps_rows_that_fit_and_refuses_one_below_one_bucket_each(observed):
    _, _, frontier = observed
    kept = within_budget(frontier, 3.0)
    assert kept and all(r.compile_minutes <= 3.0 for r in kept)
    assert len(kept) < len(frontier)
    with pytest.raises(
        CompileBudgetError,
        match=r"0.5 is below one bucket of each kind \(1.00 minutes\)",
    ):
        within_budget(frontier, 0.5)


def test_compile_seconds_from_a_profile_and_refused_when_not_positive():
    measured = CompileSeconds.from_profile(
        {"prefill:128": 2.0, "prefill:256": 4.0, "decode:1": 1.0}
    )
    assert measured == CompileSeconds(3.0, 1.0)
    assert CompileSeconds.from_profile({"prefill:128": 2.0}) is None
    with pytest.raises(
        CompileBudgetError, match="per decode bucket must be > 0, got 0"
    ):
        CompileSeconds(1.0, 0)


def test_tune_cli_chooses_within_the_budget(tmp_path, capsys):
    report = tmp_path / "budget.json"
    code = main([
        "tune", "--num-requests", "40", "--request-rate", "inf",
        "--max-model-len", "16384", "--max-num-batched-tokens", "4096",
        "--max-num-seqs", "16", "--compile-budget-minutes", "4",
        "--compile-seconds-per-bucket", "20", "--json", str(report),
    ])  # fmt: skip
    assert code == 0
    written = json.loads(report.read_text())
    rows = written["pareto"]
    assert all(r["compile_minutes"] <= 4 for r in rows)
    chosen = rows[written["chosen"]]
    simulated = [r["output_throughput"] for r in rows if r["output_throughput"]]
    assert chosen["output_throughput"] == max(simulated)
    config = written["neuron_config"]
    assert config["num_batched_tokens_buckets"] == chosen["prefill_buckets"]
    assert config["decode_context_length_buckets"] == chosen["context_buckets"]
    assert "<- chosen" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (
            ["--compile-budget-minutes", "0.1"],
            "0.1 is below one bucket of each kind (1.00 minutes)",
        ),
        (
            ["--compile-seconds-per-bucket", "10"],
            "--compile-seconds-per-bucket needs --compile-budget-minutes",
        ),
        (
            ["--compile-budget-minutes", "5", "--compile-seconds-per-bucket", "-1"],
            "must be > 0, got -1",
        ),
    ],
)
def test_tune_cli_refuses_a_bad_budget(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "--num-requests", "5", "--max-model-len", "4096", *argv])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err
