"""Decode batches split by context: the rule, its break-even from a cost
model, and what it buys in the simulator on traffic with long outliers."""

import dataclasses

import pytest

from neuron_scheduler.decode_groups import positions_read, shorter_group_size
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.sim.cost_model import StepShape
from neuron_scheduler.sim.decode_split import break_even_positions
from neuron_scheduler.sim.policies import Policy
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.run_setup import EngineChoice, engine_setup
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.workload import WorkloadOptions, build_workload

SEQS = (1, 2, 4, 8)
CONTEXTS = (256, 1024, 4096)


def test_positions_read_are_padded_rows_times_the_context_bucket():
    assert positions_read(3, 300, SEQS, CONTEXTS) == 4 * 1024
    assert positions_read(8, 4096, SEQS, CONTEXTS) == 8 * 4096


def test_the_split_reads_the_fewest_positions_and_must_beat_the_break_even():
    contexts = [100, 120, 200, 250, 900, 3000]
    # One step: 8 x 4096 = 32768. Best split: 4 x 256 + 2 x 4096 = 9216.
    assert shorter_group_size(contexts, SEQS, CONTEXTS, 1) == 4
    assert shorter_group_size(contexts, SEQS, CONTEXTS, 32768 - 9216 - 1) == 4
    assert shorter_group_size(contexts, SEQS, CONTEXTS, 32768 - 9216) == 0


def test_no_split_of_one_row_or_of_rows_in_one_bucket():
    assert shorter_group_size([3000], SEQS, CONTEXTS, 1) == 0
    assert shorter_group_size([2000, 3000, 3500, 4000], SEQS, CONTEXTS, 1) == 0
    # Rows in one bucket still split when that drops a padded row: 3 rows
    # pad to 4 (16384 positions), 1 + 2 rows read 12288.
    assert shorter_group_size([2000, 3000, 4000], SEQS, CONTEXTS, 1) == 1


def test_break_even_is_the_fixed_cost_of_a_decode_step_in_kv_positions():
    cost, settings = engine_setup(EngineChoice(max_model_len=131072))
    break_even = break_even_positions(cost, settings)
    # The roofline's decode step is memory-bound: fixed bytes (the weights)
    # plus the fixed seconds (launch, collectives of its rows) at the
    # achieved bandwidth, over the KV bytes of one position.
    hw = cost.hardware
    per_second = cost.bandwidth * hw.bandwidth_efficiency
    rows = settings.max_num_seqs
    fixed_s = hw.step_overhead_s + cost.collective_seconds(rows)
    expected = (cost.model.weight_bytes + fixed_s * per_second) / (
        cost.model.kv_bytes_per_token
    )
    assert break_even == pytest.approx(expected, rel=0.01)
    # And it is what separates one step from two: a row at 0 context costs
    # one step's fixed part; break-even positions cost the same again.
    one = cost.estimate(StepShape((), rows, 1.0, True, 1.0, rows))
    more = cost.estimate(StepShape((), rows, 1.0 + break_even / rows, True, 1.0, rows))
    assert more == pytest.approx(2 * one, rel=0.02)


def test_a_cost_model_whose_decode_does_not_grow_with_context_is_refused():
    class Flat:
        def estimate(self, shape):
            return 0.01

    cost, settings = engine_setup(EngineChoice())
    with pytest.raises(ValueError, match="does not grow with context"):
        break_even_positions(Flat(), settings)


def test_splitting_pays_on_traffic_with_long_outliers():
    cost, settings = engine_setup(EngineChoice(max_model_len=131072))
    options = WorkloadOptions(num_requests=120, seed=7, request_rate=float("inf"))
    specs = build_workload(options, settings.max_model_len)[0]
    # One request in 20 is a 40k-token document beside the chat traffic.
    specs = [
        dataclasses.replace(s, input_len=40_000) if i % 20 == 0 else s
        for i, s in enumerate(specs)
    ]
    # Reserve admission: enough requests run for their contexts to differ.
    config = {
        "kv_admission": "reserve",
        "decode_context_length_buckets": [4096, 8192, 16384, 65536, 131072],
    }
    split = {
        **config,
        "decode_split_break_even_positions": break_even_positions(cost, settings),
    }
    plain, halves = (
        compute_metrics(simulate(specs, Policy(n, NeuronScheduler, c), settings, cost))
        for n, c in (("plain", config), ("split", split))
    )
    assert halves["completed"] == plain["completed"] == len(specs)
    assert halves["output_throughput"] > 1.2 * plain["output_throughput"]
    assert halves["mean_tpot_ms"] < plain["mean_tpot_ms"]
    assert halves["decode_steps"] > plain["decode_steps"]
