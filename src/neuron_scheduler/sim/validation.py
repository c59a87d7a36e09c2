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
from neuron_scheduler.sim.profile_cost import ProfileCostModel
from neuron_scheduler.sim.results import latency_stats
from neuron_scheduler.sim.workload import RequestSpec, WorkloadOptions, build_workload

#: The means ``mape`` averages over.
MAPE_METRICS = ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms")
#: What the report compares.
COMPARED = tuple(
    f"{stat}_{metric}_ms"
    for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "p90", "p99")
) + ("output_throughput",)
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

    @property
    def open_loop_rate(self) -> float | None:
        """The request rate, ``None`` for a closed loop (JSON has no inf)."""
        return self.request_rate if math.isfinite(self.request_rate) else None

    @property
    def label(self) -> str:
        if self.max_concurrency is not None:
            return f"concurrency {self.max_concurrency}"
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


def prompt_ids(index: int, length: int, vocab: int) -> list[int]:
    """Deterministic token ids for request ``index`` (ids 0-3 are special)."""
    return [(index * 7919 + 13 * j) % (vocab - 4) + 4 for j in range(length)]


def check_profile_matches(
    profile: Profile, spec: EngineSpec, identity: dict[str, Any]
) -> None:
    """Refuse a profile measured on another model or engine configuration,
    naming the first difference."""
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


def measured_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """``vllm.benchmarks.serve.benchmark``'s per-request results, summarized
    with the simulator's definitions."""
    ttft: list[float] = []
    tpot: list[float] = []
    e2el: list[float] = []
    itl: list[float] = []
    output_tokens = 0
    completed = 0
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
        ttft.append(first * 1e3)
        e2el.append(latency * 1e3)
        if n > 1:
            tpot.append((latency - first) * 1e3 / (n - 1))
        itl.extend(g * 1e3 for g in gaps)
    metrics: dict[str, Any] = {
        "completed": completed,
        "failed": len(result["errors"]) - completed,
        "duration": result["duration"],
        "output_throughput": output_tokens / result["duration"],
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


def validate(options: ValidateOptions) -> dict[str, Any]:
    """Profile the engine (or read ``cost_profile``), start the server,
    replay each level through vLLM's benchmark client and simulate it;
    the report ``format_report`` prints. Everything started is stopped."""
    from neuron_scheduler.offline.profiler import model_identity
    from neuron_scheduler.offline.server import ServerProcess, ServerStartError

    spec = options.engine
    spec.resolved_config()  # a bad neuron_config fails before anything starts
    identity = model_identity(spec.model)
    profile = _profile(options, spec)
    check_profile_matches(profile, spec, identity)
    report: dict[str, Any] = {
        "model": identity,
        "engine": asdict(spec),
        "profile": options.cost_profile or "measured for this run",
        "levels": [],
    }
    log_dir = Path(options.log_dir or tempfile.mkdtemp(prefix="neuron-validate-"))
    log_path = log_dir / "server.log"
    print(f"starting the vLLM server (log: {log_path}) ...", file=sys.stderr)
    try:
        server = ServerProcess(spec.model, server_args(spec), log_path).start()
    except ServerStartError as error:  # nothing is left running
        raise ValidateError(str(error)) from None
    try:
        for level in levels_of(options.request_rates, options.concurrencies):
            workload = replace(options.workload, request_rate=level.request_rate)
            report["levels"].append(
                _run_level(server.base_url, level, workload, spec, profile)
            )
    finally:
        server.stop()
    return report


def _profile(options: ValidateOptions, spec: EngineSpec) -> Profile:
    if options.cost_profile:
        return Profile.load(options.cost_profile)
    print("profiling the engine ...", file=sys.stderr)
    path = Path(options.save_profile or tempfile.mkstemp(prefix="neuron-profile-")[1])
    profile_in_child(spec, path, progress=options.progress)
    return Profile.load(path)


def _run_level(
    base_url: str,
    level: Level,
    workload: WorkloadOptions,
    spec: EngineSpec,
    profile: Profile,
) -> dict[str, Any]:
    """One level measured on the server and simulated: its report entry."""
    from neuron_scheduler.scheduler import NeuronScheduler
    from neuron_scheduler.sim.engines import Policy
    from neuron_scheduler.sim.results import compute_metrics
    from neuron_scheduler.sim.simulate import simulate

    specs, fit = build_workload(workload, spec.max_model_len)
    print(f"{level.label}: {len(specs)} requests ...", file=sys.stderr)
    vocab = _vocab_size(spec.model)
    measured = measured_metrics(asyncio.run(_replay(base_url, specs, level, vocab)))
    settings = spec.simulated(profile.kv_cache)
    policy = Policy("static", NeuronScheduler, spec.neuron_config)
    cost = ProfileCostModel(profile)
    run = simulate(specs, policy, settings, cost, max_concurrency=level.max_concurrency)
    simulated = compute_metrics(run, percentiles=PERCENTILES)
    return {
        "level": level.label,
        "request_rate": level.open_loop_rate,
        "max_concurrency": level.max_concurrency,
        "num_requests": len(specs),
        "fit_to_model_len": asdict(fit),
        "measured": measured,
        "simulated": {k: simulated[k] for k in SIMULATED_KEYS},
        "cost_model": cost.report(),
        **compare(measured, simulated),
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
    """Per level: each metric measured, simulated, error; then ``mape``."""
    lines = []
    for level in report["levels"]:
        measured, simulated = level["measured"], level["simulated"]
        lines.append(
            f"== {level['level']}: {measured['completed']} completed, "
            f"{measured['failed']} failed (simulated {simulated['completed']} / "
            f"{simulated['failed']}); mape {level['mape']:.1f}%"
        )
        lines.append(f"{'metric':<24}{'measured':>12}{'simulated':>12}{'error':>9}")
        for key in COMPARED:
            error = level["relative_error"][key]
            lines.append(
                f"{key:<24}{measured[key]:>12.2f}{simulated[key]:>12.2f}"
                f"{100 * error:>8.1f}%"
            )
    return "\n".join(lines)
