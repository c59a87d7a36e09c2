"""``validate --disaggregated``: a real xPyD on this machine against the
simulator's (the storage transfer measured here); bad input refused before
anything starts; everything started stopped."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import TINY_ENGINE_ARGV, load_script
from neuron_scheduler.cli import main
from neuron_scheduler.offline.engine_spec import EngineSpec
from neuron_scheduler.offline.pd_servers import (
    StorageTimes,
    kv_folder_parent,
    measure_storage,
)
from neuron_scheduler.offline.profiler import cpu_capability
from neuron_scheduler.sim.disaggregated import PoolSizes
from neuron_scheduler.sim.kv_transfer import TransferMode
from neuron_scheduler.sim.validation import (
    DisaggregatedValidation,
    ValidateError,
    ValidateOptions,
    validate,
)
from neuron_scheduler.sim.validation_disaggregated import (
    check_disaggregated_options,
    pair_of,
    transfer_model,
)
from neuron_scheduler.sim.validation_metrics import (
    MAPE_METRICS,
    PAIR_TARGETS,
    format_report,
    judge,
)
from neuron_scheduler.sim.workload import WorkloadOptions
from test_validate import _judged_level
from test_validate_requests import _level_with_requests


def _options(**split):
    spec = EngineSpec(
        model="m", max_model_len=2048, max_num_batched_tokens=512,
        neuron_config={"num_seqs_buckets": [4, 8]},
    )  # fmt: skip
    return ValidateOptions(
        engine=spec,
        workload=WorkloadOptions(),
        disaggregated=DisaggregatedValidation(PoolSizes(1, 1), **split),
    )


def test_the_prefill_engine_never_chunks_and_each_role_takes_its_config():
    pair = pair_of(_options(decode_config={"num_seqs_buckets": [2, 8]}))
    assert pair.prefill.max_num_batched_tokens == 2048
    assert pair.decode.max_num_batched_tokens == 512
    assert pair.prefill.neuron_config == {"num_seqs_buckets": [4, 8]}
    assert pair.decode.neuron_config == {"num_seqs_buckets": [2, 8]}
    check_disaggregated_options(_options())


@pytest.mark.parametrize(
    "split, named",
    [({"prefill_config": {"num_seqs_buckets": [3]}}, "num_seqs_buckets"),
     ({"decode_config": {"bogus": 1}}, "bogus")],
)  # fmt: skip
def test_a_bad_role_config_is_refused_by_name(split, named):
    with pytest.raises((ValidateError, ValueError), match=named):
        check_disaggregated_options(_options(**split))


@pytest.mark.parametrize(
    "argv, named",
    [(["--prefill-config", "{}"], "only apply with --disaggregated"),
     (["--disaggregated", "1P1D", "--load-fractions", "0.5"], "--load-fractions"),
     (["--disaggregated", "0P1D"], "prefill pool of 0"),
     (["--disaggregated", "1P1D", "--config", "a={}", "--config", "b={}"], "--config")],
)  # fmt: skip
def test_bad_disaggregated_input_is_refused_before_anything_starts(
    argv, named, capsys, tmp_path
):
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", "--model", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_the_colocated_validate_refuses_a_pair_before_anything_starts():
    # The CLI sends --disaggregated to validate_disaggregated; a caller that
    # hands a pair to the colocated run is told so, not given a colocated run.
    options = _options()
    with pytest.raises(ValidateError, match="validate_disaggregated"):
        validate(options)


def test_a_calibration_run_says_so_in_its_label():
    from neuron_scheduler.sim.validation_plan import Level

    assert Level(0.25, calibration=True).label == "calibration run (rate 0.25)"
    assert Level(0.25).label == "rate 0.25"


def test_a_load_run_twice_gives_the_machines_own_drift():
    from neuron_scheduler.sim.validation_metrics import (
        COMPARED,
        format_report,
        repeat_of,
    )

    def entry(label, rate, ttft, requests=40):
        measured = {key: 10.0 for key in COMPARED} | {"mean_ttft_ms": ttft}
        return {"level": label, "request_rate": rate, "max_concurrency": None,
                "num_requests": requests, "measured": measured}  # fmt: skip

    levels = [entry("calibration run (rate 0.25)", 0.25, 100.0),
              entry("rate 0.4", 0.4, 90.0), entry("rate 0.25", 0.25, 123.0)]  # fmt: skip
    repeat = repeat_of(levels)
    assert repeat["levels"] == ["calibration run (rate 0.25)", "rate 0.25"]
    assert repeat["difference"]["mean_ttft_ms"] == pytest.approx(0.23)
    assert repeat["difference"]["mean_tpot_ms"] == 0.0
    line = format_report({"levels": [], "repeat": repeat})
    assert line == (
        "the same load measured twice (calibration run (rate 0.25), then rate "
        "0.25): TTFT +23.0%, TPOT +0.0%, E2EL +0.0% (the machine's own drift)"
    )
    # Another request count is another load; no load twice, no figure.
    assert repeat_of([levels[0], entry("rate 0.25", 0.25, 99.0, requests=20)]) is None


def test_the_pairs_levels_are_held_to_its_own_targets():
    # The pair measures no capacity: every level but the calibration run is
    # held to every mean within 15%, two levels at least; p99s not held.
    calibration = _judged_level("calibration run (rate 2)", None, {"mean_ttft_ms": 0.5})
    met = _judged_level("rate 2", None, {"mean_ttft_ms": -0.14, "p99_itl_ms": 0.9})
    slow = _level_with_requests([100.0] * 10, [120.0] * 9 + [250.0])
    slow["level"], slow["load_fraction"] = "rate 4", None
    fast = _judged_level("rate 8", None, {"mean_e2el_ms": -0.18})
    report = {
        "levels": [calibration, met, slow, fast],
        "calibration": {
            "level": calibration["level"],
            **{role: {"error": "too few busy steps"} for role in ("prefill", "decode")},
        },
    }
    verdict = judge(report, PAIR_TARGETS)
    judged = {level["level"]: level["missed"] for level in verdict["levels"]}
    assert judged["rate 2"] == [] and set(judged) == {"rate 2", "rate 4", "rate 8"}
    assert [(m["metric"], m["target"]) for m in judged["rate 8"]] == [
        ("mean_e2el_ms", 0.15)
    ]
    assert verdict["means_met"] == {"levels": 1, "of": 3, "needed": 2, "met": False}
    # A mean missed names its largest request: the tenth, 150 ms of the
    # 1,000 measured; the other nine, 20% slow, still miss without it.
    (miss,) = judged["rate 4"]
    largest = miss["largest_request"]
    assert (largest["request"], largest["carried"]) == (9, pytest.approx(0.15))
    assert largest["error_without"] == pytest.approx(0.2)
    assert largest["met_without"] is False
    # The colocated targets judge only shares of capacity.
    assert judge(report)["levels"] == []
    report["verdict"] = verdict
    text = format_report(report).splitlines()
    assert "targets: TTFT, TPOT and E2EL means within 15% at 2 levels at least" in text
    assert "  rate 8: missed mean_e2el_ms -18.0% (target 15%)" in text
    assert any("request 9 (109 + 19 tokens) carries +15.0 points" in t for t in text)
    assert "  every mean met at 1 of 3 levels (target: 2 at least): missed" in text
    # Two levels meeting every mean meet the target.
    fast["relative_error"]["mean_e2el_ms"] = -0.1
    assert judge(report, PAIR_TARGETS)["means_met"]["met"] is True


def test_the_storage_transfer_is_measured_on_this_machine(tmp_path):
    times = measure_storage(tmp_path, 2, 1024, tokens=(16, 256), repeats=1)
    assert times.write_bytes_per_s > 0 and times.read_bytes_per_s > 0
    assert times.write_s >= 0 and times.read_s >= 0
    model = transfer_model(StorageTimes(0.001, 1e8, 0.003, 1e9))
    assert model.mode is TransferMode.STORAGE
    assert model.write_s(1e6) == pytest.approx(0.002 + 0.01)
    assert model.read_s(1e6) == pytest.approx(0.002 + 0.001)


@pytest.mark.slow
@pytest.mark.timing
def test_validate_disaggregated_end_to_end(tiny_model_dir, tmp_path, capsys):
    from test_validate import _servers_running

    report_path = tmp_path / "report.json"
    flags = [
        "--model", str(tiny_model_dir), *TINY_ENGINE_ARGV,
        "--block-size", "32",
        "--disaggregated", "1P1D",
        "--decode-config", json.dumps({"num_seqs_buckets": [2, 4]}),
        "--num-requests", "10", "--request-rate", "4", "8", "--calibrate",
        "--decode-plane",
        "--random-input-len", "100", "--random-output-len", "10",
    ]  # fmt: skip
    code = main(
        [
            "validate", *flags,
            "--save-profile", str(tmp_path / "profile.json"),
            "--json", str(report_path), "--log-dir", str(tmp_path), "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(report_path.read_text())
    assert report["machine"]["cpu_capability"] == cpu_capability()
    split = report["disaggregated"]
    assert split["sizes"] == "1P1D"
    assert split["prefill_engine"]["max_num_batched_tokens"] == 512
    assert split["decode_engine"]["neuron_config"] == {"num_seqs_buckets": [2, 4]}
    assert split["transfer"]["mode"] == "storage"
    assert split["transfer"]["link_bytes_per_s"] > 0
    # The KV folder: in memory where there is room, removed at the end.
    parent = kv_folder_parent()
    assert parent is None or Path(split["kv_folder"]).parent == parent
    assert not Path(split["kv_folder"]).exists()
    # A calibration run at the first level's load, then the levels named.
    assert [level["level"] for level in report["levels"]] == [
        "calibration run (rate 4)",
        "rate 4",
        "rate 8",
    ]
    for level in report["levels"]:
        assert level["measured"]["completed"] == level["simulated"]["completed"] == 10
        for key in ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms"):
            measured, simulated = level["measured"][key], level["simulated"][key]
            assert measured > 0 and simulated > 0
            assert level["relative_error"][key] == pytest.approx(
                (simulated - measured) / measured
            )
            # Each request on both sides, those the means are of.
            name = key.removeprefix("mean_").removesuffix("_ms")
            for side, figures in (("measured", measured), ("simulated", simulated)):
                values = [each[name] for each in level["requests"][side]]
                assert len(values) == 10 and np.mean(values) == pytest.approx(figures)
    # The verdict: each level named (not the calibration run) held to the
    # pair's targets; a missed mean names its largest request.
    verdict = report["verdict"]
    assert verdict["targets"] == PAIR_TARGETS.describe()
    assert [level["level"] for level in verdict["levels"]] == ["rate 4", "rate 8"]
    met = 0
    for judged, level in zip(verdict["levels"], report["levels"][1:], strict=True):
        errors = level["relative_error"]
        beyond = [key for key in MAPE_METRICS if abs(errors[key]) > 0.15]
        assert [miss["metric"] for miss in judged["missed"]] == beyond
        met += not beyond
        for miss in judged["missed"]:
            assert 0 <= miss["largest_request"]["request"] < 10
    assert verdict["means_met"] == {
        "levels": met,
        "of": 2,
        "needed": 2,
        "met": met == 2,
    }
    # Calibrated on that run from each server's own step log: the decode
    # engine's steps follow each other; the prefill engine's do not (its
    # requests end in their one step), so it keeps its profile. The levels
    # named are simulated with the refitted profiles and, apart, with the
    # profiles as measured; the calibration run with those alone.
    calibration = report["calibration"]
    assert calibration["level"] == "calibration run (rate 4)"
    assert "as_profiled" not in report["levels"][0]
    for level in report["levels"][1:]:
        before = level["as_profiled"]
        assert set(before["relative_error"]) == set(level["relative_error"])
        assert before["relative_error"] != level["relative_error"]
    decode_steps = calibration["decode"]["decode_steps"]
    assert decode_steps["scale"] > 0 and decode_steps["steps"] >= 20
    assert "busy steps" in calibration["prefill"]["error"]
    # Each level: its engines' steps against the profiles it was simulated
    # with, and the level at those steps' own costs (the calibration run's
    # own fit is the calibration).
    assert report["levels"][0]["served_vs_profiled"] == {
        "prefill": calibration["prefill"], "decode": calibration["decode"]
    }  # fmt: skip
    for level in report["levels"]:
        served = level["served_vs_profiled"]
        assert served["decode"]["decode_steps"]["steps"] >= 20
        assert "busy steps" in served["prefill"]["error"]
        own = level["own_steps"]
        assert own["simulated"]["completed"] == 10
        assert own["relative_error"] != level["relative_error"]
    # scripts/pd-resimulate.py gives the levels' errors again from the
    # saved profiles, logs and report, predicted and at own steps' costs.
    again = load_script("pd-resimulate.py").resimulate(tmp_path, flags)
    assert [level.level for level in again] == ["rate 4", "rate 8"]
    for resimulated, level in zip(again, report["levels"][1:], strict=True):
        assert resimulated.predicted["relative_error"] == pytest.approx(
            level["relative_error"]
        )
        assert resimulated.own_steps["relative_error"] == pytest.approx(
            level["own_steps"]["relative_error"]
        )
    assert (tmp_path / "profile-decode-calibrated.json").exists()
    # The decode engine's decode shapes on their plane, then calibrated.
    plane = report["decode_plane"]
    # (A tiny model's per-row parts are ~0: each is >= 0, never below.)
    assert plane["shapes"] >= 4 and plane["intercept_ms"] > 0
    assert plane["per_row_ms"] >= 0 and plane["per_row_token_us"] >= 0
    refitted = json.loads((tmp_path / "profile-decode-calibrated.json").read_text())
    assert refitted["meta"]["decode_plane"] == plane
    assert (tmp_path / "steps-decode-0.jsonl").exists()
    # Each role profiled on its own; the servers' logs kept.
    for role in ("prefill", "decode"):
        assert Path(tmp_path / f"profile-{role}.json").exists()
        # Each server ran its bucket shapes before the first request.
        log = Path(tmp_path / f"{role}-0.log").read_text()
        assert "bucket shapes run at start" in log
    output = capsys.readouterr().out
    assert f"torch's {cpu_capability()} CPU kernels" in output
    assert "disaggregated 1P1D" in output and "KV transfer storage" in output
    assert "calibrated decode on calibration run (rate 4)" in output
    # The calibration run and the level at its load: the machine's drift.
    assert report["repeat"]["levels"] == ["calibration run (rate 4)", "rate 4"]
    assert "the same load measured twice" in output
    assert "(as profiled: mape" in output
    assert (
        output.count("server steps, median of served / profiled: prefill engine's none")
        == 3
    )
    assert output.count("simulated at these steps' own costs: mape") == 3
    assert "decode shapes on one plane: " in output
    assert _servers_running(str(tiny_model_dir)) == []
