"""scripts/budget-holdout.py: a budget's tuned config against powers of two
at the same counts, on the tuning part and the held-out part."""

from __future__ import annotations

import pytest

from helpers import load_script

SMALL = [
    "--request-rate", "inf", "--max-model-len", "16384",
    "--max-num-batched-tokens", "2048", "--max-num-seqs", "8", "--num-requests", "60",
]  # fmt: skip


def _script():
    return load_script("budget-holdout.py")


def test_each_seed_compares_both_parts(capsys):
    argv = [*SMALL, "--compile-budget-minutes", "3", "--holdout", "0.4"]
    results = _script().main([*argv, "--seeds", "0", "5"])
    assert [r["seed"] for r in results] == [0, 5]
    for result in results:
        assert set(result["parts"]) == {"tuning", "held out"}
        tuned = result["tuned"]
        graphs = len(tuned["num_batched_tokens_buckets"]) + len(
            tuned["num_seqs_buckets"]
        ) * len(tuned["decode_context_length_buckets"])
        assert graphs <= 6
        for figures in result["parts"].values():
            assert figures["tuned"] > 0 and figures["powers"] > 0
    # Another seed draws another workload and split.
    assert results[0]["parts"] != results[1]["parts"]
    out = capsys.readouterr().out
    assert out.count("seed ") == 2 and "held out: " in out


def test_fresh_samples_are_other_traffic():
    argv = [*SMALL, "--compile-budget-minutes", "3", "--fresh", "40:7", "40:8"]
    (result,) = _script().main(argv)
    parts = result["parts"]
    assert list(parts) == ["tuning", "fresh 40:7", "fresh 40:8"]
    assert parts["fresh 40:7"] != parts["fresh 40:8"] != parts["tuning"]


def test_the_budget_and_the_traffic_are_required(capsys):
    with pytest.raises(SystemExit):
        _script().main([*SMALL, "--holdout", "0.4"])
    assert "--compile-budget-minutes is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _script().main([*SMALL, "--compile-budget-minutes", "3"])
    assert "give --holdout or --fresh" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _script().main([*SMALL, "--compile-budget-minutes", "3", "--fresh", "7"])
    assert "'7': expected REQUESTS:SEED" in capsys.readouterr().err
