"""How served steps vary about their shape's typical time: measured from a
step log by the calibration, charged step by step by the refitted profile,
and what it does to a simulated run's inter-token latency."""

import json
from dataclasses import replace

import numpy as np
import pytest

from neuron_scheduler.cli import main
from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.calibration import calibrated, fit, line_shape
from neuron_scheduler.sim.cost_model import StepShape
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.step_jitter import (
    MIN_STEPS_A_SHAPE,
    QUANTILES,
    StepJitter,
)
from test_cost_profile import synthetic_profile

#: Served over typical, in turn, for each decode step of a shape.
FACTORS = (0.8, 0.9, 1.0, 1.1, 1.6)


def test_the_jitter_pools_each_shapes_steps_over_its_median():
    steps = [("a", 0.020 * f) for f in FACTORS * 4]
    steps += [("b", 0.050 * f) for f in FACTORS * 4]
    # Too few to tell their shape's typical time: left out.
    steps += [("c", 0.5), ("c", 5.0)]
    jitter = StepJitter.of_steps(steps)
    assert len(jitter.quantiles) == QUANTILES
    assert list(jitter.quantiles) == sorted(jitter.quantiles)
    mean = np.mean(FACTORS)  # each shape's median is its 1.0 step
    assert jitter.quantiles[0] == pytest.approx(0.8 / mean)
    assert jitter.quantiles[-1] == pytest.approx(1.6 / mean)
    assert jitter.quantile(0.5) == pytest.approx(1.0 / mean)
    draws = np.random.default_rng(1)
    assert np.mean([jitter.draw(draws) for _ in range(20_000)]) == pytest.approx(
        1.0, abs=0.01
    )
    few = [("a", 0.02)] * (MIN_STEPS_A_SHAPE - 1)
    assert not StepJitter.of_steps(few)
    assert StepJitter(()).draw(draws) == 1.0


def _varied_log(profile):
    """Alternating prefill and decode steps of one request: prefills at
    their profiled time, decodes at 1.2 x theirs times ``FACTORS`` in turn."""
    cost = ProfileCostModel(profile, interpolate=True)
    lines, t = [], 0.0
    for i in range(300):
        if i % 2:
            rows = (1, 2, 4)[i // 2 % 3]
            line = {"kind": "decode", "ids": ["r"], "rows": rows, "context": 512,
                    "rows_actual": rows, "context_actual": 300.0}  # fmt: skip
            factor = 1.2 * FACTORS[i // 6 % len(FACTORS)]
        else:
            line = {"kind": "prefill", "ids": ["r"], "chunks": [[128, 0]]}
            factor = 1.0
        lines.append({"t": t, **line})
        t += factor * cost.estimate(line_shape(lines[-1]))
    lines.append({"t": t, "kind": "empty", "ids": ["r"]})
    return lines


def test_a_refitted_profile_charges_each_decode_step_a_drawn_factor(tmp_path):
    profile = synthetic_profile()
    calibration = fit(profile, _varied_log(profile))
    decode, prefill = calibration.decode_steps, calibration.prefill_steps
    mean = np.mean(FACTORS)
    assert decode.jitter[0] == pytest.approx(0.8 / mean)
    assert decode.jitter[-1] == pytest.approx(1.6 / mean)
    # Every prefill took its typical time: no spread about it.
    assert prefill.jitter[0] == pytest.approx(1.0)
    assert prefill.jitter[-1] == pytest.approx(1.0)
    path = tmp_path / "calibrated.json"
    calibrated(profile, calibration).save(path)
    refitted = Profile.load(path)  # the jitter travels with the profile
    shape = StepShape((), 2, 512, True, 300.0, 2)
    cost = ProfileCostModel(refitted)
    charged = np.array([cost.step_time(shape) for _ in range(20_000)])
    typical = cost.estimate(shape)  # never drawn
    assert cost.estimate(shape) == typical
    assert charged.mean() == pytest.approx(typical, rel=0.01)
    assert charged.min() == pytest.approx(typical * 0.8 / mean, rel=0.01)
    assert charged.max() == pytest.approx(typical * 1.6 / mean, rel=0.01)
    # Seeded: another model of the profile charges the same times.
    again = ProfileCostModel(refitted)
    assert [again.step_time(shape) for _ in range(100)] == list(charged[:100])
    # The profile as measured charges every step its median.
    plain = ProfileCostModel(profile)
    assert {plain.step_time(shape) for _ in range(100)} == {plain.estimate(shape)}


def test_the_jitter_widens_the_simulated_inter_token_tail(tmp_path):
    profile = synthetic_profile()
    calibration = fit(profile, _varied_log(profile))
    steady = replace(
        calibration,
        prefill_steps=replace(calibration.prefill_steps, jitter=()),
        decode_steps=replace(calibration.decode_steps, jitter=()),
    )
    runs = {}
    for label, refit in (("jitter", calibration), ("none", steady)):
        path, out = tmp_path / f"{label}.json", tmp_path / f"bench-{label}.json"
        calibrated(profile, refit).save(path)
        # Long outputs: few of the gaps between tokens hold a prefill.
        assert main(["bench", "--cost-profile", str(path), "--num-requests", "8",
                     "--random-input-len", "120", "--random-output-len", "300",
                     "--request-rate", "4", "--policy", "seed", "--no-progress",
                     "--json", str(out)]) == 0  # fmt: skip
        runs[label] = json.loads(out.read_text())["runs"][0]
    jittered, steady_run = runs["jitter"], runs["none"]
    # Mean 1: a step's mean holds; the inter-token tail widens.
    for key in ("mean_itl_ms", "mean_tpot_ms"):
        assert jittered[key] == pytest.approx(steady_run[key], rel=0.05), key
    assert jittered["p99_itl_ms"] > 1.2 * steady_run["p99_itl_ms"]
