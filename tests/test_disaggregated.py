"""Disaggregated prefill/decode in the simulator: x prefill and y decode
engines, each a real scheduler, joined by KV transfers through vLLM's own
connector flows; the transfer model; bad input."""

import json
from dataclasses import replace

import pytest

from neuron_scheduler.cli import main
from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.sim.cost_model import RooflineCostModel
from neuron_scheduler.sim.disaggregated import (
    Pool,
    PoolSizes,
    check_pools,
    simulate_disaggregated,
)
from neuron_scheduler.sim.disaggregated_metrics import disaggregated_metrics
from neuron_scheduler.sim.kv_transfer import TransferMode, TransferModel, Transfers
from neuron_scheduler.sim.policies import SEED, Policy
from neuron_scheduler.sim.workload import builtin_workload, fit_to_model_len

pytestmark = pytest.mark.matrix

COST = RooflineCostModel.named("trn2", "llama-3.1-8b", 4)
KV_BYTES = COST.kv_bytes_per_token()
SETTINGS = EngineSettings(
    max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=4096,
    block_size=32, num_kv_blocks=8 * 4096 // 32 + 1,
)  # fmt: skip


def _specs(n, rate, seed=0):
    return fit_to_model_len(builtin_workload(n, rate, seed=seed), 4096)[0]


def _pools(
    prefill=1,
    decode=1,
    prefill_settings=SETTINGS,
    decode_config=None,
    decode_settings=SETTINGS,
):
    return (
        Pool("prefill", prefill, SEED, prefill_settings, COST),
        Pool(
            "decode",
            decode,
            Policy("decode", NeuronScheduler, decode_config or {}),
            decode_settings,
            COST,
        ),
    )


def _overlap(intervals):
    """Most intervals (start, end) open at once."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


# ------------------------------------------------------------- pool sizes


@pytest.mark.parametrize(
    "text, sizes", [("1P1D", (1, 1)), ("2p3d", (2, 3)), (" 4P 12D ", (4, 12))]
)
def test_pool_sizes_are_read_as_aws_and_vllm_write_them(text, sizes):
    parsed = PoolSizes.parse(text)
    assert (parsed.prefill, parsed.decode) == sizes


@pytest.mark.parametrize(
    "text, named", [("0P1D", "prefill pool of 0"), ("2P0D", "decode pool of 0"),
                    ("2x3", "'2x3'"), ("P1D", "'P1D'")]
)  # fmt: skip
def test_bad_pool_sizes_are_refused_by_name(text, named):
    with pytest.raises(ValueError, match=named):
        PoolSizes.parse(text)


# --------------------------------------------------------- transfer model


@pytest.mark.parametrize(
    "kwargs, named",
    [({"link_bytes_per_s": 0.0}, "0.0"), ({"link_bytes_per_s": -5e9}, "-5"),
     ({"latency_s": -1e-3}, "-0.001"), ({"read_bytes_per_s": 0.0}, "read .* 0.0")],
)  # fmt: skip
def test_a_transfer_model_out_of_range_is_refused_naming_the_value(kwargs, named):
    with pytest.raises(ValueError, match=named):
        TransferModel(**kwargs)


def test_flows_on_one_link_share_its_bandwidth_and_other_links_do_not():
    transfers = Transfers(TransferModel(link_bytes_per_s=1e9, latency_s=0.01))
    for index, (prefill, decode) in enumerate([(0, 0), (0, 0), (0, 1)]):
        transfers.open(index, prefill, decode, 0.0)
        transfers.add_bytes(index, 1e9, 0.0)
        transfers.close(index, 0.0)
    assert transfers.finished_by(1.5) == [(2, pytest.approx(1.01))]
    # The two on link (0, 0) each got half of it: 2 s, then the latency.
    done = transfers.finished_by(3.0)
    assert sorted(i for i, _ in done) == [0, 1]
    assert [s for _, s in done] == [pytest.approx(2.01)] * 2


def test_a_flow_joining_a_link_slows_the_one_already_on_it():
    transfers = Transfers(TransferModel(link_bytes_per_s=1e9, latency_s=0.0))
    transfers.open(0, 0, 0, 0.0)
    transfers.add_bytes(0, 1e9, 0.0)
    transfers.close(0, 0.0)
    transfers.open(1, 0, 0, 0.5)  # 0.5e9 of flow 0 left, now at half rate
    transfers.add_bytes(1, 1e9, 0.5)
    transfers.close(1, 0.5)
    assert transfers.finished_by(10.0) == [
        (0, pytest.approx(1.5)),
        (1, pytest.approx(2.0)),
    ]


def test_a_pushed_flow_is_done_a_latency_after_it_closes_if_drained_before():
    transfers = Transfers(TransferModel(link_bytes_per_s=1e9, latency_s=0.1))
    transfers.open(0, 0, 0, 0.0)
    transfers.add_bytes(0, 1e8, 0.0)  # drained at 0.1
    assert transfers.finished_by(1.0) == []  # not closed: more may come
    transfers.close(0, 1.0)
    assert transfers.finished_by(2.0) == [(0, pytest.approx(1.1))]


# ---------------------------------------------------- runs on real schedulers


@pytest.mark.parametrize("mode", [TransferMode.READ, TransferMode.WRITE])
def test_every_request_goes_prefill_then_transfer_then_decode(mode):
    specs = _specs(40, 3.0)
    prefill, decode = _pools()
    run = simulate_disaggregated(specs, prefill, decode, TransferModel(mode))
    served = [i for i, s in enumerate(specs) if not s.rejected]
    records = run.decode.records
    assert all(records[i].num_tokens == specs[i].output_len for i in served)
    for i in served:
        h, r = run.handoffs[i], records[i]
        assert r.arrival_s <= h.prefill_first_step_s < h.prefill_done_s
        assert h.transfer_start_s <= h.transfer_done_s < r.first_token_s
        # All of the prompt moved, and the decode side had it only then.
        assert h.transfer_bytes == specs[i].input_len * KV_BYTES
        if mode is TransferMode.READ:
            assert h.prefill_done_s == h.sent_s <= h.transfer_start_s
        else:
            assert h.sent_s == r.arrival_s
            assert h.transfer_done_s >= h.prefill_done_s
    # The prefill engines only prefill, the decode engines never do.
    assert run.prefill.decode_steps == 0 and run.prefill.prefill_steps > 0
    assert run.decode.prefill_steps == 0 and run.decode.decode_steps > 0
    assert sum(r.num_preemptions for r in records) == 0


def test_a_storage_transfer_loads_whole_blocks_and_the_decode_computes_the_rest():
    """vLLM's ExampleConnector (the real pair's): the decode engine loads
    the prompt's whole blocks, the last token left out, within its step,
    and prefills the rest; the prefill engine holds nothing after its step."""
    from neuron_scheduler.offline.pd_connector import stored_prompt_tokens

    specs = _specs(40, 3.0)
    prefill, decode = _pools()
    storage = TransferModel(TransferMode.STORAGE, link_bytes_per_s=1e9, latency_s=0.0)
    run = simulate_disaggregated(specs, prefill, decode, storage)
    for i, spec in enumerate(specs):
        if spec.rejected:
            continue
        h, r = run.handoffs[i], run.decode.records[i]
        assert r.num_tokens == spec.output_len
        stored = stored_prompt_tokens(spec.input_len, 32)
        assert h.transfer_bytes == stored * KV_BYTES
        assert h.prefill_done_s == h.sent_s <= h.transfer_start_s < r.first_token_s
        assert h.transfer_done_s - h.transfer_start_s == pytest.approx(
            stored * KV_BYTES / 1e9
        )
    # The rest of each prompt is a prefill on the decode engine.
    assert run.decode.prefill_steps > 0 and run.prefill.decode_steps == 0
    # A prefill cache of two requests at max_model_len: read mode holds
    # them until read; storage frees them after the step that wrote them.
    small = replace(SETTINGS, num_kv_blocks=2 * 4096 // 32 + 1)
    prefill, decode = _pools(prefill_settings=small)
    fast = _specs(30, 20.0)
    held = {}
    for mode in (TransferMode.READ, TransferMode.STORAGE):
        slow = TransferModel(mode, link_bytes_per_s=1e9, latency_s=0.0)
        done = simulate_disaggregated(fast, prefill, decode, slow)
        held[mode] = _overlap(
            [(h.prefill_first_step_s, h.transfer_done_s)
             for h, s in zip(done.handoffs, fast, strict=True) if not s.rejected]
        )  # fmt: skip
    assert held[TransferMode.READ] == 2 < held[TransferMode.STORAGE]


def test_a_storage_transfer_is_charged_to_both_engines_steps():
    from types import SimpleNamespace as NS

    from neuron_scheduler.sim.disaggregated import storage_step_seconds

    model = TransferModel(
        TransferMode.STORAGE,
        link_bytes_per_s=1e8,
        latency_s=0.002,
        read_bytes_per_s=4e8,
    )
    step = NS(scheduled_new_reqs=[
        NS(prompt_token_ids=[1] * 65, num_computed_tokens=64),
        NS(prompt_token_ids=[1] * 20, num_computed_tokens=0),
    ])  # fmt: skip
    write = storage_step_seconds(model, 1000.0, 32, "prefill")(step)
    read = storage_step_seconds(model, 1000.0, 32, "decode")(step)
    # 65 tokens store 64 (20 store none); the decode read the 64 loaded.
    assert write == pytest.approx(0.002 + 64_000 / 1e8)
    assert read == pytest.approx(0.002 + 64_000 / 4e8)
    specs = _specs(30, 1.0)
    prefill, decode = _pools()
    fast = simulate_disaggregated(
        specs,
        prefill,
        decode,
        replace(model, link_bytes_per_s=1e12, read_bytes_per_s=1e12),
    )
    slow = simulate_disaggregated(specs, prefill, decode, model)
    fast_m, slow_m = disaggregated_metrics(fast), disaggregated_metrics(slow)
    assert slow_m["mean_ttft_ms"] > fast_m["mean_ttft_ms"] + 100
    assert slow_m["disaggregated"]["prefill"]["mean_prefill_ms"] > (
        fast_m["disaggregated"]["prefill"]["mean_prefill_ms"] + 100
    )


def test_a_logged_step_is_charged_what_the_simulator_charged_it():
    from neuron_scheduler.sim.disaggregated import storage_line_seconds

    model = TransferModel(
        TransferMode.STORAGE, link_bytes_per_s=1e8, latency_s=0.002,
        read_bytes_per_s=4e8,
    )  # fmt: skip
    # The prefill engine starts prompts of 65 and 20 tokens (65 stores 64).
    prefill_log = [
        {"kind": "prefill", "ids": ["a", "b"], "chunks": [[128, 0], [32, 0]],
         "scheduled": [65, 20]},
        {"kind": "empty", "ids": []},
        {"kind": "prefill", "ids": ["c"], "chunks": [[32, 0]]},  # an older log
    ]  # fmt: skip
    assert storage_line_seconds(model, 1000.0, 32, "prefill", prefill_log) == [
        pytest.approx(0.002 + 64_000 / 1e8), 0.0, 0.0
    ]  # fmt: skip
    # The decode engine reads what a request loaded in its first step only.
    decode_log = [
        {"kind": "prefill", "ids": ["a", "b"], "chunks": [[32, 64], [32, 0]],
         "scheduled": [1, 20]},
        {"kind": "decode", "ids": ["a", "b"]},
        {"kind": "prefill", "ids": ["b"], "chunks": [[32, 20]], "scheduled": [5]},
    ]  # fmt: skip
    assert storage_line_seconds(model, 1000.0, 32, "decode", decode_log) == [
        pytest.approx(0.002 + 64_000 / 4e8), 0.0, 0.0
    ]  # fmt: skip


def test_ttft_includes_the_transfer_at_the_links_bandwidth():
    specs = _specs(30, 1.0)
    prefill, decode = _pools()
    fast = simulate_disaggregated(specs, prefill, decode, TransferModel())
    slow_link = TransferModel(link_bytes_per_s=2e9, latency_s=0.05)
    slow = simulate_disaggregated(specs, prefill, decode, slow_link)
    for i, spec in enumerate(specs):
        if spec.rejected:
            continue
        h = slow.handoffs[i]
        alone = spec.input_len * KV_BYTES / 2e9 + 0.05
        assert h.transfer_done_s - h.transfer_start_s >= alone * (1 - 1e-9)
    fast_m, slow_m = disaggregated_metrics(fast), disaggregated_metrics(slow)
    assert slow_m["mean_ttft_ms"] > fast_m["mean_ttft_ms"] + 50
    transfer = slow_m["disaggregated"]["transfer"]
    assert transfer["mean_transfer_ms"] >= 50


def test_a_transfer_past_the_decode_engines_load_timeout_fails_on_the_virtual_clock():
    """kv_load_timeout_s on the decode pool counts virtual seconds: over a
    link that takes over 0.5 s a transfer, a 2 s timeout lets every request
    through; at 0.2 s a request fails at the decode engine's first step
    past its timeout (only loads that took longer fail), and a failed
    request counts as failed, not as a completion."""
    specs = _specs(20, 2.0)
    slow_link = TransferModel(link_bytes_per_s=2e9, latency_s=0.5)
    served = [i for i, s in enumerate(specs) if not s.rejected]

    def run(timeout_s):
        config = {"kv_loads_take_slots": True, "kv_load_timeout_s": timeout_s}
        prefill, decode = _pools(decode_config=config)
        return simulate_disaggregated(specs, prefill, decode, slow_link)

    patient, hasty = run(2.0), run(0.2)
    patient_metrics, hasty_metrics = map(disaggregated_metrics, (patient, hasty))
    assert patient_metrics["completed"] == len(served)
    assert patient_metrics["failed"] == 0
    failed = [i for i in served if hasty.decode.records[i].failed]
    assert len(failed) > len(served) // 2
    assert hasty_metrics["failed"] == len(failed)
    assert hasty_metrics["completed"] == len(served) - len(failed)
    for i in failed:
        record, handoff = hasty.decode.records[i], hasty.handoffs[i]
        assert record.num_tokens == 0 and record.first_token_s < 0
        assert record.finish_s - handoff.transfer_start_s >= 0.2
    # Pool figures cover the requests that got their first token only.
    decode = hasty_metrics["disaggregated"]["decode"]
    assert decode["mean_first_token_after_transfer_ms"] >= 0


def test_the_prefill_engine_holds_blocks_until_the_decode_side_has_read_them():
    """A prefill cache of two requests at max_model_len and a slow link:
    at most two requests are between their first prefill step and the end
    of their transfer, at any time."""
    specs = _specs(30, 20.0)
    small = replace(SETTINGS, num_kv_blocks=2 * 4096 // 32 + 1)
    prefill, decode = _pools(prefill_settings=small)
    link = TransferModel(link_bytes_per_s=1e9, latency_s=0.0)
    run = simulate_disaggregated(specs, prefill, decode, link)
    held = [
        (h.prefill_first_step_s, h.transfer_done_s)
        for h, s in zip(run.handoffs, specs, strict=True)
        if not s.rejected
    ]
    assert _overlap(held) == 2
    assert all(
        r.finish_s >= 0
        for r, s in zip(run.decode.records, specs, strict=True)
        if not s.rejected
    )


def test_a_decode_engine_pulls_kv_only_into_a_free_slot_by_default():
    specs = _specs(60, 50.0)  # a burst: more transfers than decode slots
    link = TransferModel(link_bytes_per_s=1e9, latency_s=0.0)
    # KV for 32 requests at max_model_len: the KV rule alone allows 32.
    roomy = replace(SETTINGS, num_kv_blocks=32 * 4096 // 32 + 1)

    def most_in_decode(decode_config):
        prefill, decode = _pools(
            prefill=3, decode_config=decode_config, decode_settings=roomy
        )
        run = simulate_disaggregated(specs, prefill, decode, link)
        return _overlap(
            [
                (h.transfer_start_s, r.finish_s)
                for h, r, s in zip(run.handoffs, run.decode.records, specs, strict=True)
                if not s.rejected
            ]
        )

    assert most_in_decode(None) == SETTINGS.max_num_seqs
    assert most_in_decode({"kv_loads_take_slots": False}) > SETTINGS.max_num_seqs


def test_a_pushed_transfer_overlaps_the_prefill_and_a_pulled_one_follows_it():
    specs = _specs(30, 0.5)  # one at a time: no link sharing
    prefill, decode = _pools()
    link = dict(link_bytes_per_s=5e9, latency_s=0.0)
    read = simulate_disaggregated(specs, prefill, decode, TransferModel(**link))
    write = simulate_disaggregated(
        specs, prefill, decode, TransferModel(TransferMode.WRITE, **link)
    )
    long_prompts = [
        i for i, s in enumerate(specs) if s.input_len > 2048 and not s.rejected
    ]
    assert long_prompts
    for i in long_prompts:
        whole = specs[i].input_len * KV_BYTES / 5e9
        pulled, pushed = read.handoffs[i], write.handoffs[i]
        assert pulled.transfer_done_s - pulled.prefill_done_s >= whole * (1 - 1e-9)
        assert pushed.transfer_done_s - pushed.prefill_done_s < 0.75 * whole


def test_pools_spread_requests_and_report_each_engine():
    specs = _specs(80, 8.0)
    prefill, decode = _pools(prefill=2, decode=3)
    run = simulate_disaggregated(specs, prefill, decode, TransferModel())
    metrics = disaggregated_metrics(run)
    assert [r["requests"] for r in metrics["replicas"][:2]] == [
        sum(h.prefill_engine == p for h in run.handoffs) for p in range(2)
    ]
    assert all(r["requests"] > 0 for r in metrics["replicas"])
    assert len(metrics["replicas"]) == 5
    pools = metrics["disaggregated"]
    assert pools["pools"] == "2P3D"
    assert 0 < pools["prefill"]["utilisation"] < 1
    assert 0 < pools["decode"]["utilisation"] <= 1
    assert metrics["completed"] == sum(not s.rejected for s in specs)


@pytest.mark.parametrize("field, value", [("max_model_len", 8192), ("block_size", 16)])
def test_pools_that_disagree_on_what_a_transfer_carries_are_refused(field, value):
    prefill, decode = _pools()
    decode = replace(decode, settings=replace(SETTINGS, **{field: value}))
    with pytest.raises(
        ValueError, match=f"{field} {value} differs .* {getattr(SETTINGS, field)}"
    ):
        check_pools(prefill, decode)


# ------------------------------------------------------------------- CLI


def test_bench_disaggregated_prints_and_writes_every_pool(tmp_path, capsys):
    out = tmp_path / "pd.json"
    code = main(
        ["bench", "--disaggregated", "2p3d", "--num-requests", "40", "--no-progress",
         "--decode-tensor-parallel-size", "8", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "Disaggregated: pools and KV transfer" in printed
    document = json.loads(out.read_text())
    (metrics,) = document["runs"]
    assert metrics["disaggregated"]["prefill"]["engines"] == 2
    assert metrics["disaggregated"]["decode"]["engines"] == 3
    assert "TP8" in document["settings"]["decode"]["cost_model"]
    assert "TP4" in document["settings"]["prefill"]["cost_model"]
    # A TP8 decode engine holds more KV than a TP4 prefill engine.
    assert (
        document["settings"]["decode"]["num_kv_blocks"]
        > document["settings"]["prefill"]["num_kv_blocks"]
    )


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--disaggregated", "0P2D"], "prefill pool of 0"),
        (["--disaggregated", "1P1D", "--kv-link-gb-per-s", "0"], "bandwidth must be > 0"),
        (["--disaggregated", "1P1D", "--kv-transfer-mode", "push"], "'push'"),
        (["--decode-config", "{}" , "--prefill-tensor-parallel-size", "8"],
         "--prefill-tensor-parallel-size applies only with --disaggregated"),
        (["--disaggregated", "1P1D", "--replicas", "2"], "--replicas does not apply"),
        (["--disaggregated", "1P1D", "--decode-config", '{"num_seqs_buckets": [3]}'],
         "num_seqs_buckets"),
    ],
)  # fmt: skip
def test_bench_disaggregated_bad_input_is_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--num-requests", "5", "--no-progress", *argv])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
