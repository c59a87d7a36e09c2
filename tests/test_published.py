"""The roofline model and the simulator against published Neuron vLLM runs."""

import pytest

from neuron_scheduler.sim.cost_model import StepShape
from neuron_scheduler.sim.published import (
    INF2_TP8_CLI_DP2,
    POINTS,
    emulated_workload,
    format_rows,
    guidellm_metrics,
    simulate_point,
    sync_requests,
)
from neuron_scheduler.sim.records import RequestRecord
from neuron_scheduler.sim.step_shapes import graph_per_phase_shapes, power_of_two_bucket
from neuron_scheduler.step import ScheduledRequest


@pytest.mark.parametrize("point", POINTS, ids=[p.label for p in POINTS])
def test_published_points_within_15_percent(point):
    simulated = simulate_point(point)
    for key in ("ttft_ms", "itl_ms", "output_tok_s"):
        published = getattr(point, key)
        error = simulated[key] / published - 1
        assert abs(error) <= 0.15, (key, published, simulated[key])


def test_guidellm_metrics_are_its_means_over_completed_requests():
    done = [
        # sent at 0, first token at 1 s, 11 tokens by 3 s
        RequestRecord(0.0, 100, 11, first_token_s=1.0, finish_s=3.0, num_tokens=11),
        # sent at 2 s, first token at 2.5 s, 5 tokens by 4 s
        RequestRecord(2.0, 100, 5, first_token_s=2.5, finish_s=4.0, num_tokens=5),
    ]
    metrics = guidellm_metrics(done)
    assert metrics["ttft_ms"] == pytest.approx(1e3 * (1.0 + 0.5) / 2)
    # Token gaps pooled: (2 s + 1.5 s) over (10 + 4) gaps.
    assert metrics["itl_ms"] == pytest.approx(1e3 * 3.5 / 14)
    # From the first completed request's start (0 s) to the last end (4 s).
    assert metrics["output_tok_s"] == pytest.approx(16 / 4.0)


def test_power_of_two_buckets_stop_at_max_model_len():
    assert [power_of_two_bucket(n, 4096) for n in (1, 128, 129, 1500, 4096)] == [
        128,
        128,
        256,
        2048,
        4096,
    ]
    assert power_of_two_bucket(3000, 3000) == 3000


def test_graph_per_phase_runs_the_whole_batch_then_each_prompt_alone():
    step = [
        ScheduledRequest("a", 1800, 1500, 1),  # decode at context 1801
        ScheduledRequest("b", 100, 90, 1),
        ScheduledRequest("c", 0, 1500, 1500),  # whole prompt, no chunking
        ScheduledRequest("d", 0, 200, 200),
    ]
    assert graph_per_phase_shapes(step, 32, 4096) == [
        StepShape((), 32, 2048),
        StepShape(((2048, 0),)),
        StepShape(((256, 0),)),
    ]
    assert graph_per_phase_shapes(step[2:], 32, 4096) == [
        StepShape(((2048, 0),)),
        StepShape(((256, 0),)),
    ]


def test_emulated_workload_matches_guidellm_parameters():
    closed = emulated_workload(POINTS[2])  # 32 users, 235 tokens per request
    # A sweep's throughput benchmark: 5 x the 22 synchronous requests
    # (0.184 req/s over the 120 s window), all ready at once.
    assert sync_requests(POINTS[2].run) == 22
    # A data-parallel run's synchronous row is not a point: its rate is kept.
    assert sync_requests(INF2_TP8_CLI_DP2) == 16
    assert len(closed) == 5 * 22 and {s.arrival_s for s in closed} == {0.0}
    assert all(1350 <= s.input_len <= 1650 for s in closed)
    assert all(215 <= s.output_len <= 255 for s in closed)
    open_loop = emulated_workload(POINTS[1])  # 2.46 req/s, constant
    arrivals = [s.arrival_s for s in open_loop]
    gaps = [
        later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)
    ]
    assert gaps == pytest.approx([1 / 2.46] * (len(open_loop) - 1))


def test_table_names_every_point_and_marks_calibration():
    rows = [
        {
            "run": p.run.name,
            "load": p.load,
            "calibrates": p.calibrates,
            "published": {"ttft_ms": 1.0, "itl_ms": 1.0, "output_tok_s": 1.0},
            "simulated": {"ttft_ms": 1.1, "itl_ms": 0.9, "output_tok_s": 1.0},
            "relative_error": {"ttft_ms": 0.1, "itl_ms": -0.1, "output_tok_s": 0.0},
        }
        for p in POINTS
    ]
    table = format_rows(rows)
    assert table.count("\n") == len(POINTS) + 1
    assert table.count("(calibration)") == sum(p.calibrates for p in POINTS)
    assert "(+10%)" in table and "(-10%)" in table
