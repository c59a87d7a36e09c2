"""End-to-end benchmark runs on small workloads: internal consistency."""

import json

import pytest

from neuron_scheduler.cli import main
from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.sim.cost_model import RooflineCostModel
from neuron_scheduler.sim.policies import SEED, UNCONSTRAINED, neuron_vllm_policy
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.time_breakdown import TOP_LEVEL
from neuron_scheduler.sim.workload import (
    RequestSpec,
    builtin_workload,
    fit_to_model_len,
)

COST = RooflineCostModel.named("trn2", "llama-3.1-8b", 4)
SETTINGS = EngineSettings(
    max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=4096,
    block_size=32, num_kv_blocks=2048,
)  # fmt: skip


@pytest.mark.parametrize("policy", [SEED, UNCONSTRAINED], ids=lambda p: p.label)
def test_every_request_completes_with_its_tokens(policy):
    specs, fit = fit_to_model_len(builtin_workload(60, 20.0, seed=2), 4096)
    served = [s for s in specs if not s.rejected]
    # The server refuses prompts of max_model_len tokens or more.
    assert fit.rejected == 60 - len(served) > 0
    assert all(s.input_len >= 4096 for s in specs if s.rejected)
    result = simulate(specs, policy, SETTINGS, COST)
    metrics = compute_metrics(result)
    assert metrics["completed"] == len(served)
    assert metrics["failed"] == fit.rejected
    assert metrics["total_output_tokens"] == sum(s.output_len for s in served)
    assert metrics["total_input_tokens"] == sum(s.input_len for s in served)
    assert result.prefill_tokens == sum(s.input_len for s in served)
    assert all(r.first_token_s >= r.arrival_s for r in result.records if not r.failed)
    assert metrics["num_preemptions"] == 0 or policy is UNCONSTRAINED
    if policy is SEED:
        assert result.mixed_steps == 0
        assert 0 < metrics["prefill_padding_ratio"] < 1
        assert set(metrics["buckets_used"]["prefill"]) <= {128, 256, 512, 1024, 2048}


def test_shared_prefixes_hit_the_prefix_cache():
    specs = [RequestSpec(float(i), 1500, 4, hash_ids=(0, 1, 2 + i)) for i in range(6)]
    settings = EngineSettings(**{**SETTINGS.__dict__, "enable_prefix_caching": True})
    result = simulate(specs, SEED, settings, COST)
    assert all(r.num_tokens == 4 for r in result.records)
    # After the first, each request recomputes only its unshared block.
    assert result.prefill_tokens < 1500 + 5 * 600


def test_seed_stays_within_kv_capacity_where_stock_admission_would_not():
    tight = EngineSettings(**{**SETTINGS.__dict__, "num_kv_blocks": 300})
    specs = fit_to_model_len(builtin_workload(40, float("inf"), seed=4), 4096)[0]
    result = simulate(specs, SEED, tight, COST)
    assert result.max_running <= (300 - 1) // (4096 // 32)
    assert sum(r.num_preemptions for r in result.records) == 0


def test_cli_writes_json_plot_and_details(tmp_path, capsys):
    json_path, png = tmp_path / "out.json", tmp_path / "out.png"
    code = main([
        "bench", "--num-requests", "30", "--request-rate", "5", "--max-model-len", "4096",
        "--config", 'small={"num_seqs_buckets": [8, 32]}', "--policy", "seed",
        "--json", str(json_path), "--plot", str(png), "--save-detailed", "--no-progress",
    ])  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    assert "Successful requests:" in table and "small" in table
    runs = json.loads(json_path.read_text())["runs"]
    assert [r["label"] for r in runs] == ["seed", "small"]
    for run in runs:
        assert run["completed"] + run["failed"] == 30 and len(run["requests"]) == 30
        assert run["failed"] == sum(r["failed"] for r in run["requests"])
        for key in ("request_goodput", "p99_itl_ms", "mean_tpot_ms", "wall_seconds"):
            assert key in run
    assert set(runs[1]["buckets_used"]["decode"]) <= {8, 32}
    assert png.stat().st_size > 10_000


def test_cli_reports_bad_workload_cleanly(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5,oops\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--workload", str(bad), "--no-progress"])
    assert exit_info.value.code == 2
    assert "bad.csv:2: GeneratedTokens" in capsys.readouterr().err


def test_overhead_mode_reports_each_size_and_the_ratio_of_its_medians(tmp_path, capsys):
    from neuron_scheduler.sim.overhead import RUNNING_SIZES

    out = tmp_path / "overhead.json"
    assert (
        main(["bench", "--overhead", "--overhead-steps", "5", "--json", str(out)]) == 0
    )
    figures = json.loads(out.read_text())
    assert set(figures) == {
        f"{name}_{running}"
        for running in RUNNING_SIZES
        for name in ("overhead_ratio", "stock_ms", "neuron_ms")
    }
    for running in RUNNING_SIZES:
        stock, ours = figures[f"stock_ms_{running}"], figures[f"neuron_ms_{running}"]
        assert stock > 0 and ours > 0
        assert figures[f"overhead_ratio_{running}"] == pytest.approx(ours / stock)
    rows = capsys.readouterr().out.strip().splitlines()[1:]
    assert [int(row.split()[0]) for row in rows] == list(RUNNING_SIZES)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--overhead", "--num-requests", "5"], ["--overhead", "--num-requests"]),
        (["--published", "--replicas", "2", "--seed", "3"],
         ["--published", "--replicas", "--seed"]),
        (["--overhead", "--published"], ["--overhead", "--published"]),
        (["--overhead-steps", "5"], ["--overhead-steps", "--overhead"]),
    ],
)  # fmt: skip
def test_a_flag_the_mode_ignores_is_refused_naming_both(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("neuron-scheduler bench: error: ")
    assert all(flag in error for flag in named), error


#: Buckets narrower than the traffic: long prompts and contexts fit only the
#: largest.
NARROW = {
    "num_batched_tokens_buckets": [256, 512, 2048],
    "num_seqs_buckets": [2, 4, 16],
    "decode_context_length_buckets": [1024, 2048, 4096],
}


def _at_largest(records, kind, size_of, below_largest):
    steps = [r for r in records if r.kind is kind]
    count = sum(size_of(r) > below_largest for r in steps)
    return {"steps": count, "share": count / len(steps)}


def test_bench_reports_the_steps_that_fit_only_the_largest_bucket():
    from neuron_scheduler.scheduler import NeuronScheduler
    from neuron_scheduler.sim.policies import Policy
    from neuron_scheduler.step import StepKind

    specs, _ = fit_to_model_len(builtin_workload(60, 4.0, seed=2), 4096)
    records = []
    policy = Policy("narrow", NeuronScheduler, NARROW)
    result = simulate(specs, policy, SETTINGS, COST, on_step=records.append)
    reported = compute_metrics(result)["steps_at_largest_bucket"]
    expected = {
        "prefill_tokens": _at_largest(
            records, StepKind.PREFILL, lambda r: r.total_actual, 512
        ),
        "decode_batch": _at_largest(records, StepKind.DECODE, lambda r: r.num_seqs, 4),
        "decode_context": _at_largest(
            records, StepKind.DECODE, lambda r: r.context_len, 2048
        ),
    }
    assert reported == expected
    assert all(0 < part["share"] < 1 for part in reported.values())
    # A fleet: each engine's own counts, adding up to the fleet's.
    fleet = compute_metrics(simulate(specs, policy, SETTINGS, COST, replicas=3))
    for name, total in fleet["steps_at_largest_bucket"].items():
        parts = [r["steps_at_largest_bucket"][name]["steps"] for r in fleet["replicas"]]
        assert sum(parts) == total["steps"] > 0
    # Dynamic shapes have no buckets to fall to.
    dynamic = compute_metrics(simulate(specs, UNCONSTRAINED, SETTINGS, COST))
    assert all(p["steps"] == 0 for p in dynamic["steps_at_largest_bucket"].values())


@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize(
    "policy",
    [SEED, UNCONSTRAINED, neuron_vllm_policy(4096)],
    ids=lambda p: p.label,
)
def test_the_time_breakdown_adds_up_to_the_run(policy, replicas):
    specs, _ = fit_to_model_len(builtin_workload(40, 0.5, seed=5), 4096)
    result = simulate(specs, policy, SETTINGS, COST, replicas=replicas)
    parts = compute_metrics(result)["time_breakdown"]
    assert parts["engine_seconds"] == pytest.approx(result.duration_s * replicas)
    # Idle gaps and step times, counted as the clocks moved, fill the run.
    top_level = sum(parts[name] for name in TOP_LEVEL)
    assert top_level == pytest.approx(parts["engine_seconds"], rel=0.01)
    assert parts["idle"] > 0  # 0.5 req/s: engines wait for requests
    assert -1e-9 <= parts["prefill_padding"] <= parts["prefill"]
    padding = parts["decode_unfilled_rows"] + parts["decode_kv_read_padding"]
    assert -1e-9 <= padding <= parts["decode"]
    assert parts["prefill_with_decodes_waiting"] <= parts["prefill"]
    if policy is UNCONSTRAINED:  # dynamic shapes: no padding, mixed steps
        assert parts["mixed"] > 0 and padding == parts["prefill_padding"] == 0
    else:
        assert parts["mixed"] == 0 and parts["prefill_padding"] > 0
        assert parts["decode_kv_read_padding"] > 0  # contexts below the bucket


@pytest.mark.parametrize("rate", [float("inf"), 4.0, 0.5])
def test_no_never_mix_schedule_beats_the_lower_bound(rate):
    from neuron_scheduler.scheduler import NeuronScheduler
    from neuron_scheduler.sim.policies import Policy
    from neuron_scheduler.sim.time_breakdown import never_mix_lower_bound

    specs, _ = fit_to_model_len(builtin_workload(60, rate, seed=5), 4096)
    bound = never_mix_lower_bound(specs, SETTINGS, COST)
    combined = {"kv_admission": "reserve", "max_prefills_per_batch": 8,
                "max_consecutive_prefill_steps": 1}  # fmt: skip
    policies = [SEED, Policy("narrow", NeuronScheduler, NARROW),
                Policy("combined", NeuronScheduler, combined)]  # fmt: skip
    durations = [simulate(specs, p, SETTINGS, COST).duration_s for p in policies]
    assert all(bound <= d for d in durations), (bound, durations)
    # Not a trivial bound: within 1.5x of the best schedule here.
    assert min(durations) < 1.5 * bound
    # Three engines share the work: the bound falls, never below a third.
    shared = never_mix_lower_bound(specs, SETTINGS, COST, engines=3)
    assert bound / 3 <= shared <= bound
    fleet = simulate(specs, SEED, SETTINGS, COST, replicas=3).duration_s
    assert shared <= fleet


@pytest.mark.parametrize(
    ("command", "option"),
    [("bench", "--json"), ("bench", "--plot"), ("plan", "--json"), ("plan", "--plot"),
     ("tune", "--json"), ("tune", "--output"), ("profile", "--output"),
     ("conformance", "--json"), ("validate", "--json"), ("validate", "--save-profile")],
)  # fmt: skip
def test_a_file_with_nowhere_to_go_is_refused_before_the_run(
    command, option, tmp_path, capsys
):
    # Written when the run is done: a validate once ran ten minutes and then
    # had no directory for its report.
    for target, fragment in (
        (tmp_path / "missing" / "out.json", "no directory"),
        (tmp_path, "is a directory, not a file"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([command, option, str(target)])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert f"argument {option}: {str(target)!r}" in error and fragment in error
    assert not (tmp_path / "missing").exists()
