"""neuron-scheduler profile on a real engine (the demo's tiny model with the
static-shape worker): every shape the configuration can produce is timed,
the JSON round-trips into the bench, and a plan too long is refused."""

import json
import os

import pytest

from neuron_scheduler.cli import main
from neuron_scheduler.offline.profiler import cpu_capability
from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.step import StepKind

pytestmark = pytest.mark.slow

CONFIG = {"num_batched_tokens_buckets": [128, 512], "num_seqs_buckets": [2, 8]}


def test_profile_times_every_shape_and_feeds_the_bench(tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = main(["profile", "--neuron-config", json.dumps(CONFIG),
                 "--repetitions", "4", "--fit-seconds", "0.001",
                 "--output", str(out), "--no-progress"])  # fmt: skip
    assert code == 0
    profile = Profile.load(out)
    # Four times a shape cannot fit a millisecond: three, the fewest.
    assert profile.meta["repetitions"] == 3
    assert profile.engine["max_model_len"] == 2048
    assert profile.platform["worker_cls"] == "neuron_scheduler.StaticShapeWorker"
    assert profile.platform["cpu_capability"] == cpu_capability()
    assert profile.meta["decode_context"] == "actual"  # CPU attention
    assert profile.meta["prefill_fill"] == "actual"
    fills = {
        (t.tokens, t.fill)
        for t in profile.timings
        if t.kind is StepKind.PREFILL and t.context == 0
    }
    # Each bucket full, and with the fewest real tokens it holds.
    assert {(128, 128), (128, 2), (512, 512), (512, 129)} <= fills
    prefill = {
        (t.tokens, t.context) for t in profile.timings if t.kind is StepKind.PREFILL
    }
    decode = {(t.rows, t.context) for t in profile.timings if t.kind is StepKind.DECODE}
    for tokens in CONFIG["num_batched_tokens_buckets"]:
        assert (tokens, 0) in prefill
        assert any(t == tokens and c > 0 for t, c in prefill)  # chunked context
    for rows in CONFIG["num_seqs_buckets"]:
        assert {c for r, c in decode if r == rows} == {128, 256, 512, 1024, 2048}
    assert all(len(t.samples_s) >= 3 and min(t.samples_s) > 0 for t in profile.timings)
    # The machine's speed, timed after each of the three prefill rounds and
    # each of the five decode contexts; every sample scaled by it, within
    # the run's spread of the time measured.
    drift = profile.meta["drift"]
    assert len(drift["seconds"]) == 3 + 5
    assert drift["fastest_x"] <= 1 <= drift["slowest_x"]
    for t in profile.timings:
        assert len(t.measured_s) == len(t.samples_s)
        for charged, measured in zip(t.samples_s, t.measured_s, strict=True):
            low, high = measured / drift["slowest_x"], measured / drift["fastest_x"]
            assert low * 0.999 <= charged <= high * 1.001
    # The reference's own steps (a prompt of 120 tokens, 8 times) are filed
    # apart from the shapes: the only prefills of 120 real tokens are those
    # of the 8 rows decoding at context 128 (prompts of 128 - 3 x 2 - 2).
    (short,) = [
        t
        for t in profile.timings
        if t.kind is StepKind.PREFILL and (t.tokens, t.fill, t.context) == (128, 120, 0)
    ]
    assert len(short.samples_s) == 8
    # The plan ran as planned: shared contexts found in the prefix cache,
    # decode rows finishing down the buckets (no partial batch), plus the
    # costliest step's two timings.
    assert profile.meta["engine_steps"] == profile.meta["planned_steps"] + 2
    # The engine core timed its steps off the worker's core(s).
    if len(os.sched_getaffinity(0)) > 1:
        assert profile.meta["engine_core_cores"]
        assert set(profile.meta["engine_core_cores"]) < os.sched_getaffinity(0)
    assert ProfileCostModel(profile).missing_shapes([128, 512], [2, 8], [2048]) == []
    printed = capsys.readouterr().out
    assert "prefill 512 tokens after 0" in printed
    assert "each shape timed 3 times" in printed
    assert "timed after each of 8 blocks" in printed and "of the way" in printed
    assert f"{cpu_capability()} kernels)" in printed
    assert "prefill 512 tokens (129 real) after 0" in printed

    bench_json = tmp_path / "bench.json"
    assert main(["bench", "--cost-profile", str(out), "--config",
                 f"profiled={json.dumps(CONFIG)}", "--num-requests", "20",
                 "--random-input-len", "300", "--random-output-len", "8",
                 "--no-progress", "--json", str(bench_json)]) == 0  # fmt: skip
    runs = json.loads(bench_json.read_text())["runs"]
    static = next(r for r in runs if r["label"] == "profiled")
    assert static["cost_model"]["interpolated_steps"] == 0
    assert static["cost_model"]["exact_steps"] > 0


def test_a_profile_that_would_take_too_long_is_refused(tmp_path, capsys):
    out = tmp_path / "profile.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--max-seconds", "0.001", "--output", str(out),
              "--no-progress"])  # fmt: skip
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "engine steps" in error and "more than --max-seconds 0.001" in error
    assert not out.exists()
