"""scripts/level-timeline.py: each side's steps and request times."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import pytest

from helpers import load_script
from neuron_scheduler.cli import build_parser
from neuron_scheduler.cli.validate import validate_options
from neuron_scheduler.offline.engine_spec import EngineSpec
from neuron_scheduler.sim import engines
from neuron_scheduler.sim.validation_plan import simulate_level
from neuron_scheduler.sim.workload import build_workload
from test_cost_profile import synthetic_profile

#: The engine of ``synthetic_profile``'s shapes.
ENGINE = EngineSpec("m", 512, 256, 4, 64 << 20)


def _eight_requests(rate: float):
    """Eight of the built-in workload's requests at ``rate`` req/s."""
    argv = ["validate", "--model", "m", "--random-input-len", "100",
            "--random-output-len", "12"]  # fmt: skip
    options = validate_options(build_parser(["validate"]).parse_args(argv))
    specs, _ = build_workload(
        replace(options.workload, num_requests=8, request_rate=rate),
        ENGINE.max_model_len,
    )
    return specs


def _script():
    return load_script("level-timeline.py")


def _steps_at_once(script, *charging):
    """The steps of ``_eight_requests`` sent at once, simulated with the
    synthetic profile inside ``charging`` (context managers of the script)
    and traced."""
    steps = []
    with contextlib.ExitStack() as stack:
        for manager in charging:
            stack.enter_context(manager)
        stack.enter_context(script.traced(steps))
        simulate_level(ENGINE, synthetic_profile(), _eight_requests(math.inf), None)
    return steps


def _line(t, kind, ids):
    return {"t": t, "kind": kind, "ids": [f"cmpl-validate-{i}-0-ab12" for i in ids]}


def test_a_servers_step_ends_where_the_next_line_starts():
    script = _script()
    lines = [
        _line(10.0, "prefill", [0]),
        _line(11.0, "prefill", [0]),  # its second chunk: the first token
        _line(11.5, "decode", [0]),
        _line(11.6, "empty", []),  # out of work: the decode ended here
        _line(14.0, "prefill", [1]),
        _line(15.0, "decode", [1]),
        _line(15.2, "decode", [1]),  # the last line: no end, left out
    ]
    steps = script.server_steps(lines)
    assert [(s.start_s, s.prefill, s.requests) for s in steps] == [
        (0.0, True, (0,)),
        (1.0, True, (0,)),
        (1.5, False, (0,)),
        (4.0, True, (1,)),
        (5.0, False, (1,)),
    ]
    times = script.request_times(steps)
    assert (times[0].first_s, times[0].first_token_s) == (0.0, 1.5)
    assert times[0].end_s == pytest.approx(1.6)
    assert (times[1].first_s, times[1].first_token_s) == (4.0, 5.0)
    assert times[1].end_s == pytest.approx(5.2)


def test_the_traced_simulation_gives_each_requests_recorded_times():
    script = _script()
    specs = _eight_requests(2.0)
    trace = []
    charge = engines.Replica._charge
    with script.traced(trace):
        run, _ = simulate_level(ENGINE, synthetic_profile(), specs, None)
    assert engines.Replica._charge is charge
    times = script.request_times(trace)
    assert sorted(times) == list(range(len(specs)))
    for number, record in enumerate(run.records):
        assert times[number].first_token_s == pytest.approx(record.first_token_s)
        assert times[number].end_s == pytest.approx(record.finish_s)
        assert times[number].first_s >= record.arrival_s
    # Prefill and decode never in one step, and the steps back to back.
    assert any(s.prefill for s in trace) and not all(s.prefill for s in trace)
    for step, after in zip(trace, trace[1:], strict=False):
        assert after.start_s >= step.start_s + step.seconds - 1e-9


def test_a_window_paced_slower_slows_only_the_steps_that_start_in_it():
    script = _script()
    plain = _steps_at_once(script)
    window_s = (plain[-1].start_s + plain[-1].seconds) / 2  # two windows
    served = {1: {False: [(0.3, 0.1), (0.1, 0.1), (0.2, 0.1)], True: [(2.0, 1.0)]}}
    # Their time's factor, not a typical step's; too few prefills to pace.
    assert script.window_factors(served) == {1: {False: pytest.approx(2.0)}}
    twice = {window: {False: 2.0, True: 2.0} for window in range(1, 8)}
    paced = _steps_at_once(script, script.paced(twice, window_s))
    # Sent at once, the schedule does not depend on the clock.
    assert [s.requests for s in paced] == [s.requests for s in plain]
    for before, after in zip(plain, paced, strict=True):
        slower = after.start_s >= window_s
        assert after.seconds == pytest.approx(before.seconds * (2 if slower else 1))


def test_a_decode_step_varies_about_its_windows_speed():
    script = _script()
    speed = {
        0: {False: [(2.0, 1.0), (1.0, 1.0)], True: [(5.0, 1.0)]},
        1: {False: [(3.0, 1.0)]},  # no factor: left out
    }
    factors = {0: {False: 1.5, True: 5.0}}
    assert script.decode_residuals(speed, factors) == pytest.approx([4 / 3, 2 / 3])


def test_a_jittered_simulation_draws_for_decode_steps_only():
    script = _script()
    plain = _steps_at_once(script)
    doubled = _steps_at_once(script, script.jittered([2.0], seed=0))
    assert [s.requests for s in doubled] == [s.requests for s in plain]
    for before, after in zip(plain, doubled, strict=True):
        factor = 1 if before.prefill else 2
        assert after.seconds == pytest.approx(factor * before.seconds)
