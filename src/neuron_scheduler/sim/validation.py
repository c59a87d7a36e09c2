"""The simulator against the real server (``neuron-scheduler validate``).

For a workload at several load levels it

1. profiles the engine (or reads ``--cost-profile``, refused if it was
   measured on another model or engine configuration);
2. starts vLLM's OpenAI server on 127.0.0.1 with ``NeuronScheduler`` and the
   static-shape worker, and replays each level through vLLM's own benchmark
   client (``replay``);
3. simulates the same requests with the profile (``bench --cost-profile``),
   with ``decode_plane`` its decode shapes put on one plane
   (``sim.decode_plane``), with ``calibrate`` refitted to the capacity
   run's served steps as they run, then each level with it refitted to the
   served steps of every other level (no figure from a fit to its own
   steps: the fit carries what the serving path adds to the profile, this
   server start's own speed, and the served cost of step shapes the
   capacity run alone does not run);
4. reports (``validation_metrics``) measured vs simulated mean / median /
   p90 / p99 TTFT, TPOT, ITL and E2EL, output throughput and goodput, each
   relative error, and per level ``mape``: the mean absolute percentage
   error over the TTFT, TPOT and E2EL means.

Both sides compute latencies the same way (``sim.results``); requests
whose prompt does not fit ``max_model_len`` fail on both.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from neuron_scheduler.offline.child_processes import run_in_group
from neuron_scheduler.offline.cpu_binding import keep_off_worker_cores
from neuron_scheduler.offline.engine_spec import (
    EngineSpec,
    profile_command,
    server_args,
)
from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.calibration import (
    Calibration,
    CalibrationError,
    FitMethod,
    calibrated,
    read_step_log,
    scaled,
    step_log_size,
)
from neuron_scheduler.sim.calibration import fit as calibration_fit
from neuron_scheduler.sim.decode_plane import DecodePlaneError, fit_plane, on_plane
from neuron_scheduler.sim.disaggregated import PoolSizes
from neuron_scheduler.sim.replay import replay, vocab_size
from neuron_scheduler.sim.slo import DEFAULT_GOODPUT, SLO, goodput_limits
from neuron_scheduler.sim.validation_metrics import (
    CAPACITY_RULE,
    PERCENTILES,
    SIMULATED_KEYS,
    STEP_COST_CHANGE,
    client_latencies,
    compare,
    judge,
    measured_metrics,
    request_columns,
    steady_rate,
    step_cost_spread,
)
from neuron_scheduler.sim.validation_plan import (
    MOST_REQUESTS,
    PROFILE_SHARE,
    GivenCount,
    Level,
    LevelsCost,
    check_load_fractions,
    fit_to_time_left,
    level_requests,
    levels_cost,
    levels_of,
    simulate_level,
    size_levels,
)
from neuron_scheduler.sim.workload import (
    FitReport,
    RequestSpec,
    WorkloadOptions,
)
from neuron_scheduler.step_log import STEP_LOG_ENV


class ValidateError(ValueError):
    """The validation cannot run as asked (the message says why)."""


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
    check_profile_kernels(profile)


def check_profile_kernels(profile: Profile) -> None:
    """Refuse a CPU profile whose steps ran other kernels than this machine
    runs (one measured with AVX-512 served where only AVX2 is): the server
    is measured here, so its steps must be profiled here. A profile that
    does not record its kernels is accepted."""
    from neuron_scheduler.offline.profiler import cpu_capability

    measured = profile.platform.get("cpu_capability")
    if measured is None or profile.platform.get("name") != "cpu":
        return
    here = cpu_capability()
    if measured != here:
        raise ValidateError(
            f"the profile's steps ran torch's {measured} CPU kernels "
            f"(on {profile.platform.get('processor')}); this machine runs {here}: "
            "profile it here (leave out --cost-profile)"
        )


@dataclass(frozen=True)
class DisaggregatedValidation:
    """``--disaggregated``: the pool sizes and each role's ``neuron_config``
    (``None``: the validated engine's)."""

    sizes: PoolSizes
    prefill_config: dict[str, Any] | None = None
    decode_config: dict[str, Any] | None = None


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
    #: Refit the profile to the server's step times and simulate each
    #: level with it refitted to every other level (``sim.calibration``).
    calibrate: bool = False
    #: Simulate with the profile's decode shapes on one plane
    #: (``sim.decode_plane``), where the profile allows.
    decode_plane: bool = False
    #: With ``workload.num_requests`` ``None``: the levels get as many
    #: requests as these wall seconds leave room for (``validation_plan``).
    time_budget_s: float | None = None
    #: A real xPyD against the simulated one (``validation_disaggregated``).
    disaggregated: DisaggregatedValidation | None = None


def check_options(options: ValidateOptions) -> None:
    """``ValidateError`` (or the config's ``ValueError``) for options that
    cannot run, before anything starts (``log_dir`` made if missing)."""
    options.engine.resolved_config()
    if options.log_dir is not None:
        log_directory(options.log_dir, "neuron-validate-")
    if options.load_fractions:
        check_load_fractions(options.load_fractions)
        if options.request_rates:
            raise ValidateError(
                f"--request-rate {options.request_rates} and --load-fractions "
                f"{options.load_fractions}: the rates are set by one or the other"
            )


def log_directory(path_text: str | None, temp_prefix: str) -> Path:
    """``path_text`` as a directory, made (with its parents) if missing,
    else a new temporary one named ``temp_prefix...``; ``ValidateError``
    naming the path when it cannot be one."""
    if path_text is None:
        return Path(tempfile.mkdtemp(prefix=temp_prefix))
    path = Path(path_text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValidateError(
            f"--log-dir {path_text!r} cannot be a directory: {error.strerror}"
        ) from None
    return path


def validate(options: ValidateOptions) -> dict[str, Any]:
    """Profile the engine (or read ``cost_profile``), start the server,
    replay each level through vLLM's benchmark client and simulate it;
    the report ``format_report`` prints. Everything started is stopped.
    Colocated only: ``options.disaggregated`` is for
    ``validation_disaggregated.validate_disaggregated``."""
    from neuron_scheduler.offline.profiler import model_identity

    if options.disaggregated is not None:
        raise ValidateError(
            f"validate() runs one colocated engine; {options.disaggregated} is "
            "for validation_disaggregated.validate_disaggregated"
        )
    started = time.monotonic()
    check_options(options)
    spec = options.engine
    identity = model_identity(spec.model)
    if options.cost_profile:
        profile = Profile.load(options.cost_profile)
    else:
        profile = measure_profile(
            spec,
            options.save_profile,
            options.progress,
            fit_seconds=profile_share(options),
        )
    check_profile_matches(profile, spec, identity)
    report = validate_with_profile(options, profile, identity, started=started)
    report["verdict"] = judge(report)
    return report


def profile_share(options: ValidateOptions) -> float | None:
    """The seconds of the time budget the profile may fill before it times
    its shapes fewer times (``None``: no budget, or a fixed request count)."""
    if options.time_budget_s is None or options.workload.num_requests is not None:
        return None
    return PROFILE_SHARE * options.time_budget_s


def predicted_levels(options: ValidateOptions, profile: Profile) -> LevelsCost:
    """What ``options``' levels cost, simulated with ``profile`` as they
    would be sized (``with_decode_plane``; ``validation_plan.levels_cost``)."""
    modelled = with_decode_plane(options, profile, {})
    return levels_cost(
        options.engine, modelled, options.workload, _named_levels(options),
        options.load_fractions,
    )  # fmt: skip


def validate_with_profile(
    options: ValidateOptions,
    profile: Profile,
    identity: dict[str, Any],
    log_name: str = "server.log",
    started: float | None = None,
) -> dict[str, Any]:
    """``validate`` with a profile that serves ``options.engine``: start the
    server (its log ``log_name`` in the log directory), run the levels,
    stop it. ``started`` (``time.monotonic``): when the time budget began
    (default: now)."""
    from neuron_scheduler.offline.profiler import this_machine
    from neuron_scheduler.offline.server import ServerProcess, ServerStartError

    spec = options.engine
    report: dict[str, Any] = {
        "machine": this_machine(),
        "model": identity,
        "engine": asdict(spec),
        "profile": options.cost_profile or "measured for this run",
        "goodput_slo_ms": goodput_limits(options.goodput),
        "levels": [],
    }
    log_path = log_directory(options.log_dir, "neuron-validate-") / log_name
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
        assert server.process is not None
        # The API server, the engine core and this process (the client) off
        # the model worker's core: the forward pass stands in for the
        # accelerator, which the serving path never slows (cpu_binding).
        with keep_off_worker_cores(server.process.pid) as cores:
            report["serving_path_cores"] = sorted(cores)
            modelled = with_decode_plane(options, profile, report)
            began = started or time.monotonic()
            sized, deadline = _sized(options, modelled, report, began)
            server_at = _Server(server.base_url, step_log)
            _run_levels(sized, server_at, modelled, report, profile, deadline)
    finally:
        server.stop()
    return report


def with_decode_plane(
    options: ValidateOptions, profile: Profile, report: dict[str, Any]
) -> Profile:
    """The profile the levels simulate with, before any calibration: with
    ``decode_plane``, its decode shapes on their plane (the plane, or why
    it was kept as measured, in ``report``)."""
    if not options.decode_plane:
        return profile
    try:
        plane = fit_plane(profile)
    except DecodePlaneError as error:
        report["decode_plane"] = {"kept_as_measured": str(error)}
        return profile
    report["decode_plane"] = plane.report()
    return on_plane(profile, plane)


def _sized(
    options: ValidateOptions,
    profile: Profile,
    report: dict[str, Any],
    started: float,
) -> tuple[ValidateOptions, float | None]:
    """``options`` with a request count, and the deadline the levels keep
    to (``time.monotonic``; ``None``: none): the workload's own count, by
    the end of ``time_budget_s`` where one is given too (a comparison's
    later serving, its ``sizing`` in ``report``: ``GivenCount``), else no
    deadline; else as many as ``time_budget_s`` leaves room for (its
    ``sizing`` in ``report``), by the budget's end; else
    ``MOST_REQUESTS``, no deadline."""
    workload = options.workload
    if workload.num_requests is not None:
        if options.time_budget_s is None:
            return options, None
        given = GivenCount(workload.num_requests, options.time_budget_s)
        report["sizing"] = given.report()
        return options, started + options.time_budget_s
    deadline = None
    if options.time_budget_s is None:
        count = MOST_REQUESTS
    else:
        sizing = size_levels(
            options.engine, profile, workload, _named_levels(options),
            options.load_fractions, options.time_budget_s, started,
        )  # fmt: skip
        report["sizing"] = sizing.report()
        print(sizing.describe(), file=sys.stderr)
        count = sizing.requests_per_level
        deadline = started + options.time_budget_s
    sized = replace(options, workload=replace(workload, num_requests=count))
    return sized, deadline


@dataclass(frozen=True)
class _Server:
    """Where a running server answers, and its step log."""

    base_url: str
    step_log: Path


def _named_levels(options: ValidateOptions) -> list[Level]:
    """The levels named by rate or concurrency: with load fractions, the
    concurrency levels that follow them; else ``levels_of``'s."""
    if options.load_fractions:
        return [Level(math.inf, c) for c in options.concurrencies or []]
    return levels_of(options.request_rates, options.concurrencies)


def _run_levels(
    options: ValidateOptions,
    server: _Server,
    profile: Profile,
    report: dict[str, Any],
    measured_profile: Profile,
    deadline: float | None = None,
) -> None:
    """Every level of ``options`` into ``report["levels"]``: with load
    fractions, the capacity run first and its ``capacity``, then a rate at
    each fraction of the measured capacity (and any concurrency levels),
    given a ``deadline`` (``time.monotonic``) as many of the capacity run's
    requests as are predicted to end by it (``_fit_to_deadline``).
    With ``calibrate``, the levels after the first simulate with
    ``profile`` refitted to the first one's served steps as they run, and
    once all have run each level is simulated again with ``profile``
    refitted to the served steps of every other level (``_refit_on_the_
    others``): no figure from a fit to its own steps. Each level simulated
    with another profile than ``measured_profile`` is also simulated with
    that one, as measured (its ``as_profiled``)."""
    fractions = options.load_fractions
    levels = _named_levels(options)
    runs: list[LevelRun] = []
    spans: list[tuple[int, int]] = []  # each level's bytes of the step log

    def run(level: Level, simulated_with: Profile) -> LevelRun:
        start = step_log_size(server.step_log)
        as_profiled = None if simulated_with is measured_profile else measured_profile
        done = _level(options, server, level, simulated_with, modelled, as_profiled)
        spans.append((start, step_log_size(server.step_log)))
        runs.append(done)
        report["levels"].append(done.entry)
        return done

    modelled = profile  # before any fit to the served steps
    if fractions:
        capacity_run = run(Level(math.inf), modelled)
        rate = steady_rate(capacity_run.measured_finish_s)
        levels = [Level(f * rate, load_fraction=f) for f in fractions] + levels
        if options.calibrate:
            profile = _calibrate(options, modelled, capacity_run, report)
        if deadline is not None:
            levels = _fit_to_deadline(options, profile, levels, report, deadline)
    if options.calibrate and len(runs) + len(levels) < 2:
        raise ValidateError("--calibrate fits on the first level: it needs two or more")
    for level in levels:
        if options.calibrate and runs and "calibration" not in report:
            profile = _calibrate(options, modelled, runs[0], report)
        run(level, profile)
    refitted = runs
    if options.calibrate:
        refitted = _refit_on_the_others(options, modelled, runs, spans, server.step_log)
    for done in refitted:
        _add_step_cost_spread(options, done)
    if fractions:
        as_profiled = None
        if refitted[0] is not runs[0]:  # simulated again: keep the first too
            as_profiled = runs[0].as_profiled_finish_s
        report["capacity"] = _capacity(refitted[0], as_profiled)


def _add_decode_speed(
    yardstick: Profile, entry: dict[str, Any], steps: list[dict[str, Any]]
) -> None:
    """``entry`` given its ``decode_speed_x``: the median of the served
    decode ``steps`` over ``yardstick``'s times for them (the profile before
    any fit: one yardstick for every level, where ``served_vs_profiled`` is
    against the profile the level was simulated with). Too few decode
    steps: none."""
    try:
        speed = calibration_fit(yardstick, steps).decode_steps
    except CalibrationError:
        return
    if speed.method is not FitMethod.KEPT:
        entry["decode_speed_x"] = speed.median_ratio


def _fit_to_deadline(
    options: ValidateOptions,
    profile: Profile,
    levels: list[Level],
    report: dict[str, Any],
    deadline: float,
) -> list[Level]:
    """``levels`` sending only as many of the sample as ``fit_to_time_left``
    predicts to end by ``deadline``: where the measured capacity is below
    the simulated one the sizing assumed, the levels' rates are too, and
    the sample would take longer to send. Its ``after_capacity`` in
    ``report["sizing"]``."""
    left = deadline - time.monotonic()
    resizing = fit_to_time_left(options.engine, profile, options.workload, levels, left)
    report["sizing"]["after_capacity"] = resizing.report()
    print(resizing.describe(), file=sys.stderr)
    if resizing.requests_per_level == resizing.sample:
        return levels
    return [replace(lv, first_requests=resizing.requests_per_level) for lv in levels]


def _refit_on_the_others(
    options: ValidateOptions,
    profile: Profile,
    runs: list[LevelRun],
    spans: list[tuple[int, int]],
    step_log: Path,
) -> list[LevelRun]:
    """Each run simulated again with ``profile`` refitted to the served
    steps of every other run (``spans``: each run's bytes of ``step_log``),
    its entry updated: the fit in ``refit_on_the_others``, the errors it
    had before as ``on_the_first_level`` (simulated with the first level's
    fit) or, for the first, as its ``as_profiled`` where it has none.
    A run whose others have too few steps to fit stays as it was, and its
    entry says why."""
    whole = step_log_size(step_log)
    refitted = []
    for index, (done, (start, end)) in enumerate(zip(runs, spans, strict=True)):
        others = read_step_log(step_log, 0, start) + read_step_log(step_log, end, whole)
        try:
            calibration = calibration_fit(profile, others)
        except CalibrationError as error:
            done.entry["refit_on_the_others"] = {"error": str(error)}
            refitted.append(done)
            continue
        done.entry["refit_on_the_others"] = asdict(calibration)
        before = {
            key: done.entry[key] for key in ("relative_error", "mape", "simulated")
        }
        if index == 0:
            done.entry.setdefault("as_profiled", before)
        else:
            done.entry["on_the_first_level"] = before
        refitted.append(
            _simulated_again(options, calibrated(profile, calibration), done)
        )
    return refitted


def _simulated_again(
    options: ValidateOptions, profile: Profile, done: LevelRun
) -> LevelRun:
    """``done``'s requests simulated with ``profile``, its entry's
    simulated figures and errors replaced."""
    again = _simulated(
        options.engine, profile, done.specs, done.entry["max_concurrency"],
        options.goodput,
    )  # fmt: skip
    done.entry.update(
        simulated={key: again.metrics[key] for key in SIMULATED_KEYS},
        cost_model=again.cost_report,
        **compare(done.entry["measured"], again.metrics),
    )
    if "requests" in done.entry:
        done.entry["requests"]["simulated"] = again.by_request
    return replace(done, simulated_finish_s=again.finish_s, profile=profile)


def _add_step_cost_spread(options: ValidateOptions, done: LevelRun) -> None:
    """``done``'s entry given its ``step_cost_spread``: its requests
    simulated again with every step of its profile ``STEP_COST_CHANGE``
    cheaper and dearer."""
    if done.profile is None:
        return
    cheaper, dearer = (
        _simulated(
            options.engine, scaled(done.profile, 1 + sign * STEP_COST_CHANGE),
            done.specs, done.entry["max_concurrency"], options.goodput,
        ).metrics
        for sign in (-1, 1)
    )  # fmt: skip
    done.entry["step_cost_spread"] = step_cost_spread(
        done.entry["simulated"], cheaper, dearer
    )


def _calibrate(
    options: ValidateOptions, profile: Profile, first: LevelRun, report: dict[str, Any]
) -> Profile:
    """The profile refitted to the first level's served steps (kept beside
    ``save_profile`` as ``-calibrated``), its fit in ``report``. Steps too
    few to fit keep the profile, and the report says why."""
    calibration = first.served_fit
    if calibration is None:
        report["calibration"] = {
            "level": first.entry["level"], **first.entry["served_vs_profiled"]
        }  # fmt: skip
        return profile
    report["calibration"] = {"level": first.entry["level"], **asdict(calibration)}
    refitted = calibrated(profile, calibration)
    if options.save_profile:
        refitted.save(beside(options.save_profile, "calibrated"))
    return refitted


def _level(
    options: ValidateOptions,
    server: _Server,
    level: Level,
    profile: Profile,
    yardstick: Profile,
    as_profiled: Profile | None = None,
) -> LevelRun:
    """One level, simulated with ``profile``: the served-vs-profiled
    figures of its steps, its decode speed against ``yardstick``
    (``_add_decode_speed``) and its errors simulated with its steps' own
    costs (``own_steps``: what is left is the scheduling and queueing
    model's, not the step costs'), and, given ``as_profiled``, with that
    profile too (its finish times kept as ``as_profiled_finish_s``:
    ``profile``'s where ``as_profiled`` is ``None``)."""
    seen = step_log_size(server.step_log)
    workload = replace(options.workload, request_rate=level.request_rate)
    run = _run_level(
        server.base_url, level, workload, options.engine, profile, options.goodput
    )
    as_profiled_finish_s = run.simulated_finish_s
    if as_profiled is not None:
        errors, as_profiled_finish_s = _errors_with(options, as_profiled, level, run)
        run.entry["as_profiled"] = errors
    run = replace(run, as_profiled_finish_s=as_profiled_finish_s)
    steps = read_step_log(server.step_log, seen)
    _add_decode_speed(yardstick, run.entry, steps)
    try:
        fit = calibration_fit(profile, steps)
    except CalibrationError as error:
        run.entry["served_vs_profiled"] = {"error": str(error)}
        return run
    run.entry["served_vs_profiled"] = asdict(fit)
    # A diagnostic, never a prediction: this level refitted to itself.
    own = calibrated(profile, fit)
    run.entry["own_steps"], _ = _errors_with(options, own, level, run)
    return replace(run, served_fit=fit)


def _errors_with(
    options: ValidateOptions, profile: Profile, level: Level, done: LevelRun
) -> tuple[dict[str, Any], list[float]]:
    """``compare``'s errors for the requests of ``done`` simulated with
    ``profile`` (the one as measured, or one refitted to the level's own
    steps) with those metrics as ``simulated``, and their finish times."""
    simulated = _simulated(
        options.engine, profile, done.specs, level.max_concurrency, options.goodput
    )
    errors = compare(done.entry["measured"], simulated.metrics)
    return {**errors, "simulated": simulated.metrics}, simulated.finish_s


def measure_profile(
    spec: EngineSpec,
    save_path: str | None,
    progress: bool,
    env: dict[str, str] | None = None,
    fit_seconds: float | None = None,
) -> Profile:
    """Profile ``spec`` in a child process (kept at ``save_path`` if given,
    else written to a temporary file that is removed, read or not;
    ``env``: added to the child's environment, e.g. a core binding;
    ``fit_seconds``: the profile's ``--fit-seconds``)."""
    import os

    print("profiling the engine ...", file=sys.stderr)
    if save_path:
        path = Path(save_path)
    else:
        handle, name = tempfile.mkstemp(prefix="neuron-profile-", suffix=".json")
        os.close(handle)
        path = Path(name)
    try:
        command = profile_command(
            spec, path, progress=progress, fit_seconds=fit_seconds
        )
        child_env = {**os.environ, **env} if env else None
        code = run_in_group(command, stdout=subprocess.DEVNULL, env=child_env)
        if code != 0:
            raise ValidateError(f"profiling failed (exit {code}): {' '.join(command)}")
        return Profile.load(path)
    finally:
        if not save_path:
            path.unlink(missing_ok=True)


@dataclass(frozen=True)
class LevelRun:
    """One level's report entry, the requests it sent, and each side's
    completion times (seconds from the start; ``steady_rate`` reads them)."""

    entry: dict[str, Any]
    specs: list[RequestSpec]
    measured_finish_s: list[float]
    simulated_finish_s: list[float]
    #: The fit of the server's steps to the profile (``None``: too few).
    served_fit: Calibration | None = None
    #: Finish times simulated with the profile as measured (``None``:
    #: not simulated with it).
    as_profiled_finish_s: list[float] | None = None
    #: The profile the entry's simulated figures came from.
    profile: Profile | None = None


def replay_level(
    base_url: str,
    level: Level,
    workload: WorkloadOptions,
    spec: EngineSpec,
    goodput: tuple[SLO, ...],
) -> tuple[list[RequestSpec], FitReport, dict[str, Any], dict[str, Any]]:
    """``level``'s requests (``level_requests`` of ``workload``, fitted to
    ``spec``'s ``max_model_len``), replayed on the server at ``base_url``:
    the requests, the fit, the benchmark client's result and its
    ``measured_metrics``."""
    specs, fit = level_requests(
        workload, level.request_rate, spec.max_model_len, level.first_requests
    )
    print(f"{level.label}: {len(specs)} requests ...", file=sys.stderr)
    vocab = vocab_size(spec.model)
    result = asyncio.run(
        replay(base_url, specs, level.request_rate, level.max_concurrency, vocab)
    )
    return specs, fit, result, measured_metrics(result, goodput)


def level_entry(
    level: Level,
    specs: list[RequestSpec],
    fit: FitReport,
    measured: dict[str, Any],
    simulated: dict[str, Any],
    **extra: Any,
) -> dict[str, Any]:
    """A level's report entry: what ran, measured, simulated (``extra``
    after it), and each error."""
    return {
        "level": level.label,
        "request_rate": level.open_loop_rate,
        "max_concurrency": level.max_concurrency,
        "load_fraction": level.load_fraction,
        "num_requests": len(specs),
        "fit_to_model_len": asdict(fit),
        "measured": measured,
        "simulated": {k: simulated[k] for k in SIMULATED_KEYS},
        **extra,
        **compare(measured, simulated),
    }


def beside(path_text: str, tag: str) -> Path:
    """``FILE-tag.ext`` beside ``FILE.ext``."""
    path = Path(path_text)
    return path.with_name(f"{path.stem}-{tag}{path.suffix}")


def _run_level(
    base_url: str,
    level: Level,
    workload: WorkloadOptions,
    spec: EngineSpec,
    profile: Profile,
    goodput: tuple[SLO, ...],
) -> LevelRun:
    """One level measured on the server and simulated, each request's
    latencies on both sides kept as the entry's ``requests``."""
    specs, fit, result, measured = replay_level(
        base_url, level, workload, spec, goodput
    )
    simulated = _simulated(spec, profile, specs, level.max_concurrency, goodput)
    entry = level_entry(
        level, specs, fit, measured, simulated.metrics,
        cost_model=simulated.cost_report,
    )  # fmt: skip
    entry["requests"] = request_columns(
        specs, client_latencies(result), simulated.by_request, result["errors"]
    )
    # Sent at once, a request's latency is its completion time.
    measured_finish = [
        latency
        for error, latency in zip(result["errors"], result["latencies"], strict=True)
        if not error
    ]
    return LevelRun(entry, specs, measured_finish, simulated.finish_s, profile=profile)


@dataclass(frozen=True)
class _Simulation:
    """One simulation of a level's requests: ``compute_metrics``'s figures,
    the cost model's report, each completed request's finish time, and
    each request's latencies (``latencies_by_request``)."""

    metrics: dict[str, Any]
    cost_report: dict[str, Any]
    finish_s: list[float]
    by_request: list[dict[str, float] | None]


def _simulated(
    spec: EngineSpec,
    profile: Profile,
    specs: list[RequestSpec],
    max_concurrency: int | None,
    goodput: tuple[SLO, ...],
) -> _Simulation:
    """``specs`` through ``simulate_level`` with ``profile``, measured as
    the report measures a level."""
    from neuron_scheduler.sim.results import compute_metrics, latencies_by_request

    run, cost_report = simulate_level(spec, profile, specs, max_concurrency)
    metrics = compute_metrics(run, goodput, percentiles=PERCENTILES)
    finish_s = [r.finish_s for r in run.records if not r.failed]
    return _Simulation(metrics, cost_report, finish_s, latencies_by_request(run))


def _capacity(
    run: LevelRun, as_profiled_finish_s: list[float] | None
) -> dict[str, Any]:
    """The report's ``capacity``, by ``CAPACITY_RULE``: measured, and
    simulated as ``run`` was and, given ``as_profiled_finish_s``, as the
    profile as measured simulated it."""
    measured = steady_rate(run.measured_finish_s)
    simulated = steady_rate(run.simulated_finish_s)
    capacity = {
        "rule": CAPACITY_RULE,
        "measured_req_s": measured,
        "simulated_req_s": simulated,
        "relative_error": (simulated - measured) / measured,
    }
    if as_profiled_finish_s is not None:
        before = steady_rate(as_profiled_finish_s)
        capacity["as_profiled"] = {
            "simulated_req_s": before,
            "relative_error": (before - measured) / measured,
        }
    return capacity


def validation_model() -> str:
    """The local validation Llama's directory (made on first use)."""
    from neuron_scheduler.offline.tinymodel import VALIDATION, make_random_llama

    directory = Path(tempfile.gettempdir()) / "neuron-scheduler-validation-llama"
    return str(make_random_llama(directory, VALIDATION))
