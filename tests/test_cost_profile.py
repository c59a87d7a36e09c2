"""Charging simulated steps from a measured profile, and the bench options
that replay published runs: closed loop (--max-concurrency), vLLM's random
dataset, and the server's rules for requests longer than max_model_len."""

import json
import math
from dataclasses import replace

import pytest

from neuron_scheduler.cli import main
from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.offline.step_profile import Profile, StepTiming
from neuron_scheduler.sim.cost_model import CostModelError, StepShape
from neuron_scheduler.sim.engines import ClientPacing
from neuron_scheduler.sim.policies import SEED, UNCONSTRAINED
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.workload import (
    RequestSpec,
    fit_to_model_len,
    random_workload,
)
from neuron_scheduler.step import StepKind

ENGINE = {
    "max_model_len": 512,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 256,
    "block_size": 16,
}
SETTINGS = EngineSettings(
    max_num_seqs=4,
    max_num_batched_tokens=256,
    max_model_len=512,
    block_size=16,
    num_kv_blocks=129,
)
# Token buckets 128, 256; batch buckets 1, 2, 4; one context bucket, 512.
PREFILL_S = {(128, 0): 0.010, (128, 256): 0.014, (256, 0): 0.020, (256, 256): 0.028}
DECODE_S = {(1, 512): 0.002, (2, 512): 0.003, (4, 512): 0.005}


def synthetic_profile() -> Profile:
    timings = [
        StepTiming(StepKind.PREFILL, tokens, context, (s * 0.9, s, s * 1.2))
        for (tokens, context), s in PREFILL_S.items()
    ]
    timings += [
        StepTiming(StepKind.DECODE, rows, context, (s, s, s), rows=rows)
        for (rows, context), s in DECODE_S.items()
    ]
    return Profile(
        platform={"name": "test"},
        model={"name": "synthetic"},
        engine=ENGINE,
        neuron_config={},
        kv_cache={"num_blocks": 129, "block_size": 16},
        timings=tuple(timings),
    )


def test_profile_round_trips_through_json(tmp_path):
    path = tmp_path / "profile.json"
    profile = synthetic_profile()
    profile.save(path)
    assert Profile.load(path) == profile
    filled = _fill_profile("actual")
    filled.save(tmp_path / "filled.json")
    assert Profile.load(tmp_path / "filled.json") == filled
    document = json.loads(path.read_text())
    first = document["timings"][0]
    assert first["median_s"] == pytest.approx(0.010)
    assert (first["p10_s"], first["p90_s"]) == pytest.approx((0.009, 0.012))


def test_bench_duration_is_the_sum_of_profiled_steps():
    """One 100-token prompt, 3 tokens: a 128-token prefill step, then two
    decode steps of 1 row at the 512 context bucket."""
    cost = ProfileCostModel(synthetic_profile())
    specs = [RequestSpec(0.0, 100, 3)]
    result = simulate(specs, SEED, SETTINGS, cost)
    assert result.duration_s == pytest.approx(0.010 + 2 * 0.002)
    assert cost.report() == {
        "cost_model": "profile",
        "exact_steps": 3,
        "interpolated_steps": 0,
    }


def test_context_and_missing_shapes():
    cost = ProfileCostModel(synthetic_profile())
    # A chunk after 128 tokens: halfway between the 0 and 256 samples.
    assert cost.step_time(StepShape(((128, 128),))) == pytest.approx(0.012)
    with pytest.raises(CostModelError, match="prefill shape of 64 tokens"):
        cost.step_time(StepShape(((64, 0),)))
    with pytest.raises(CostModelError, match="decode shape of 3 rows at context 512"):
        cost.step_time(StepShape((), 3, 512))
    assert cost.missing_shapes([128, 384], [1, 8], [512]) == [
        "prefill of 384 tokens",
        "decode of 8 rows at context 512",
    ]
    lenient = ProfileCostModel(synthetic_profile(), interpolate=True)
    assert lenient.step_time(StepShape((), 3, 512)) == pytest.approx(0.004)
    assert lenient.step_time(StepShape(((192, 0),))) == pytest.approx(0.015)
    assert lenient.report()["interpolated_steps"] == 2


class RecordingProfileCost(ProfileCostModel):
    """A profile cost model that keeps every time it charged."""

    def __init__(self, profile: Profile) -> None:
        super().__init__(profile)
        self.charged_s: list[float] = []

    def step_time(self, shape: StepShape, engine: int = 0) -> float:
        seconds = super().step_time(shape, engine)
        self.charged_s.append(seconds)
        return seconds


def test_unconstrained_steps_are_interpolated_and_counted():
    cost = RecordingProfileCost(synthetic_profile())
    specs = [RequestSpec(0.0, 100, 3), RequestSpec(0.0, 60, 2)]
    result = simulate(specs, UNCONSTRAINED, SETTINGS, cost)
    charged = cost.report()
    steps = result.mixed_steps + result.prefill_steps + result.decode_steps
    assert charged["interpolated_steps"] == steps == len(cost.charged_s)
    assert charged["exact_steps"] == 0
    # Everything arrives at once: the run is its steps back to back.
    assert result.duration_s == pytest.approx(sum(cost.charged_s))


def test_bench_cli_with_a_profile(tmp_path, capsys):
    path = tmp_path / "profile.json"
    synthetic_profile().save(path)
    out = tmp_path / "out.json"
    base = ["bench", "--cost-profile", str(path), "--num-requests", "8",
            "--random-input-len", "120", "--random-output-len", "4",
            "--policy", "seed", "--no-progress"]  # fmt: skip
    assert main([*base, "--json", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["cost_model"]["exact_steps"] > 0
    assert run["cost_model"]["interpolated_steps"] == 0
    settings = json.loads(out.read_text())["settings"]
    assert settings["max_model_len"] == 512 and settings["num_kv_blocks"] == 129
    # Another engine config than the profiled one is refused, named.
    with pytest.raises(SystemExit):
        main([*base, "--max-model-len", "1024"])
    assert "--max-model-len 1024 does not match the profile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--hardware", "inf2"])
    assert "--hardware names a roofline model" in capsys.readouterr().err
    # Buckets the profile lacks: refused before simulating, unless interpolated.
    small = 'small={"num_batched_tokens_buckets": [64, 256]}'
    with pytest.raises(SystemExit):
        main([*base, "--config", small])
    assert "prefill of 64 tokens" in capsys.readouterr().err
    assert main([*base, "--config", small, "--interpolate"]) == 0


def test_max_concurrency_runs_a_closed_loop():
    cost = ProfileCostModel(synthetic_profile())
    specs = [RequestSpec(0.0, 100, 3) for _ in range(5)]
    result = simulate(specs, SEED, SETTINGS, cost, max_concurrency=1)
    assert result.max_running == 1
    records = sorted(result.records, key=lambda r: r.arrival_s)
    for earlier, later in zip(records, records[1:], strict=False):
        assert later.arrival_s == pytest.approx(earlier.finish_s)
    # Latency is measured from when each request was sent.
    assert all(r.first_token_s - r.arrival_s == pytest.approx(0.010) for r in records)
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        simulate(specs, SEED, SETTINGS, cost, max_concurrency=0)


def test_random_workload_draws_what_vllms_random_dataset_draws():
    import numpy as np
    from vllm.benchmarks.datasets.utils import get_sampling_params

    class NoSpecialTokens:
        vocab_size = 32000

        def num_special_tokens_to_add(self):
            return 0

    specs = random_workload(2000, 1500, 250, 0.1, math.inf, seed=3)
    inputs, outputs, _ = get_sampling_params(
        np.random.default_rng(3), 2000, 0.1, 1500, 250, NoSpecialTokens()
    )
    assert [s.input_len for s in specs] == inputs.tolist()
    assert [s.output_len for s in specs] == outputs.tolist()
    assert len(set(inputs.tolist())) > 200  # uniform over the range
    assert all(s.arrival_s == 0 for s in specs)
    fixed = random_workload(10, 64, 8, 0.0, 2.0, seed=1)
    assert {(s.input_len, s.output_len) for s in fixed} == {(64, 8)}
    with pytest.raises(ValueError, match="--random-range-ratio must be in"):
        random_workload(10, 64, 8, 1.5, 2.0)


def test_requests_that_do_not_fit_are_rejected_as_the_server_does():
    specs = [
        RequestSpec(0.0, 10, 5),
        RequestSpec(0.0, 600, 5),
        RequestSpec(0.0, 500, 50),
    ]
    fitted, report = fit_to_model_len(specs, 512)
    assert [s.rejected for s in fitted] == [False, True, False]
    assert fitted[2].output_len == 12  # capped: max_model_len - prompt
    assert (report.rejected, report.outputs_capped, report.clipped) == (1, 1, 0)
    clipped, report = fit_to_model_len(specs, 512, clip=True)
    assert not any(s.rejected for s in clipped)
    assert clipped[1].input_len + clipped[1].output_len <= 512
    assert (report.rejected, report.clipped) == (0, 1)


def test_tiny_max_model_len_rejects_instead_of_shrinking_prompts(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["bench", "--max-model-len", "10", "--num-requests", "20",
                 "--policy", "seed", "--no-progress", "--json", str(out)]) == 0  # fmt: skip
    document = json.loads(out.read_text())
    run = document["runs"][0]
    assert run["failed"] == document["settings"]["fit_to_model_len"]["rejected"] == 20
    assert run["completed"] == 0
    assert "Failed requests:" in capsys.readouterr().out


def test_actual_context_profiles_charge_decodes_at_the_rows_own_context():
    """A CPU static-shape profile (attention reads each sequence's own
    context): a decode step is charged at its real rows' mean context,
    interpolated between the profile's samples, not at the bucket."""
    base = synthetic_profile()
    timings = [t for t in base.timings if t.kind is StepKind.PREFILL] + [
        StepTiming(StepKind.DECODE, 2, context, (seconds,), rows=2)
        for context, seconds in ((64, 0.002), (256, 0.004), (512, 0.008))
    ]
    profile = Profile(
        base.platform, base.model, base.engine, base.neuron_config, base.kv_cache,
        tuple(timings), meta={"decode_context": "actual"},
    )  # fmt: skip
    cost = ProfileCostModel(profile)
    shape = StepShape((), 2, 512, True, decode_context_actual=160)
    assert cost.step_time(shape) == pytest.approx(0.003)
    assert cost.missing_shapes([128], [2, 4], [512]) == ["decode of 4 rows"]
    bucket_model = ProfileCostModel(synthetic_profile())
    assert bucket_model.step_time(StepShape((), 2, 512, True, 160)) == 0.003


def test_dummy_decode_rows_are_charged_no_context_where_attention_is_actual():
    """4 rows profiled at contexts 0.4k-1.6k: 2 ms + 1 us per row per
    position. A step of 1 real row padded to 4 costs the 4-row time less
    what the 3 dummy rows would have read, never below the dense part."""
    base = synthetic_profile()
    timings = [t for t in base.timings if t.kind is StepKind.PREFILL] + [
        StepTiming(StepKind.DECODE, 4, context, (0.002 + 4e-6 * context,), rows=4)
        for context in (400, 800, 1600)
    ]
    profile = Profile(
        base.platform, base.model, base.engine, base.neuron_config, base.kv_cache,
        tuple(timings), meta={"decode_context": "actual"},
    )  # fmt: skip
    cost = ProfileCostModel(profile)
    full = StepShape((), 4, 2048, True, decode_context_actual=1000)
    assert cost.step_time(full) == pytest.approx(0.002 + 4e-6 * 1000)
    one_real = StepShape((), 4, 2048, True, 1000, decode_rows_actual=1)
    assert cost.step_time(one_real) == pytest.approx(0.002 + 1e-6 * 1000)
    # A static graph (bucket-context profile) computes dummy rows in full.
    bucket_model = ProfileCostModel(synthetic_profile())
    assert bucket_model.step_time(
        StepShape((), 2, 512, True, 160, decode_rows_actual=1)
    ) == bucket_model.step_time(StepShape((), 2, 512, True, 160))


def _fill_profile(prefill_fill: str) -> Profile:
    """The synthetic profile with the 256-token bucket also timed at 129
    real tokens at context 0: 0.020 s full, 0.012 s then (62.0 us a token)."""
    base = synthetic_profile()
    least = StepTiming(StepKind.PREFILL, 256, 0, (0.012,), tokens_actual=129)
    return Profile(
        base.platform, base.model, base.engine, base.neuron_config, base.kv_cache,
        (*base.timings, least), meta={"prefill_fill": prefill_fill},
    )  # fmt: skip


def test_actual_fill_profiles_charge_a_prefill_its_real_tokens():
    """Where attention runs real tokens only, a prompt that fills its
    bucket less costs less: the bucket's time less its per-token saving
    times the tokens short; flat below the least fill sampled, and the
    full bucket as profiled. After a context, the real tokens' share of
    what that context adds to the full bucket is added."""
    cost = ProfileCostModel(_fill_profile("actual"))
    per_token = (0.020 - 0.012) / (256 - 129)

    def charge(actual: int, before: int = 0) -> float:
        return cost.step_time(StepShape(((256, before),), prefill_tokens_actual=actual))

    assert charge(256) == pytest.approx(0.020)
    assert charge(0) == pytest.approx(0.020)  # not recorded: the bucket full
    assert charge(200) == pytest.approx(0.020 - per_token * 56)
    assert charge(129) == pytest.approx(0.012)
    assert charge(50) == pytest.approx(0.012)
    reading = 0.028 - 0.020  # what 256 tokens before add to the full bucket
    assert charge(200, before=256) == pytest.approx(
        0.020 - per_token * 56 + reading * 200 / 256
    )
    assert charge(256, before=256) == pytest.approx(0.028)
    assert charge(50, before=256) == pytest.approx(0.012 + reading * 50 / 256)
    assert charge(200, before=128) == pytest.approx(
        0.020 - per_token * 56 + reading / 2 * 200 / 256
    )
    # A bucket sampled at one fill only is charged whole.
    assert cost.step_time(StepShape(((128, 0),), prefill_tokens_actual=10)) == 0.010


def test_the_simulator_charges_a_prompt_its_real_tokens():
    """One 200-token prompt (the 256 bucket), 3 tokens: its prefill step
    is charged at 200 real tokens, then two 1-row decodes."""
    cost = ProfileCostModel(_fill_profile("actual"))
    result = simulate([RequestSpec(0.0, 200, 3)], SEED, SETTINGS, cost)
    prefill = 0.020 - (0.020 - 0.012) / (256 - 129) * 56
    assert result.duration_s == pytest.approx(prefill + 2 * 0.002)


def test_a_bucket_fill_profile_charges_the_bucket_whatever_its_fill():
    """A compiled graph runs its padding too: without ``prefill_fill ==
    "actual"`` the least-filled samples neither lower a step's charge nor
    stand in for the bucket full."""
    for profile in (_fill_profile("bucket"), synthetic_profile()):
        cost = ProfileCostModel(profile)
        for actual in (0, 129, 200, 256):
            shape = StepShape(((256, 0),), prefill_tokens_actual=actual)
            assert cost.step_time(shape) == pytest.approx(0.020)


def test_a_least_fill_that_cost_more_saves_nothing():
    base = _fill_profile("actual")
    slow = tuple(
        replace(t, samples_s=(0.025,)) if t.tokens_actual == 129 else t
        for t in base.timings
    )
    cost = ProfileCostModel(replace(base, timings=slow))
    shape = StepShape(((256, 0),), prefill_tokens_actual=150)
    assert cost.step_time(shape) == pytest.approx(0.020)


def test_a_polling_client_sends_on_its_own_grid():
    """One slot, a client that pauses 1 ms after each send and looks for a
    free slot every 100 ms (guidellm 0.1's throughput loop): the second
    request goes at the first look after the first one finished."""
    specs = [RequestSpec(0.0, 100, 3), RequestSpec(0.0, 100, 3)]
    pacing = ClientPacing(send_gap_s=0.001, poll_s=0.1)
    cost = ProfileCostModel(synthetic_profile())
    result = simulate(specs, SEED, SETTINGS, cost, max_concurrency=1, pacing=pacing)
    first, second = result.records
    # 128-token prefill, then two 1-row decodes.
    assert first.finish_s == pytest.approx(0.010 + 2 * 0.002)
    looks = math.ceil((first.finish_s - 0.001) / 0.1)
    assert second.arrival_s == pytest.approx(0.001 + looks * 0.1)
    eager = simulate(specs, SEED, SETTINGS, cost, max_concurrency=1)
    assert eager.records[1].arrival_s == pytest.approx(first.finish_s)


@pytest.mark.parametrize("field", ["send_gap_s", "poll_s"])
def test_client_pacing_refuses_negative_times(field):
    with pytest.raises(ValueError, match=f"{field} must be >= 0, got -0.1"):
        ClientPacing(**{field: -0.1})
