"""tune --holdout: the split, its refusals, and the held-out report."""

import json

import pytest

from neuron_scheduler.cli import main
from neuron_scheduler.sim.holdout import HoldoutError, split
from neuron_scheduler.sim.workload import RequestSpec

SPECS = [RequestSpec(float(i), 100 + i, 10) for i in range(50)]
SMALL = [
    "tune", "--request-rate", "inf", "--max-model-len", "16384",
    "--max-num-batched-tokens", "2048", "--max-num-seqs", "8",
]  # fmt: skip


def test_a_split_in_time_holds_out_the_last_requests_from_time_zero():
    tuning, held = split(SPECS, 0.4, by_time=True, seed=0)
    assert [s.input_len for s in tuning] == [100 + i for i in range(30)]
    assert [s.input_len for s in held] == [100 + i for i in range(30, 50)]
    assert [s.arrival_s for s in held] == [float(i) for i in range(20)]


def test_a_random_split_is_a_seeded_partition_in_arrival_order():
    tuning, held = split(SPECS, 0.4, by_time=False, seed=3)
    assert len(held) == 20 and len(tuning) == 30
    assert sorted(tuning + held, key=lambda s: s.arrival_s) == SPECS
    assert held == sorted(held, key=lambda s: s.arrival_s)
    assert split(SPECS, 0.4, by_time=False, seed=3) == (tuning, held)
    assert split(SPECS, 0.4, by_time=False, seed=4)[1] != held


@pytest.mark.parametrize(
    ("fraction", "fragment"),
    [
        (0.0, "--holdout must be in (0, 1), got 0.0"),
        (1.0, "--holdout must be in (0, 1), got 1.0"),
        (
            0.2,
            "leaves 40 requests to tune on and 10 held out; each part needs at least 20",
        ),
    ],
)
def test_bad_splits_are_refused_with_the_numbers(fraction, fragment):
    with pytest.raises(HoldoutError) as error:
        split(SPECS, fraction, by_time=True, seed=0)
    assert fragment in str(error.value)


def test_tune_reports_the_held_out_part(tmp_path, capsys):
    report = tmp_path / "tune.json"
    code = main(
        [*SMALL, "--num-requests", "60", "--holdout", "0.4", "--json", str(report)]
    )
    assert code == 0
    held = json.loads(report.read_text())["holdout"]
    assert held["num_requests"] == 24
    configs = held["configs"]
    assert list(configs) == ["tuned", "own-optimum", "powers-of-two"]
    tuned, own, powers = (configs[k]["output_throughput"] for k in configs)
    assert held["tuned_vs_own_optimum"] == pytest.approx(tuned / own)
    assert held["tuned_vs_powers_of_two"] == pytest.approx(tuned / powers)
    powers_context = configs["powers-of-two"]["neuron_config"][
        "decode_context_length_buckets"
    ]
    assert powers_context == [2**k for k in range(7, 15)]  # 8 up to max_model_len
    written = json.loads(report.read_text())["neuron_config"]
    assert configs["tuned"]["neuron_config"] == written
    assert "held out: 24 requests" in capsys.readouterr().err


def test_within_a_budget_the_baselines_cost_what_the_tuned_config_costs(tmp_path):
    # Powers of two of every kind at the tuned config's bucket counts (as
    # many graphs, so the same compile minutes), not the unbudgeted lists.
    report = tmp_path / "tune.json"
    argv = [*SMALL, "--num-requests", "60", "--holdout", "0.4"]
    assert main([*argv, "--compile-budget-minutes", "3", "--json", str(report)]) == 0
    configs = json.loads(report.read_text())["holdout"]["configs"]
    tuned = configs["tuned"]["neuron_config"]
    powers = configs["powers-of-two"]["neuron_config"]
    maxima = {
        "num_batched_tokens_buckets": 2048,
        "num_seqs_buckets": 8,
        "decode_context_length_buckets": 16384,
    }
    graphs = len(tuned["num_batched_tokens_buckets"]) + len(
        tuned["num_seqs_buckets"]
    ) * len(tuned["decode_context_length_buckets"])
    assert graphs <= 6  # 3 minutes at 30 s a graph
    for key, maximum in maxima.items():
        count = len(tuned[key])
        assert powers[key] == [maximum >> k for k in reversed(range(count))]
    # The held-out part's own optimum is chosen within the budget too.
    own = configs["own-optimum"]["neuron_config"]
    own_graphs = len(own["num_batched_tokens_buckets"]) + len(
        own["num_seqs_buckets"]
    ) * len(own["decode_context_length_buckets"])
    assert own_graphs <= 6


def test_a_smaller_part_sent_at_once_is_named_another_load(tmp_path, capsys):
    report = tmp_path / "tune.json"
    argv = [*SMALL, "--num-requests", "60", "--holdout", "0.4"]
    assert main([*argv, "--json", str(report)]) == 0
    note = json.loads(report.read_text())["holdout"]["load_note"]
    assert "a load of 24 at once against the 36 tuned on" in note
    assert note in capsys.readouterr().err
    # At a rate the parts are the same load, spread over time: no note.
    at_rate = [a if a != "inf" else "2" for a in argv]
    assert main([*at_rate, "--json", str(report)]) == 0
    assert json.loads(report.read_text())["holdout"]["load_note"] is None
    assert "note: every request" not in capsys.readouterr().err


def test_a_separate_trace_can_be_held_out(tmp_path, capsys):
    trace = tmp_path / "lengths.csv"
    rows = "\n".join(f"{300 + 37 * i},{5 + i % 7}" for i in range(25))
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + rows + "\n")
    report = tmp_path / "tune.json"
    argv = [*SMALL, "--num-requests", "30", "--holdout-workload", str(trace)]
    assert main([*argv, "--json", str(report)]) == 0
    assert json.loads(report.read_text())["holdout"]["num_requests"] == 25
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--holdout", "0.5"])
    assert exit_info.value.code == 2
    assert "exclude each other" in capsys.readouterr().err
    short = tmp_path / "short.csv"
    short.write_text("num_prefill_tokens,num_decode_tokens\n100,5\n200,6\n")
    with pytest.raises(SystemExit):
        main([*SMALL, "--num-requests", "30", "--holdout-workload", str(short)])
    assert "30 requests to tune on and 2 held out" in capsys.readouterr().err
