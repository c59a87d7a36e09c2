"""How served decode steps vary about the machine's speed of the moment:
measured from a step log by the calibration, charged step by step by the
refitted profile, and what it does to a simulated run's inter-token
latency."""

import json
from dataclasses import replace

import numpy as np
import pytest

from helpers import load_script
from neuron_scheduler.cli import main
from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.calibration import (
    Calibration,
    FitMethod,
    StepFit,
    calibrated,
    fit,
    line_shape,
    scaled,
)
from neuron_scheduler.sim.cost_model import StepShape
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.step_jitter import (
    QUANTILES,
    STRATA,
    JitterDraws,
    StepJitter,
)
from test_cost_profile import synthetic_profile

#: Served over fitted time at the window's speed, in turn, for each step.
FACTORS = (0.8, 0.9, 1.0, 1.1, 1.6)


def test_the_jitter_is_each_step_over_its_windows_speed():
    mean = np.mean(FACTORS)
    steps = [(0.1 * i, 1.0, 1.0 * f) for i, f in enumerate(FACTORS)]
    # The machine twice as slow a window later: the same jitter about it.
    steps += [(1.0 + 0.1 * i, 1.0, 2.0 * f) for i, f in enumerate(FACTORS)]
    # No time served (all of it a connector's, taken off): left out.
    steps += [(1.05, 1.0, 0.0), (1.15, 1.0, -0.2)]
    # Too few steps to tell their window's speed: left out.
    steps += [(2.0, 1.0, 10.0), (2.1, 1.0, 0.1)]
    jitter = StepJitter.about_windows(steps, window_s=1.0)
    assert len(jitter.quantiles) == QUANTILES
    assert list(jitter.quantiles) == sorted(jitter.quantiles)
    assert jitter.quantiles[0] == pytest.approx(0.8 / mean, abs=1e-4)
    assert jitter.quantiles[-1] == pytest.approx(1.6 / mean, abs=1e-4)
    assert jitter.quantile(0.5) == pytest.approx(1.0 / mean, abs=1e-4)
    # Pooled without windows, the speed's doubling would be jitter too.
    pooled = StepJitter.about_windows(steps[:12], window_s=100.0)
    assert pooled.quantiles[-1] / pooled.quantiles[0] == pytest.approx(4.0, rel=1e-3)
    assert not StepJitter.about_windows(steps[-2:], window_s=1.0)
    with pytest.raises(ValueError, match="window_s=0"):
        StepJitter.about_windows(steps, window_s=0)


def test_each_block_of_draws_takes_one_factor_from_each_stratum():
    jitter = StepJitter(tuple(np.linspace(0.5, 1.5, QUANTILES)))
    draws = JitterDraws(jitter, seed=3)
    block = [draws() for _ in range(STRATA)]
    assert np.mean(block) == pytest.approx(1.0, abs=0.5 / STRATA)
    for stratum, factor in enumerate(sorted(block)):
        low, high = (jitter.quantile(s / STRATA) for s in (stratum, stratum + 1))
        assert low <= factor <= high
    assert block != sorted(block)  # in a random order, not the quantiles'
    # Seeded: another stream of the same seed draws the same factors.
    again = JitterDraws(jitter, seed=3)
    assert [again() for _ in range(STRATA)] == block
    other = JitterDraws(jitter, seed=4)
    assert [other() for _ in range(STRATA)] != block
    assert {JitterDraws(StepJitter())() for _ in range(3)} == {1.0}


def _varied_log(profile):
    """A step log of one request: a prefill at its profiled time every tenth
    step, decodes at their profiled time times ``FACTORS`` in turn times the
    machine's speed, 1.2 for the first 60 s and 2.0 after."""
    cost = ProfileCostModel(profile, interpolate=True)
    lines, t = [], 0.0
    for i in range(400):
        if i % 10 == 0:
            line = {"kind": "prefill", "ids": ["r"], "chunks": [[128, 0]]}
            factor = 1.0
        else:
            rows = (1, 2, 4)[i % 3]
            line = {"kind": "decode", "ids": ["r"], "rows": rows, "context": 512,
                    "rows_actual": rows, "context_actual": 300.0}  # fmt: skip
            factor = (1.2 if t < 60 else 2.0) * FACTORS[i % len(FACTORS)]
        lines.append({"t": t, **line})
        t += factor * cost.estimate(line_shape(lines[-1]))
    lines.append({"t": t, "kind": "empty", "ids": ["r"]})
    return lines


def _slow_profile() -> Profile:
    """The synthetic profile at 100x its times: decode steps of 0.2-0.5 s,
    a few tens of them in each 10-s window."""
    return scaled(synthetic_profile(), 100.0)


def test_the_fit_keeps_the_decode_steps_jitter_about_their_windows():
    profile = _slow_profile()
    calibration = fit(profile, _varied_log(profile))
    decode, prefill = calibration.decode_steps, calibration.prefill_steps
    mean = np.mean(FACTORS)
    # Within a tenth: a window of a dozen steps holds a part of the cycle.
    assert decode.jitter[0] == pytest.approx(0.8 / mean, rel=0.1)
    assert decode.jitter[-1] == pytest.approx(1.6 / mean, rel=0.1)
    # The speed's move from 1.2 to 2.0 is not taken for jitter: about 2,
    # where pooled over the run it would be 3.3 (0.8 x 1.2 to 1.6 x 2.0).
    assert decode.jitter[-1] / decode.jitter[0] < 2.6
    assert prefill.jitter == ()  # prefill steps are never drawn


def test_a_refitted_profile_charges_each_decode_step_a_drawn_factor(tmp_path):
    profile = _slow_profile()
    path = tmp_path / "calibrated.json"
    calibrated(profile, fit(profile, _varied_log(profile))).save(path)
    refitted = Profile.load(path)  # the jitter travels with the profile
    decode = StepShape((), 2, 512, True, 300.0, 2)
    cost = ProfileCostModel(refitted)
    typical = cost.estimate(decode)
    charged = np.array([cost.step_time(decode) for _ in range(20 * STRATA)])
    assert cost.estimate(decode) == typical  # never drawn
    assert charged.mean() == pytest.approx(typical, rel=0.01)
    assert charged.max() / charged.min() > 1.8
    # Seeded afresh for each model: another model charges the same times.
    again = ProfileCostModel(refitted)
    assert [again.step_time(decode) for _ in range(STRATA)] == list(charged[:STRATA])
    prefill = StepShape(((128, 0),))
    assert {cost.step_time(prefill) for _ in range(50)} == {cost.estimate(prefill)}
    # The profile as measured charges every step its median.
    plain = ProfileCostModel(profile)
    assert {plain.step_time(decode) for _ in range(50)} == {plain.estimate(decode)}


def test_the_jitter_widens_the_simulated_inter_token_tail(tmp_path):
    profile = synthetic_profile()
    measured = fit(_slow_profile(), _varied_log(_slow_profile())).decode_steps
    runs = {}
    for label, jitter in (("drawn", measured.jitter), ("none", ())):
        # The profile's own times, each decode step drawn about them or not.
        kept = StepFit(1.0, 0.0, 0, 1.0, FitMethod.KEPT)
        refit = Calibration(kept, StepFit(1.0, 0.0, 40, 1.0, jitter=jitter))
        path, out = tmp_path / f"{label}.json", tmp_path / f"bench-{label}.json"
        calibrated(profile, refit).save(path)
        # Long outputs: few of the gaps between tokens hold a prefill.
        assert main(["bench", "--cost-profile", str(path), "--num-requests", "8",
                     "--random-input-len", "120", "--random-output-len", "300",
                     "--request-rate", "4", "--policy", "seed", "--no-progress",
                     "--json", str(out)]) == 0  # fmt: skip
        runs[label] = json.loads(out.read_text())["runs"][0]
    drawn, steady = runs["drawn"], runs["none"]
    # Mean 1: the mean step holds; the inter-token tail widens.
    for key in ("mean_itl_ms", "mean_tpot_ms"):
        assert drawn[key] == pytest.approx(steady[key], rel=0.03), key
    assert drawn["p99_itl_ms"] > 1.2 * steady["p99_itl_ms"]


def test_a_saved_run_is_rebuilt_with_the_refit_drawn_or_as_it_was_before():
    saved_run = load_script("saved_run.py")
    profile = _slow_profile()
    drawn, steady = saved_run.validates_refits(profile, _varied_log(profile))
    assert ProfileCostModel(drawn).decode_jitter
    assert not ProfileCostModel(steady).decode_jitter
    # The same fit either way; only the draws differ.
    assert drawn.timings == steady.timings
    calibration = fit(profile, _varied_log(profile))
    assert saved_run.without_jitter(calibration).decode_steps == replace(
        calibration.decode_steps, jitter=()
    )


def test_the_compile_budget_prices_shapes_at_their_mean_never_drawn():
    """``tune --cost-profile`` with a refitted profile: the frontier's
    seconds are each shape's mean step time, as the same fit undrawn gives
    them, and the drawn step times are left to the simulation."""
    from neuron_scheduler.sim.compile_budget import CompileSeconds, pareto_frontier

    profile = _slow_profile()
    refit = fit(profile, _varied_log(profile))
    steady = replace(refit, decode_steps=replace(refit.decode_steps, jitter=()))

    def frontier(calibration):
        return pareto_frontier(
            [100, 200] * 10, [(1, 300), (2, 300), (3, 300)] * 20,
            ProfileCostModel(calibrated(profile, calibration)),
            CompileSeconds(20, 40), maxima=(256, 4, 512), max_counts=(2, 3, 1),
            alignment=(128, 1, 512),
        )  # fmt: skip

    drawn, undrawn = frontier(refit), frontier(steady)
    assert len(drawn) > 1
    assert [row.step_seconds for row in drawn] == pytest.approx(
        [row.step_seconds for row in undrawn], rel=1e-12
    )
    cost = ProfileCostModel(calibrated(profile, refit))
    decode = StepShape((), 4, 512, True, 300.0, 3)
    assert {cost.mean_step_time(decode) for _ in range(50)} == {cost.estimate(decode)}
    assert len({cost.step_time(decode) for _ in range(50)}) > 1
