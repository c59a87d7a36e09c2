"""scripts/profile-repeatability.py: each shape's spread between profiles
once each profile's overall speed is divided out, and the shapes a profile
charges less at a longer context."""

from __future__ import annotations

import math

import pytest

from helpers import load_script


def _script():
    return load_script("profile-repeatability.py")


def test_a_profile_slower_throughout_spreads_nothing_and_one_shape_off_does():
    script = _script()
    short, long_ = ("decode", 4, 128, 4), ("decode", 4, 1024, 4)
    prefill = ("prefill", 512, 0, 512)
    base = {short: 0.010, long_: 0.020, prefill: 0.100}
    slower = {shape: 1.3 * seconds for shape, seconds in base.items()}
    assert all(
        deviation == pytest.approx(0.0) and ratio == pytest.approx(1.0)
        for deviation, ratio in script.spreads([base, slower, base]).values()
    )
    # The third profile's long decode alone costs 20% more.
    off = {**base, long_: 0.024}
    spreads = script.spreads([base, base, off])
    assert spreads[short] == pytest.approx((0.0, 1.0))
    deviation, ratio = spreads[long_]
    assert ratio == pytest.approx(1.2)
    # log ratios 0, 0, log 1.2: a sample standard deviation of log 1.2 / sqrt 3.
    assert deviation == pytest.approx(math.log(1.2) / math.sqrt(3))


def test_a_shape_cheaper_at_a_longer_context_is_named():
    script = _script()
    costs = {
        ("decode", 2, 128, 2): 0.014,
        ("decode", 2, 512, 2): 0.011,  # cheaper by 21%
        ("decode", 2, 1024, 2): 0.0109,  # cheaper by 1%: within tolerance
        ("prefill", 512, 0, 512): 0.2,
        ("prefill", 512, 1024, 512): 0.3,
        ("prefill", 512, 0, 300): 0.1,  # a partly filled bucket: not compared
    }
    assert script.inversions(costs, 0.02) == [
        "decode 2: 14.0 ms at 128, 11.0 ms at 512"
    ]
