"""Robust tuning: buckets for the traffic a sample stands for (a tail model
and a ladder), against the sample's exact optimum on fresh samples."""

import math
import random

import pytest

from neuron_scheduler.buckets import optimal_buckets, padding_cost
from neuron_scheduler.cli import main
from neuron_scheduler.sim.robust_buckets import (
    MAX_LADDER_RATIO,
    ladder_sizes,
    robust_buckets,
    tail_model,
)

MAXIMUM = 131072


def _sample(n, seed):
    """Contexts like the built-in workload's: log-normal, median ~1150."""
    rng = random.Random(seed)
    return [
        min(MAXIMUM, max(1, round(rng.lognormvariate(7.05, 0.8)))) for _ in range(n)
    ]


def test_no_cliff_above_the_sample_and_within_the_count():
    values = _sample(300, 1)
    ones = [1.0] * len(values)
    exact = optimal_buckets(values, ones, 8, MAXIMUM, 32)
    assert exact[-2] <= max(values) + 31  # the cliff robust tuning removes
    assert MAXIMUM / exact[-2] > MAX_LADDER_RATIO
    for count in (4, 6):  # the ladder gets a quarter of the count: one bucket
        buckets = robust_buckets(values, ones, count, MAXIMUM, align=32)
        above = [b for b in buckets if b >= max(values)]
        assert len(above) >= 2  # a ladder bucket above the sample, the maximum
        ratios = [hi / lo for lo, hi in zip(above, above[1:], strict=False)]
        assert max(ratios) < MAXIMUM / exact[-2]
    for count in (8, 12):
        buckets = robust_buckets(values, ones, count, MAXIMUM, align=32)
        assert len(buckets) <= count and buckets[-1] == MAXIMUM
        assert list(buckets) == sorted(set(buckets))
        assert all(b % 32 == 0 for b in buckets[:-1])
        above = [b for b in buckets if b >= max(values)]
        # Past the sample's largest value no step is more than the ladder's
        # ratio from the next bucket, up to the maximum.
        assert above[0] >= max(values)
        ratios = [hi / lo for lo, hi in zip(above, above[1:], strict=False)]
        assert max(ratios, default=1.0) <= MAX_LADDER_RATIO + 1e-9


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_robust_buckets_pad_less_on_fresh_samples_than_the_sample_optimum(seed):
    train = _sample(200, seed)
    ones = [1.0] * len(train)
    robust = robust_buckets(train, ones, 8, MAXIMUM, 32)
    exact = optimal_buckets(train, ones, 8, MAXIMUM, 32)
    # On its own sample the exact optimum wins (it is exact) ...
    assert padding_cost(exact, train, ones) <= padding_cost(robust, train, ones)
    # ... on ten fresh samples of the same source, robust buckets win.
    fresh = [_sample(200, 100 * seed + k) for k in range(10)]
    robust_cost = sum(padding_cost(robust, f, [1.0] * len(f)) for f in fresh)
    exact_cost = sum(padding_cost(exact, f, [1.0] * len(f)) for f in fresh)
    assert robust_cost < exact_cost


def test_tail_model_expects_weight_above_the_sample_only():
    values = _sample(200, 4)
    weights = [2.0] * len(values)
    points, expected = tail_model(values, weights, MAXIMUM)
    assert points and min(points) > max(values) and max(points) <= MAXIMUM
    # A share of the total weight, falling off with size.
    assert 0 < sum(expected) < sum(weights) * 0.05
    assert expected == sorted(expected, reverse=True)
    # A sample at the maximum has nothing above it.
    assert tail_model([10, MAXIMUM], [1.0, 1.0], MAXIMUM) == ([], [])


def test_ladder_uses_the_fewest_buckets_within_the_ratio():
    assert ladder_sizes(10000, 131072, 4, 1) == [36204]  # one step of 3.6x
    three = ladder_sizes(1000, 131072, 2, 1)  # capped at two: ratio 5.1
    assert len(three) == 2 and math.isclose(
        three[1] / three[0], 131072 / three[1], rel_tol=0.01
    )
    assert ladder_sizes(40000, 131072, 4, 1) == []  # within 4x already
    assert all(s % 256 == 0 for s in ladder_sizes(1000, 131072, 4, 256))


def test_tune_sample_exact_is_still_available(tmp_path):
    base = [
        "tune", "--num-requests", "40", "--request-rate", "inf",
        "--max-model-len", "131072", "--max-num-seqs", "16",
    ]  # fmt: skip
    robust, exact = tmp_path / "robust.json", tmp_path / "exact.json"
    assert main([*base, "--output", str(robust)]) == 0
    assert main([*base, "--sample-exact", "--output", str(exact)]) == 0
    import json

    robust_context = json.loads(robust.read_text())["decode_context_length_buckets"]
    exact_context = json.loads(exact.read_text())["decode_context_length_buckets"]
    assert exact_context[-1] / exact_context[-2] > MAX_LADDER_RATIO  # the cliff
    ratios = [
        hi / lo for lo, hi in zip(robust_context, robust_context[1:], strict=False)
    ]
    assert robust_context[-1] == 131072 and ratios[-1] <= MAX_LADDER_RATIO + 1e-9
