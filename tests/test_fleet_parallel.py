"""A fleet stepped in several processes gives the serial run's answer:
records, fleet and per-engine counters, timelines, inter-token latencies,
a profile's step counts -- for every router, with rejected requests and a
fixed-length run; a worker's error reaches the caller."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from neuron_scheduler.cli import main
from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.sim.calibration import (
    Calibration,
    FitMethod,
    StepFit,
    calibrated,
)
from neuron_scheduler.sim.cost_model import CostModelError, RooflineCostModel
from neuron_scheduler.sim.engines import ClientPacing
from neuron_scheduler.sim.policies import SEED, UNCONSTRAINED
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.records import RunResult
from neuron_scheduler.sim.routing import RouterKind
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.step_jitter import QUANTILES
from neuron_scheduler.sim.workload import (
    builtin_workload,
    fit_to_model_len,
    random_workload,
)
from test_cost_profile import SETTINGS as PROFILE_SETTINGS
from test_cost_profile import synthetic_profile

COST = RooflineCostModel.named("trn2", "llama-3.1-8b", 4)
#: A small KV cache, so the unconstrained scheduler preempts.
SETTINGS = EngineSettings(
    max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=2048,
    block_size=32, num_kv_blocks=56,
)  # fmt: skip


def _specs(n, rate, max_model_len=2048):
    specs, fit = fit_to_model_len(builtin_workload(n, rate, seed=3), max_model_len)
    return specs, fit


def _comparable(result: RunResult) -> RunResult:
    return replace(
        result,
        wall_seconds=0.0,
        replicas=[replace(r, wall_seconds=0.0) for r in result.replicas],
    )


@pytest.mark.parametrize("router", list(RouterKind))
@pytest.mark.parametrize("policy", [SEED, UNCONSTRAINED], ids=lambda p: p.label)
def test_processes_give_the_serial_answer(router, policy):
    specs, fit = _specs(90, 5.0, max_model_len=1500)
    assert fit.rejected > 0  # rejected requests take part
    serial = simulate(specs, policy, SETTINGS, COST, replicas=5, router=router)
    parallel = simulate(
        specs, policy, SETTINGS, COST, replicas=5, router=router, jobs=2
    )
    assert parallel.decode_steps > 0 and len(parallel.replicas) == 5
    assert _comparable(parallel) == _comparable(serial)
    if policy is UNCONSTRAINED:
        assert sum(r.num_preemptions for r in serial.records) > 0


def test_every_engine_in_its_own_process_and_a_fixed_length_run():
    specs, _ = _specs(120, 8.0)
    kwargs = {"replicas": 3, "router": RouterKind.LEAST_LOADED, "stop_after_s": 6.0}
    serial = simulate(specs, SEED, SETTINGS, COST, **kwargs)
    parallel = simulate(specs, SEED, SETTINGS, COST, jobs=3, **kwargs)
    assert any(r.finish_s < 0 for r in serial.records)  # the run was cut short
    assert _comparable(parallel) == _comparable(serial)


def test_progress_hears_each_request_once_and_profile_counts_add_up():
    specs = random_workload(60, 200, 40, 0.5, 6.0, seed=1)
    heard: dict[int, list[int]] = {1: [], 2: []}
    counts = {}
    for jobs in (1, 2):
        cost = ProfileCostModel(synthetic_profile(), interpolate=True)
        simulate(
            specs, UNCONSTRAINED, PROFILE_SETTINGS, cost, replicas=3,
            jobs=jobs, on_finish=heard[jobs].append,
        )  # fmt: skip
        counts[jobs] = cost.report()
    assert sorted(heard[2]) == sorted(heard[1]) == list(range(len(specs)))
    assert counts[2] == counts[1] and counts[1]["interpolated_steps"] > 0


def test_a_worker_error_reaches_the_caller():
    specs = random_workload(30, 200, 40, 0.5, math.inf, seed=1)
    profile = synthetic_profile()
    lacking = replace(  # no decode graph for 4 rows
        profile, timings=tuple(t for t in profile.timings if t.rows != 4)
    )
    errors = []
    for jobs in (1, 2):
        with pytest.raises(CostModelError, match="no decode shape of 4 rows") as raised:
            simulate(
                specs, SEED, PROFILE_SETTINGS, ProfileCostModel(lacking),
                replicas=2, jobs=jobs,
            )  # fmt: skip
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


def test_bench_jobs_changes_nothing_but_the_wall_time(tmp_path):
    documents = []
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}.json"
        code = main([
            "bench", "--no-progress", "--num-requests", "60", "--policy", "seed",
            "--replicas", "3", "--jobs", jobs, "--json", str(out),
        ])  # fmt: skip
        assert code == 0
        document = json.loads(out.read_text())
        for run in document["runs"]:
            for key in ("wall_seconds", "simulated_requests_per_wall_second"):
                run.pop(key)
        documents.append(document)
    assert documents[0] == documents[1]


def test_jobs_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--jobs", "0"])
    assert "argument --jobs: must be at least 1, got '0'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
        simulate([], SEED, SETTINGS, COST, jobs=0)


def test_a_paced_client_runs_in_one_process_with_the_same_answer():
    specs, _ = _specs(60, 6.0, max_model_len=1500)
    pacing = ClientPacing(send_gap_s=0.05)
    kwargs = {"replicas": 3, "pacing": pacing}
    serial = simulate(specs, SEED, SETTINGS, COST, **kwargs)
    asked = simulate(specs, SEED, SETTINGS, COST, jobs=2, **kwargs)
    assert _comparable(asked) == _comparable(serial)
    sends = [r.arrival_s for r in serial.records if not r.failed]
    assert min(b - a for a, b in zip(sends, sends[1:], strict=False)) >= 0.05 - 1e-12


def test_a_profile_that_draws_its_decode_steps_gives_the_serial_answer():
    # A refitted profile charges each decode step a drawn factor: each
    # engine draws from its own stream, whichever process steps it.
    jitter = tuple(float(f) for f in np.linspace(0.6, 1.6, QUANTILES))
    decode = StepFit(1.0, 0.0, 40, 1.0, jitter=jitter)
    kept = StepFit(1.0, 0.0, 0, 1.0, FitMethod.KEPT)
    drawn = calibrated(synthetic_profile(), Calibration(kept, decode))
    specs = random_workload(60, 200, 40, 0.5, 6.0, seed=1)
    runs = [
        simulate(
            specs,
            SEED,
            PROFILE_SETTINGS,
            ProfileCostModel(drawn),
            replicas=3,
            jobs=jobs,
        )  # fmt: skip
        for jobs in (1, 2)
    ]
    assert _comparable(runs[1]) == _comparable(runs[0])
    steady = simulate(
        specs, SEED, PROFILE_SETTINGS, ProfileCostModel(synthetic_profile()),
        replicas=3,
    )  # fmt: skip
    assert runs[0].records != steady.records  # the draws took part
