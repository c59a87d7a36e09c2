"""The simulator against the real server (``neuron-scheduler validate``).

For a workload at several load levels it

1. profiles the engine (or reads ``--cost-profile``, refused if it was
   measured on another model or engine configuration);
2. starts vLLM's OpenAI server on 127.0.0.1 with ``NeuronScheduler`` and the
   static-shape worker, and replays each level through vLLM's own benchmark
   client (``vllm.benchmarks.serve.benchmark``, self-timed: every request at
   its workload arrival time, its prompt as token ids of the workload's
   length, ``max_tokens`` its output length, EOS ignored);
3. simulates the same requests with the profile (``bench --cost-profile``);
4. reports measured vs simulated mean / median / p90 / p99 TTFT, TPOT, ITL and
   E2EL and output throughput, each relative error, and per level ``mape``:
   the mean absolute percentage error over the TTFT, TPOT and E2EL means.

Both sides compute latencies the same way (``sim.results``); requests
whose prompt does not fit ``max_model_len`` fail on both.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from neuron_scheduler.offline.child_processes import run_in_group
from neuron_scheduler.offline.engine_spec import EngineSpec
from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.calibration import CalibrationError, calibrated, read_step_log
from neuron_scheduler.sim.calibration import fit as calibration_fit
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.results import latency_stats
from neuron_scheduler.sim.slo import DEFAULT_GOODPUT, SLO, goodput_limits
from neuron_scheduler.sim.workload import RequestSpec, WorkloadOptions, build_workload
from neuron_scheduler.step_log import STEP_LOG_ENV

#: The means ``mape`` averages over.
MAPE_METRICS = ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms")
#: What the report compares.
COMPARED = tuple(
    f"{stat}_{metric}_ms"
    for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "p90", "p99")
) + ("output_throughput", "request_goodput")
#: Percentiles reported besides the median and p99 (``latency_stats``).
PERCENTILES = (90.0,)
#: The simulated figures a report keeps.
SIMULATED_KEYS = (*COMPARED, "completed", "failed", "duration")


class ValidateError(ValueError):
    """The validation cannot run as asked (the message says why)."""


@dataclass(frozen=True)
class Level:
    """One load level: an open loop at ``request_rate`` req/s, or a closed
    loop of ``max_concurrency`` users (requests sent as soon as possible)."""

    request_rate: float
    max_concurrency: int | None = None
    #: The share of the measured capacity this rate is (``--load-fractions``).
    load_fraction: float | None = None

    @property
    def open_loop_rate(self) -> float | None:
        """The request rate, ``None`` for a closed loop (JSON has no inf)."""
        return self.request_rate if math.isfinite(self.request_rate) else None

    @property
    def label(self) -> str:
        if self.max_concurrency is not None:
            return f"concurrency {self.max_concurrency}"
        if not math.isfinite(self.request_rate):
            return "capacity (all at once)"
        if self.load_fraction is not None:
            share = f"{100 * self.load_fraction:g}% of capacity"
            return f"rate {self.request_rate:.3g} ({share})"
        return f"rate {self.request_rate:g}"


def levels_of(
    rates: list[float] | None, concurrencies: list[int] | None
) -> list[Level]:
    """The levels the options name. Default: 0.5 and 1 req/s, then 8 users
    (``max_num_seqs``: every slot busy): light load, about 80% of capacity,
    and saturation for the built-in workload on the validation model."""
    levels = [Level(r) for r in rates or []]
    levels += [Level(math.inf, c) for c in concurrencies or []]
    return levels or [Level(0.5), Level(1.0), Level(math.inf, 8)]


#: How ``--load-fractions`` measures capacity (the report states it).
CAPACITY_RULE = (
    "every request at once; capacity = the requests completed between the "
    "10% and the 90% completion times over that time: the service rate while "
    "the queue never empties, the highest open-loop rate at which it does not grow"
)


def check_load_fractions(fractions: list[float]) -> None:
    """``ValidateError`` naming the first fraction outside (0, 1]."""
    for fraction in fractions:
        if not 0 < fraction <= 1:
            raise ValidateError(
                f"load fraction {fraction!r} is outside (0, 1]: a share of the "
                "measured capacity"
            )


def steady_rate(finish_times_s: list[float]) -> float:
    """Requests per second completed between the 10% and the 90% completion
    times of a run that sent every request at once (``CAPACITY_RULE``);
    with fewer than 10 requests, all of them over the last completion."""
    times = sorted(finish_times_s)
    n = len(times)
    if n == 0:
        raise ValidateError("no request completed: no capacity to measure")
    first, last = int(0.1 * n), math.ceil(0.9 * n) - 1
    if n < 10 or times[last] <= times[first]:
        return n / times[-1]
    return (last - first) / (times[last] - times[first])


def prompt_ids(index: int, length: int, vocab: int) -> list[int]:
    """Deterministic token ids for request ``index`` (ids 0-3 are special)."""
    return [(index * 7919 + 13 * j) % (vocab - 4) + 4 for j in range(length)]


def check_profile_matches(
    profile: Profile, spec: EngineSpec, identity: dict[str, Any]
) -> None:
    """Refuse a profile measured on another model or engine configuration,
    naming the first difference."""
    check_profile_engine(profile, spec, identity)
    wanted = spec.resolved_config()
    for key, value in (
        ("num_batched_tokens_buckets", list(wanted.num_batched_tokens_buckets)),
        ("num_seqs_buckets", list(wanted.num_seqs_buckets)),
        ("decode_context_length_buckets", list(wanted.decode_context_length_buckets)),
    ):
        if list(profile.neuron_config.get(key, [])) != value:
            raise ValidateError(
                f"the profile's {key} {profile.neuron_config.get(key)} differ from "
                f"the configuration's {value}"
            )


def check_profile_engine(
    profile: Profile, spec: EngineSpec, identity: dict[str, Any]
) -> None:
    """Refuse a profile measured on another model or engine (its buckets
    aside), naming the first difference."""
    if profile.model.get("config_sha256") != identity["config_sha256"]:
        raise ValidateError(
            f"the profile was measured on model {profile.model.get('path')!r} "
            f"(config {profile.model.get('config_sha256')}), not {identity['path']!r} "
            f"(config {identity['config_sha256']})"
        )
    for key in (
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "kv_cache_memory_bytes",
        "dtype",
        "enforce_eager",
    ):
        if profile.engine.get(key) != getattr(spec, key):
            raise ValidateError(
                f"the profile's engine has {key} = {profile.engine.get(key)!r}, the "
                f"server would run {getattr(spec, key)!r}"
            )


def measured_metrics(
    result: dict[str, Any], goodput: tuple[SLO, ...] = DEFAULT_GOODPUT
) -> dict[str, Any]:
    """``vllm.benchmarks.serve.benchmark``'s per-request results, summarized
    with the simulator's definitions (``goodput``: the SLOs a good request
    meets)."""
    ttft: list[float] = []
    tpot: list[float] = []
    e2el: list[float] = []
    itl: list[float] = []
    output_tokens = 0
    completed = good = 0
    for error, first, latency, n, gaps in zip(
        result["errors"],
        result["ttfts"],
        result["latencies"],
        result["output_lens"],
        result["itls"],
        strict=True,
    ):
        if error:
            continue
        completed += 1
        output_tokens += n
        each = {"ttft": first * 1e3, "e2el": latency * 1e3}
        if n > 1:
            each["tpot"] = (latency - first) * 1e3 / (n - 1)
            tpot.append(each["tpot"])
        ttft.append(each["ttft"])
        e2el.append(each["e2el"])
        good += all(slo.met_by(each) for slo in goodput)
        itl.extend(g * 1e3 for g in gaps)
    metrics: dict[str, Any] = {
        "completed": completed,
        "failed": len(result["errors"]) - completed,
        "duration": result["duration"],
        "output_throughput": output_tokens / result["duration"],
        "request_goodput": good / result["duration"],
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        metrics.update(latency_stats(name, np.asarray(values), PERCENTILES))
    return metrics


def compare(measured: dict[str, Any], simulated: dict[str, Any]) -> dict[str, Any]:
    """Relative error of each compared metric, and ``mape`` (percent)."""
    errors = {
        key: (simulated[key] - measured[key]) / measured[key] if measured[key] else 0.0
        for key in COMPARED
    }
    mape = 100 * float(np.mean([abs(errors[key]) for key in MAPE_METRICS]))
    return {"relative_error": errors, "mape": mape}


async def _replay(
    base_url: str, specs: list[RequestSpec], level: Level, vocab: int
) -> dict[str, Any]:
    from vllm.benchmarks.datasets.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType, benchmark

    requests = [
        SampleRequest(
            prompt=prompt_ids(i, spec.input_len, vocab),
            prompt_len=spec.input_len,
            expected_output_len=spec.output_len,
            timestamp=spec.arrival_s,
            request_id=f"validate-{i}",
        )
        for i, spec in enumerate(specs)
    ]
    # vLLM's client prints its own table: keep our output ours.
    with contextlib.redirect_stdout(io.StringIO()):
        return await benchmark(
            task_type=TaskType.GENERATION,
            endpoint_type="vllm",
            api_url=f"{base_url}/v1/completions",
            base_url=base_url,
            model_id="validate",
            model_name="validate",
            tokenizer=None,
            input_requests=requests,
            logprobs=None,
            request_rate=level.request_rate,
            burstiness=1.0,
            disable_tqdm=True,
            num_warmups=0,
            profile=False,
            selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"],
            selected_percentiles=[50.0, 99.0],
            ignore_eos=True,
            goodput_config_dict={},
            max_concurrency=level.max_concurrency,
            lora_modules=None,
            extra_headers=None,
            extra_body=None,
            ready_check_timeout_sec=0,
            self_timed=True,
        )


def server_args(spec: EngineSpec) -> list[str]:
    """The OpenAI server's command line for ``spec`` (``EngineSpec``)."""
    args = [
        "--served-model-name", "validate",
        "--max-model-len", str(spec.max_model_len),
        "--max-num-batched-tokens", str(spec.max_num_batched_tokens),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes),
        "--dtype", spec.dtype,
        "--no-enable-prefix-caching",
        "--scheduler-cls", "neuron_scheduler.NeuronScheduler",
        "--additional-config", json.dumps({"neuron_config": spec.neuron_config}),
    ]  # fmt: skip
    if spec.worker_cls is not None:
        args += ["--worker-cls", spec.worker_cls]
    if spec.enforce_eager:
        args.append("--enforce-eager")
    if spec.block_size is not None:
        args += ["--block-size", str(spec.block_size)]
    return args


@dataclass(frozen=True)
class ValidateOptions:
    """A validation: the server's engine, the workload and its levels
    (``None``: the default levels), and where the profile and the logs come
    from and go."""

    engine: EngineSpec
    workload: WorkloadOptions
    request_rates: list[float] | None = None
    concurrencies: list[int] | None = None
    cost_profile: str | None = None
    save_profile: str | None = None
    log_dir: str | None = None
    progress: bool = True
    #: Rates as shares of the measured capacity (``None``: the levels above).
    load_fractions: list[float] | None = None
    #: The per-request SLOs goodput counts (``--goodput``).
    goodput: tuple[SLO, ...] = DEFAULT_GOODPUT
    #: Refit the profile to the server's step times on the first level and
    #: simulate the others with it (``sim.calibration``).
    calibrate: bool = False


def check_options(options: ValidateOptions) -> None:
    """``ValidateError`` (or the config's ``ValueError``) for options that
    cannot run, before anything starts."""
    options.engine.resolved_config()
    if options.load_fractions:
        check_load_fractions(options.load_fractions)
        if options.request_rates:
            raise ValidateError(
                f"--request-rate {options.request_rates} and --load-fractions "
                f"{options.load_fractions}: the rates are set by one or the other"
            )


def validate(options: ValidateOptions) -> dict[str, Any]:
    """Profile the engine (or read ``cost_profile``), start the server,
    replay each level through vLLM's benchmark client and simulate it;
    the report ``format_report`` prints. Everything started is stopped."""
    from neuron_scheduler.offline.profiler import model_identity

    check_options(options)
    spec = options.engine
    identity = model_identity(spec.model)
    if options.cost_profile:
        profile = Profile.load(options.cost_profile)
    else:
        profile = measure_profile(spec, options.save_profile, options.progress)
    check_profile_matches(profile, spec, identity)
    return validate_with_profile(options, profile, identity)


def validate_with_profile(
    options: ValidateOptions,
    profile: Profile,
    identity: dict[str, Any],
    log_name: str = "server.log",
) -> dict[str, Any]:
    """``validate`` with a profile that serves ``options.engine``: start the
    server (its log ``log_name`` in the log directory), run the levels,
    stop it."""
    from neuron_scheduler.offline.server import ServerProcess, ServerStartError

    spec = options.engine
    report: dict[str, Any] = {
        "model": identity,
        "engine": asdict(spec),
        "profile": options.cost_profile or "measured for this run",
        "goodput_slo_ms": goodput_limits(options.goodput),
        "levels": [],
    }
    log_dir = Path(options.log_dir or tempfile.mkdtemp(prefix="neuron-validate-"))
    log_path = log_dir / log_name
    step_log = log_path.with_name(f"steps-{log_path.stem}.jsonl")
    step_log.unlink(missing_ok=True)
    print(f"starting the vLLM server (log: {log_path}) ...", file=sys.stderr)
    env = {STEP_LOG_ENV: str(step_log)}
    try:
        server = ServerProcess(spec.model, server_args(spec), log_path, env=env)
        server.start()
    except ServerStartError as error:  # nothing is left running
        raise ValidateError(str(error)) from None
    try:
        _run_levels(options, _Server(server.base_url, step_log), profile, report)
    finally:
        server.stop()
    return report


@dataclass(frozen=True)
class _Server:
    """Where a running server answers, and its step log."""

    base_url: str
    step_log: Path


def _run_levels(
    options: ValidateOptions, server: _Server, profile: Profile, report: dict[str, Any]
) -> None:
    """Every level of ``options`` into ``report["levels"]``: with load
    fractions, the capacity run first and its ``capacity``, then a rate at
    each fraction of the measured capacity (and any concurrency levels).
    With ``calibrate``, the levels after the first simulate with the
    profile refitted to the first one's served steps."""
    fractions = options.load_fractions
    if not fractions:
        levels = levels_of(options.request_rates, options.concurrencies)
    else:
        run = _level(options, server, Level(math.inf), profile)
        report["levels"].append(run.entry)
        report["capacity"] = capacity = _capacity(run)
        rate = capacity["measured_req_s"]
        levels = [Level(f * rate, load_fraction=f) for f in fractions]
        levels += [Level(math.inf, c) for c in options.concurrencies or []]
    if options.calibrate and len(report["levels"]) + len(levels) < 2:
        raise ValidateError("--calibrate fits on the first level: it needs two or more")
    first = run if fractions else None
    for level in levels:
        if options.calibrate and first is not None and "calibration" not in report:
            profile = _calibrate(options, profile, first, report)
        done = _level(options, server, level, profile)
        first = first or done
        report["levels"].append(done.entry)


def _calibrate(
    options: ValidateOptions, profile: Profile, first: LevelRun, report: dict[str, Any]
) -> Profile:
    """The profile refitted to the first level's served steps (kept beside
    ``save_profile`` as ``-calibrated``), its fit in ``report``."""
    calibration = calibration_fit(profile, first.served_steps)
    report["calibration"] = {"level": first.entry["level"], **asdict(calibration)}
    refitted = calibrated(profile, calibration)
    if options.save_profile:
        path = Path(options.save_profile)
        refitted.save(path.with_name(f"{path.stem}-calibrated{path.suffix}"))
    return refitted


def _level(
    options: ValidateOptions, server: _Server, level: Level, profile: Profile
) -> LevelRun:
    """One level, with the served-vs-profiled figures of its steps."""
    seen = len(read_step_log(server.step_log))
    workload = replace(options.workload, request_rate=level.request_rate)
    run = _run_level(
        server.base_url, level, workload, options.engine, profile, options.goodput
    )
    lines = read_step_log(server.step_log)[seen:]
    try:
        run.entry["served_vs_profiled"] = asdict(calibration_fit(profile, lines))
    except CalibrationError as error:
        run.entry["served_vs_profiled"] = {"error": str(error)}
    return replace(run, served_steps=tuple(lines))


def measure_profile(spec: EngineSpec, save_path: str | None, progress: bool) -> Profile:
    """Profile ``spec`` in a child process (kept at ``save_path`` if given)."""
    print("profiling the engine ...", file=sys.stderr)
    path = Path(save_path or tempfile.mkstemp(prefix="neuron-profile-")[1])
    profile_in_child(spec, path, progress=progress)
    return Profile.load(path)


@dataclass(frozen=True)
class LevelRun:
    """One level's report entry, and each side's completion times (seconds
    from the start; ``steady_rate`` reads them)."""

    entry: dict[str, Any]
    measured_finish_s: list[float]
    simulated_finish_s: list[float]
    #: The server's step log lines of this level (``sim.calibration``).
    served_steps: tuple[dict[str, Any], ...] = ()


def _run_level(
    base_url: str,
    level: Level,
    workload: WorkloadOptions,
    spec: EngineSpec,
    profile: Profile,
    goodput: tuple[SLO, ...],
) -> LevelRun:
    """One level measured on the server and simulated."""
    from neuron_scheduler.scheduler import NeuronScheduler
    from neuron_scheduler.sim.engines import Policy
    from neuron_scheduler.sim.results import compute_metrics
    from neuron_scheduler.sim.simulate import simulate

    specs, fit = build_workload(workload, spec.max_model_len)
    print(f"{level.label}: {len(specs)} requests ...", file=sys.stderr)
    vocab = _vocab_size(spec.model)
    result = asyncio.run(_replay(base_url, specs, level, vocab))
    measured = measured_metrics(result, goodput)
    settings = spec.simulated(profile.kv_cache)
    policy = Policy("static", NeuronScheduler, spec.neuron_config)
    cost = ProfileCostModel(profile)
    run = simulate(specs, policy, settings, cost, max_concurrency=level.max_concurrency)
    simulated = compute_metrics(run, goodput, percentiles=PERCENTILES)
    entry = {
        "level": level.label,
        "request_rate": level.open_loop_rate,
        "max_concurrency": level.max_concurrency,
        "load_fraction": level.load_fraction,
        "num_requests": len(specs),
        "fit_to_model_len": asdict(fit),
        "measured": measured,
        "simulated": {k: simulated[k] for k in SIMULATED_KEYS},
        "cost_model": cost.report(),
        **compare(measured, simulated),
    }
    # Sent at once, a request's latency is its completion time.
    measured_finish = [
        latency
        for error, latency in zip(result["errors"], result["latencies"], strict=True)
        if not error
    ]
    simulated_finish = [r.finish_s for r in run.records if not r.failed]
    return LevelRun(entry, measured_finish, simulated_finish)


def _capacity(run: LevelRun) -> dict[str, Any]:
    """The report's ``capacity``: measured and simulated, by ``CAPACITY_RULE``."""
    measured = steady_rate(run.measured_finish_s)
    simulated = steady_rate(run.simulated_finish_s)
    return {
        "rule": CAPACITY_RULE,
        "measured_req_s": measured,
        "simulated_req_s": simulated,
        "relative_error": (simulated - measured) / measured,
    }


def validation_model() -> str:
    """The local validation Llama's directory (made on first use)."""
    from neuron_scheduler.offline.tinymodel import VALIDATION, make_random_llama

    directory = Path(tempfile.gettempdir()) / "neuron-scheduler-validation-llama"
    return str(make_random_llama(directory, VALIDATION))


def profile_in_child(spec: EngineSpec, output: Path, *, progress: bool) -> None:
    """``neuron-scheduler profile`` of ``spec`` in a child process: an
    in-process engine changes this process's environment (vLLM sets
    ``LD_PRELOAD``, OpenMP variables, in-process mode), which the server
    started next would inherit, and keeps threads that compete with the
    benchmark client."""
    command = [
        sys.executable, "-m", "neuron_scheduler", "profile",
        "--model", spec.model,
        "--max-model-len", str(spec.max_model_len),
        "--max-num-batched-tokens", str(spec.max_num_batched_tokens),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes),
        "--dtype", spec.dtype,
        "--neuron-config", json.dumps(spec.neuron_config),
        "--output", str(output),
    ]  # fmt: skip
    if spec.worker_cls:
        command += ["--worker-cls", spec.worker_cls]
    if spec.block_size is not None:
        command += ["--block-size", str(spec.block_size)]
    if not spec.enforce_eager:
        command.append("--compile")
    if not progress:
        command.append("--no-progress")
    code = run_in_group(command, stdout=subprocess.DEVNULL)
    if code != 0:
        raise ValidateError(f"profiling failed (exit {code}): {' '.join(command)}")


def _vocab_size(model: str) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    return int(config["vocab_size"])


def format_report(report: dict[str, Any]) -> str:
    """The capacity (with load fractions), then per level: each metric
    measured, simulated, error; then ``mape``."""
    lines = []
    capacity = report.get("capacity")
    if capacity:
        lines.append(
            f"capacity: measured {capacity['measured_req_s']:.3f} req/s, simulated "
            f"{capacity['simulated_req_s']:.3f} req/s, error "
            f"{100 * capacity['relative_error']:.1f}% ({capacity['rule']})"
        )
    calibration = report.get("calibration")
    if calibration:
        lines.append(
            f"calibrated on {calibration['level']}: served = "
            f"{calibration['scale']:.3f} x profiled + "
            f"{1e3 * calibration['overhead_s']:.2f} ms ({calibration['steps']} steps)"
        )
    for level in report["levels"]:
        measured, simulated = level["measured"], level["simulated"]
        lines.append(
            f"== {level['level']}: {measured['completed']} completed, "
            f"{measured['failed']} failed (simulated {simulated['completed']} / "
            f"{simulated['failed']}); mape {level['mape']:.1f}%"
        )
        served = level.get("served_vs_profiled", {})
        if "median_ratio" in served:
            lines.append(
                f"server steps: median {served['median_ratio']:.3f}x the profile's "
                f"({served['steps']} busy steps)"
            )
        lines.append(f"{'metric':<24}{'measured':>12}{'simulated':>12}{'error':>9}")
        for key in COMPARED:
            error = level["relative_error"][key]
            lines.append(
                f"{key:<24}{measured[key]:>12.2f}{simulated[key]:>12.2f}"
                f"{100 * error:>8.1f}%"
            )
    return "\n".join(lines)
