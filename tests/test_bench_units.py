"""Benchmark building blocks: cost model, trace parsers, metric definitions."""

import math
from array import array

import pytest

from neuron_scheduler.sim.cost_model import RooflineCostModel, StepShape
from neuron_scheduler.sim.records import RequestRecord, RunResult
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.slo import SLO, SLOError, goodput_limits, parse_goodput
from neuron_scheduler.sim.workload import (
    RequestSpec,
    WorkloadError,
    builtin_workload,
    fit_to_model_len,
    load_trace,
    retime,
    select,
)

TRN2_8B = RooflineCostModel.named("trn2", "llama-3.1-8b", 4)


def prefill_time(cost, padded_tokens, context_before=0):
    """One prefill graph of ``padded_tokens`` after ``context_before``."""
    return cost.step_time(StepShape(((padded_tokens, context_before),)))


def decode_time(cost, padded_batch, context_len_read):
    """One decode graph of ``padded_batch`` rows reading ``context_len_read``."""
    return cost.step_time(StepShape((), padded_batch, context_len_read))


@pytest.mark.parametrize(
    ("measure", "published_ms"),
    [
        # One user of optimum-neuron's trn2 TP4 BS32 run: every decode step
        # is the 32-row graph over the 2048 context bucket; a ~1500-token
        # prompt runs the 2048-token context-encoding graph.
        (lambda c: decode_time(c, 32, 2048), 22.14),
        (lambda c: prefill_time(c, 2048), 197.2),
    ],
    ids=["itl-1-user", "ttft-1500"],
)
def test_trn2_single_graphs_match_their_calibration_points(measure, published_ms):
    modelled = measure(TRN2_8B) * 1e3
    assert abs(modelled - published_ms) / published_ms <= 0.02, modelled


def test_collectives_are_charged_only_across_chips():
    one_chip = RooflineCostModel.named("inf2", "llama-3.1-8b", 2)
    four_chips = RooflineCostModel.named("inf2", "llama-3.1-8b", 8)
    shape = StepShape((), 32, 2048)
    assert (one_chip.num_chips, four_chips.num_chips) == (1, 4)
    assert one_chip.collective_seconds(32) == 0.0
    # Two ring all-reduces per layer of tokens x hidden bf16 activations.
    hw, model, ranks = four_chips.hardware, four_chips.model, 8
    for tokens in (32, 2048):
        message = tokens * model.hidden_size * 2
        ring = 2 * (ranks - 1) / ranks * message / (hw.collective_gb_per_s * 1e9)
        expected = 2 * model.num_layers * (hw.collective_latency_s + ring)
        assert four_chips.collective_seconds(tokens) == pytest.approx(expected)
    # The step pays them on top of the roofline: 4x the bandwidth of one
    # chip, so 4 chips' step minus its collectives is one chip's less its
    # overhead, over 4 (decode is memory-bound).
    rest = four_chips.step_time(shape) - four_chips.collective_seconds(32)
    overhead = hw.step_overhead_s
    assert rest - overhead == pytest.approx((one_chip.step_time(shape) - overhead) / 4)


def test_cost_is_monotonic_in_tokens_batch_and_context():
    prefill = [prefill_time(TRN2_8B, t) for t in (128, 512, 2048, 8192)]
    assert prefill == sorted(prefill) and len(set(prefill)) == 4
    decode = [decode_time(TRN2_8B, b, 4096) for b in (1, 4, 16, 64)]
    assert decode == sorted(decode) and len(set(decode)) == 4
    assert decode_time(TRN2_8B, 8, 131072) > decode_time(TRN2_8B, 8, 4096)
    assert prefill_time(TRN2_8B, 512, 8000) > prefill_time(TRN2_8B, 512, 0)


def test_profiles_and_kv_capacity():
    big = RooflineCostModel.named("trn2", "llama-3.1-70b", 16)
    assert big.kv_capacity_tokens() > 0
    assert RooflineCostModel.named("trn1", "llama-3.1-8b", 2).kv_capacity_tokens() > 0
    assert decode_time(RooflineCostModel.named("inf2", "llama-3.1-8b", 8), 1, 4096) > 0
    with pytest.raises(ValueError, match="do not fit"):
        RooflineCostModel.named("inf2", "llama-3.1-70b", 2).kv_capacity_tokens()
    with pytest.raises(ValueError, match="'h100'"):
        RooflineCostModel.named("h100", "llama-3.1-8b", 4)


def test_builtin_workload_follows_azure_shape():
    specs = fit_to_model_len(builtin_workload(4000, 5.0, seed=1), 32768)[0]
    inputs = sorted(s.input_len for s in specs)
    outputs = sorted(s.output_len for s in specs)
    assert 900 < inputs[len(inputs) // 2] < 1150
    assert 2400 < inputs[int(0.9 * len(inputs))] < 3100
    assert 110 < outputs[len(outputs) // 2] < 150
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(specs, specs[1:], strict=False)]
    assert 0.18 < sum(gaps) / len(gaps) < 0.22  # 5 req/s
    assert all(s.arrival_s == 0 for s in builtin_workload(10, math.inf))


def test_azure_parser(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
    )
    specs = load_trace(path)
    assert [(s.input_len, s.output_len) for s in specs] == [(374, 44), (396, 109)]
    assert specs[0].arrival_s == 0 and abs(specs[1].arrival_s - 4.314579) < 1e-5


def test_mooncake_parser_keeps_hash_ids(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}\n'
        '{"timestamp": 1500, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]}\n'
    )
    specs = load_trace(path)
    assert specs[1].arrival_s == 1.5 and specs[1].hash_ids == (0, 2)


def test_length_parser_and_retime(tmp_path):
    path = tmp_path / "lengths.csv"
    path.write_text(
        "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
        "74,918,992,0.08\n290,905,1195,0.32\n"
    )
    specs = load_trace(path)
    assert [(s.input_len, s.output_len) for s in specs] == [(74, 918), (290, 905)]
    retimed = retime(specs, request_rate=2.0, seed=3)
    assert retimed[0].arrival_s == 0 and retimed[1].arrival_s > 0
    assert select(specs, 1, False, 0) == specs[:1]


def test_time_scale_and_sampling_keep_the_trace_shape():
    specs = [RequestSpec(float(t), 10 + t, 2) for t in range(10)]
    slower = retime(specs, time_scale=2.0)
    assert [s.arrival_s for s in slower] == [2.0 * t for t in range(10)]
    sample = select(specs, 4, True, seed=5)
    assert len(sample) == 4 and sample[0].arrival_s == 0
    picked = [s.input_len for s in sample]
    assert picked == sorted(picked) and picked != [10, 11, 12, 13]
    with pytest.raises(WorkloadError, match="time-scale"):
        retime(specs, time_scale=0)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12,x\n", ":2: GeneratedTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,12,3\n", ":2: TIMESTAMP"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,3\n", ":2: ContextTokens must be positive"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1,\n', ":2: bad record"),
        ("num_prefill_tokens,num_decode_tokens\n5,1\n-3,1\n", ":3: num_prefill_tokens"),
        ("a,b\n1,2\n", ":1: unknown trace format"),
    ],
)  # fmt: skip
def test_bad_trace_lines_are_reported_with_line_number(tmp_path, text, fragment):
    path = tmp_path / "trace.txt"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=fragment.replace("(", r"\(")):
        load_trace(path)


def _result():
    """Two requests with hand-picked times (seconds)."""
    first = RequestRecord(0.0, 100, 3, first_token_s=0.5, finish_s=0.9, num_tokens=3)
    second = RequestRecord(1.0, 50, 1, first_token_s=4.0, finish_s=4.0, num_tokens=1)
    result = RunResult("x", [first, second], itl_s=array("d", [0.1, 0.3]))
    result.duration_s = 4.0
    return result


def test_metric_definitions_on_hand_computed_case():
    m = compute_metrics(_result(), (SLO("ttft", None, 1000), SLO("tpot", None, 250)))
    assert m["completed"] == 2
    assert m["mean_ttft_ms"] == pytest.approx((500 + 3000) / 2)
    # TPOT excludes the first token and requests with one token.
    assert m["mean_tpot_ms"] == pytest.approx((900 - 500) / 2)
    assert m["median_itl_ms"] == pytest.approx(200)  # flattened gaps 100, 300
    assert m["mean_e2el_ms"] == pytest.approx((900 + 3000) / 2)
    assert m["output_throughput"] == pytest.approx(4 / 4.0)
    assert m["total_token_throughput"] == pytest.approx(154 / 4.0)
    assert m["request_goodput"] == pytest.approx(1 / 4.0)  # second misses TTFT


def test_goodput_parsing():
    slos = parse_goodput(["ttft:500", "e2el:9000", "ttft:400"])
    assert slos == (SLO("ttft", None, 400.0), SLO("e2el", None, 9000.0))
    assert goodput_limits(slos) == {"ttft": 400.0, "tpot": None, "e2el": 9000.0}
    assert [str(s) for s in slos] == ["ttft:400", "e2el:9000"]
    for item, fragment in [
        ("foo:1", "unknown metric 'foo'"),
        ("itl:5", "unknown metric 'itl'"),  # no per-request value
        ("ttft:p90:5", "expected METRIC:MS"),
        ("ttft:soon", "milliseconds 'soon' is not a number"),
        ("ttft:0", "milliseconds must be > 0"),
    ]:
        with pytest.raises(SLOError, match="--goodput") as error:
            parse_goodput([item])
        assert item in str(error.value) and fragment in str(error.value)


def test_one_token_requests_meet_any_tpot_goodput_slo():
    result = _result()
    strict = compute_metrics(result, (SLO("tpot", None, 1e-9),))
    # The first request's TPOT (200 ms) misses; the second has none.
    assert strict["request_goodput"] == pytest.approx(1 / 4.0)


def test_packed_prefill_and_decode_context_costs():
    cost = RooflineCostModel.named("trn2", "llama-3.1-8b", 4)
    # Two prompts in one graph: one weight read, cheaper than two graphs.
    packed = cost.step_time(StepShape(((300, 0), (700, 0))))
    assert packed < prefill_time(cost, 300) + prefill_time(cost, 700)
    # Block-diagonal attention: less than one 1000-token causal prompt.
    assert packed <= prefill_time(cost, 1000)
    # Decode reads KV for the context bucket of every padded row.
    assert decode_time(cost, 32, 4096) < decode_time(cost, 32, 131072) / 10
