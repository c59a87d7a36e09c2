"""The bucket tuner: an exact optimum (checked against brute force), valid
output, and the options charged by the benchmark."""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_scheduler.buckets import optimal_buckets, padding_cost
from neuron_scheduler.cli import main
from neuron_scheduler.config import EngineLimits, NeuronConfig
from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.sim.cost_model import RooflineCostModel
from neuron_scheduler.sim.policies import SEED, Policy
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.tuner import ObservedShapes, tune_buckets
from neuron_scheduler.sim.workload import builtin_workload, fit_to_model_len


@settings(max_examples=300, deadline=None)
@given(
    maximum=st.integers(1, 24),
    data=st.data(),
    max_buckets=st.integers(1, 5),
)
def test_optimal_buckets_match_brute_force(maximum, data, max_buckets):
    values = data.draw(st.lists(st.integers(1, maximum), min_size=1, max_size=12))
    weights = data.draw(
        st.lists(st.sampled_from([0.5, 1.0, 3.0]), min_size=len(values),
                 max_size=len(values))
    )  # fmt: skip
    got = optimal_buckets(values, weights, max_buckets, maximum)
    assert got[-1] == maximum and len(got) <= max_buckets
    assert list(got) == sorted(set(got))
    best = min(
        padding_cost(interior + (maximum,), values, weights)
        for count in range(max_buckets)
        for interior in itertools.combinations(range(1, maximum), count)
    )
    assert padding_cost(got, values, weights) == pytest.approx(best)


@settings(max_examples=300, deadline=None)
@given(
    maximum=st.integers(1, 40),
    align=st.integers(1, 8),
    data=st.data(),
    max_buckets=st.integers(1, 4),
)
def test_aligned_buckets_match_brute_force_over_aligned_lists(
    maximum, align, data, max_buckets
):
    values = data.draw(st.lists(st.integers(1, maximum), min_size=1, max_size=12))
    weights = data.draw(
        st.lists(st.sampled_from([0.5, 1.0, 3.0]), min_size=len(values),
                 max_size=len(values))
    )  # fmt: skip
    got = optimal_buckets(values, weights, max_buckets, maximum, align)
    assert got[-1] == maximum and len(got) <= max_buckets
    assert all(b % align == 0 for b in got[:-1])
    sizes = range(align, maximum, align)
    best = min(
        padding_cost(interior + (maximum,), values, weights)
        for count in range(max_buckets)
        for interior in itertools.combinations(sizes, count)
    )
    assert padding_cost(got, values, weights) == pytest.approx(best)


def test_optimal_buckets_rejects_values_above_the_maximum():
    with pytest.raises(ValueError, match="value 9 exceeds the largest bucket 8"):
        optimal_buckets([1, 9], [1, 1], 3, 8)
    with pytest.raises(ValueError, match="max_buckets must be >= 1, got 0"):
        optimal_buckets([1], [1], 0, 8)


COST = RooflineCostModel.named("trn2", "llama-3.1-8b", 4)
SETTINGS = EngineSettings(
    max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=16384,
    block_size=32, num_kv_blocks=8192,
)  # fmt: skip
LIMITS = EngineLimits(4096, 16384, 16)


def test_tuned_buckets_beat_defaults_on_the_shapes_and_in_the_bench():
    specs = fit_to_model_len(builtin_workload(80, float("inf"), seed=3), 16384)[0]
    shapes = ObservedShapes()
    simulate(specs, SEED, SETTINGS, COST, on_step=shapes.add)
    assert len(shapes.prefill_tokens) >= 80  # a prompt per step, some chunked
    result = tune_buckets(
        shapes, LIMITS, max_prefill_buckets=6, max_decode_buckets=5,
        max_context_buckets=4,
    )  # fmt: skip
    default_prefill, exact_prefill, tuned_prefill = result.prefill
    assert [c.name for c in result.context] == [
        "default",
        "powers of two x4",
        "sample-exact",
        "robust",
    ]
    assert len(tuned_prefill.buckets) <= 6 == len(default_prefill.buckets)
    assert exact_prefill.padding <= tuned_prefill.padding < default_prefill.padding
    assert result.decode[1].padding <= result.decode[-1].padding
    assert result.decode[1].padding <= result.decode[0].padding
    # On the sample itself the exact optimum is the least padding.
    assert result.context[2].padding <= min(c.padding for c in result.context)
    tuned = result.neuron_config({})
    NeuronConfig.from_dict(tuned, LIMITS)
    # The bench, charging padded shapes, sees the padding the tuner predicted.
    run = simulate(specs, Policy("tuned", NeuronScheduler, tuned), SETTINGS, COST)
    assert run.prefill_tokens_padded - run.prefill_tokens == pytest.approx(
        tuned_prefill.padding
    )
    assert (
        run.decode_context_read
        < simulate(specs, SEED, SETTINGS, COST).decode_context_read
    )


def test_packed_and_capped_steps_are_what_the_tuner_sees():
    config = {
        "max_prefills_per_batch": 4,
        "max_prefill_tokens_with_decodes_waiting": 1024,
    }
    specs = fit_to_model_len(builtin_workload(40, float("inf"), seed=4), 16384)[0]
    shapes = ObservedShapes()
    records = []
    result = simulate(
        specs, Policy("p", NeuronScheduler, config), SETTINGS, COST,
        on_step=lambda r: (shapes.add(r), records.append(r)),
    )  # fmt: skip
    assert len(shapes.prefill_tokens) == result.prefill_steps
    assert sum(shapes.prefill_tokens) == result.prefill_tokens
    assert max(shapes.prefill_tokens) <= 4096
    prefills = [r for r in records if r.kind.value == "prefill"]
    assert any(r.num_seqs > 1 for r in prefills)  # packed
    assert [r.total_actual for r in prefills] == shapes.prefill_tokens


def test_tune_cli_writes_a_valid_config(tmp_path, capsys):
    out = tmp_path / "tuned.json"
    code = main([
        "tune", "--num-requests", "30", "--max-model-len", "16384",
        "--max-num-batched-tokens", "4096", "--max-num-seqs", "16",
        "--config", '{"kv_admission": "reserve"}', "--max-prefill-buckets", "4",
        "--max-context-buckets", "3", "--output", str(out),
    ])  # fmt: skip
    assert code == 0
    written = json.loads(out.read_text())
    assert written["kv_admission"] == "reserve"
    assert len(written["num_batched_tokens_buckets"]) <= 4
    assert len(written["decode_context_length_buckets"]) <= 3
    NeuronConfig.from_dict(written, LIMITS)
    captured = capsys.readouterr()
    assert json.loads(captured.out) == written
    assert "prefill tokens  default" in captured.err


def test_tune_split_decodes_adds_the_cost_models_break_even(tmp_path):
    from neuron_scheduler.sim.decode_split import break_even_positions
    from neuron_scheduler.sim.run_setup import EngineChoice, engine_setup

    argv = [
        "tune", "--num-requests", "40", "--max-model-len", "16384",
        "--max-num-batched-tokens", "4096", "--max-num-seqs", "16",
        "--holdout", "0.5",
    ]  # fmt: skip
    plain, split = tmp_path / "plain.json", tmp_path / "split.json"
    assert main([*argv, "--output", str(plain)]) == 0
    assert main([*argv, "--split-decodes", "--output", str(split)]) == 0
    written = json.loads(split.read_text())
    cost, settings = engine_setup(
        EngineChoice(max_model_len=16384, max_num_batched_tokens=4096, max_num_seqs=16)
    )
    key = "decode_split_break_even_positions"
    assert written.pop(key) == break_even_positions(cost, settings)
    assert written == json.loads(plain.read_text())  # the same buckets


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--max-prefill-buckets", "0"], "--max-prefill-buckets must be >= 1, got 0"),
        (["--config", "{"], "invalid JSON"),
        (["--config", '{"kv_admission": "x"}'], "kv_admission"),
    ],
)
def test_tune_cli_rejects_bad_options(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "--num-requests", "5", *argv])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_tune_aligns_buckets_and_refuses_an_alignment_that_leaves_no_room(
    tmp_path, capsys
):
    output = tmp_path / "tuned.json"
    main(
        ["tune", "--num-requests", "40", "--max-model-len", "8192",
         "--align-context", "256", "--output", str(output)]
    )  # fmt: skip
    tuned = json.loads(output.read_text())
    assert all(b % 128 == 0 for b in tuned["num_batched_tokens_buckets"][:-1])
    assert all(b % 256 == 0 for b in tuned["decode_context_length_buckets"][:-1])
    with pytest.raises(SystemExit):
        main(
            ["tune", "--num-requests", "5", "--max-model-len", "512",
             "--max-num-batched-tokens", "512", "--align-prefill", "256"]
        )  # fmt: skip
    assert (
        "--align-prefill 256 leaves 1 bucket sizes below the maximum 512; "
        "--max-prefill-buckets 3 needs 2" in capsys.readouterr().err
    )
