"""``validate --disaggregated xPyD``: the simulator's xPyD against a real
one on this machine (``offline.pd_servers``).

1. profiles each role's engine (one profile when both roles run the same
   engine; ``--cost-profile`` serves both); with ``decode_plane`` the
   decode engine's decode shapes are put on their plane;
2. measures the connector's folder on this machine (``measure_storage``:
   writes and reads of each layer's KV file), the transfer model the
   simulator charges (``TransferMode.STORAGE``);
3. starts the prefill and decode servers and the read-mode proxy, replays
   each level through vLLM's benchmark client against the proxy, and
   simulates it with ``simulate_disaggregated``; with ``calibrate``, a
   calibration run at the first level's load comes first and every level
   named is simulated with the profiles refitted to it (and, as
   ``as_profiled``, with the measured ones); each level is also simulated
   with each role's profile refitted to its own steps (``own_steps``, a
   diagnostic);
4. reports as ``validate`` does (``validation_metrics``), with the pools and
   the transfer model, and a verdict against ``PAIR_TARGETS`` (every mean
   within 15% at two levels at least; no capacity is measured, so each
   level but the calibration run is held to them): a missed mean names
   the request that carries most of it (each level keeps its ``requests``).

The prefill engine's ``max_num_batched_tokens`` is raised to
``max_model_len``: the connector stores a prompt only when one step
prefills all of it (``check_pair``). Everything started is stopped.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron_scheduler.offline.cpu_binding import on_cores
from neuron_scheduler.offline.pd_servers import PairSpec, StorageTimes
from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.sim.calibration import (
    Calibration,
    CalibrationError,
    calibrated,
    read_step_log,
    step_log_size,
)
from neuron_scheduler.sim.calibration import fit as calibration_fit
from neuron_scheduler.sim.kv_transfer import TransferMode, TransferModel
from neuron_scheduler.sim.results import latencies_by_request
from neuron_scheduler.sim.validation import (
    ValidateError,
    ValidateOptions,
    beside,
    check_profile_matches,
    level_entry,
    log_directory,
    measure_profile,
    replay_level,
    with_decode_plane,
)
from neuron_scheduler.sim.validation_metrics import (
    PAIR_TARGETS,
    PERCENTILES,
    client_latencies,
    compare,
    judge,
    repeat_of,
    request_columns,
)
from neuron_scheduler.sim.validation_plan import Level, levels_of
from neuron_scheduler.sim.workload import FitReport, RequestSpec
from neuron_scheduler.step_log import STEP_LOG_ENV

if TYPE_CHECKING:
    from neuron_scheduler.offline.pd_servers import DisaggregatedServers
    from neuron_scheduler.sim.disaggregated import DisaggregatedRun


#: A role's connector seconds for each line of its step log.
ConnectorSeconds = Callable[[str, Profile, Sequence[dict[str, Any]]], list[float]]


def pair_of(options: ValidateOptions) -> PairSpec:
    """The engines of each role: the validated engine with each role's
    ``neuron_config`` (default: the engine's), the prefill engine's
    ``max_num_batched_tokens`` at least ``max_model_len``."""
    spec, split = options.engine, options.disaggregated
    assert split is not None
    prefill = replace(
        spec,
        max_num_batched_tokens=max(spec.max_num_batched_tokens, spec.max_model_len),
        neuron_config=dict(
            spec.neuron_config if split.prefill_config is None else split.prefill_config
        ),
    )
    decode = replace(
        spec,
        neuron_config=dict(
            spec.neuron_config if split.decode_config is None else split.decode_config
        ),
    )
    return PairSpec(prefill, decode, split.sizes.prefill, split.sizes.decode)


def check_disaggregated_options(options: ValidateOptions) -> PairSpec:
    """The pair, or ``ValidateError`` for what a disaggregated validation
    does not run, naming it."""
    from neuron_scheduler.offline.pd_servers import check_pair

    if options.load_fractions:
        raise ValidateError("--load-fractions is not available with --disaggregated")
    if options.log_dir is not None:
        log_directory(options.log_dir, "neuron-validate-pd-")
    pair = pair_of(options)
    try:
        pair.prefill.resolved_config()
        pair.decode.resolved_config()
        check_pair(pair)
    except ValueError as error:
        raise ValidateError(f"--disaggregated: {error}") from None
    return pair


def transfer_model(times: StorageTimes) -> TransferModel:
    """The simulator's ``STORAGE`` transfer for the measured folder."""
    return TransferModel(
        TransferMode.STORAGE,
        link_bytes_per_s=times.write_bytes_per_s,
        latency_s=(times.write_s + times.read_s) / 2,
        read_bytes_per_s=times.read_bytes_per_s,
    )


def validate_disaggregated(options: ValidateOptions) -> dict[str, Any]:
    """Profile both roles, measure the folder, start the pair, run and
    simulate every level: the report ``format_report`` prints."""
    from neuron_scheduler.offline.pd_servers import DisaggregatedServers
    from neuron_scheduler.offline.profiler import model_identity
    from neuron_scheduler.offline.server import ServerStartError

    pair = check_disaggregated_options(options)
    identity = model_identity(pair.prefill.model)
    profiles = _profiles(options, pair, identity)
    plane: dict[str, Any] = {}
    # Only the decode engine runs decode steps worth a plane.
    profiles["decode"] = with_decode_plane(options, profiles["decode"], plane)
    log_dir = log_directory(options.log_dir, "neuron-validate-pd-")
    step_logs = {role: log_dir / f"steps-{role}-0.jsonl" for role in profiles}
    for path in step_logs.values():
        path.unlink(missing_ok=True)
    env = {role: {STEP_LOG_ENV: str(path)} for role, path in step_logs.items()}
    # The servers' own KV folder (in memory where there is room), measured
    # before they start and removed when they stop, whatever happens.
    servers = DisaggregatedServers(pair, log_dir, env=env)
    try:
        transfer = transfer_model(_measure_folder(servers.storage, pair.prefill.model))
        report = _report_head(options, pair, identity, transfer, plane, servers)
        print(f"{transfer.describe()}; starting the servers (logs: {log_dir}) ...",
              file=sys.stderr)  # fmt: skip
        try:
            servers.start()
        except ServerStartError as error:  # nothing is left running
            raise ValidateError(str(error)) from None
        # The client runs where the servers put it (``DisaggregatedServers``).
        with on_cores(servers.client_cores):
            _run_levels(options, servers, pair, profiles, transfer, report, step_logs)
    finally:
        servers.stop()
    report["verdict"] = judge(report, PAIR_TARGETS)
    return report


def _report_head(
    options: ValidateOptions,
    pair: PairSpec,
    identity: dict[str, Any],
    transfer: TransferModel,
    plane: dict[str, Any],
    servers: DisaggregatedServers,
) -> dict[str, Any]:
    """The report before its levels: the machine, the model, the engines,
    the pair (its KV folder ``servers.storage``)."""
    from neuron_scheduler.offline.profiler import this_machine

    assert options.disaggregated is not None
    return {
        "machine": this_machine(),
        "model": identity,
        "engine": asdict(options.engine),
        "disaggregated": {
            "sizes": str(options.disaggregated.sizes),
            "prefill_engine": asdict(pair.prefill),
            "decode_engine": asdict(pair.decode),
            "transfer": {**asdict(transfer), "mode": transfer.mode.value},
            "transfer_model": transfer.describe(),
            "kv_folder": str(servers.storage),
        },
        "profile": options.cost_profile or "measured for this run",
        **plane,
        "levels": [],
    }


def _run_levels(
    options: ValidateOptions,
    servers: DisaggregatedServers,
    pair: PairSpec,
    profiles: dict[str, Profile],
    transfer: TransferModel,
    report: dict[str, Any],
    step_logs: dict[str, Path],
) -> None:
    """Every level replayed and simulated, into ``report["levels"]``. With
    ``--calibrate``, a calibration run at the first level's load comes
    first (reported as a level, simulated with the profiles as measured),
    each role's profile is refitted to it, and every named level is
    simulated with the refitted profiles and, as ``as_profiled``, with
    the measured ones: each is a prediction, none the fit's own data.
    Each level also says what its engines' steps cost against the
    profiles it was simulated with (``served_vs_profiled``, a role each)
    and what it gives simulated at those costs (``own_steps``: a
    diagnostic, never a prediction)."""
    levels = levels_of(options.request_rates, options.concurrencies)
    measured_profiles: dict[str, Profile] | None = None
    connector_s = connector_seconds(pair, transfer)
    if options.calibrate:
        levels = [replace(levels[0], calibration=True), *levels]
    for level in levels:
        # The levels send the same prompts: none may find the last's KV.
        servers.clear_storage()
        seen = {role: step_log_size(path) for role, path in step_logs.items()}
        entry, simulate = _measured_and_simulated(
            options, servers.base_url, pair, transfer, level, profiles,
            measured_profiles,
        )  # fmt: skip
        lines = {
            role: read_step_log(path, seen[role]) for role, path in step_logs.items()
        }
        fits = role_fits(profiles, lines, connector_s)
        own = refitted(profiles, fits)
        _add_own_steps(entry, fits, partial(simulate, own))
        report["levels"].append(entry)
        if level.calibration:
            measured_profiles, profiles = profiles, own
            report["calibration"] = {
                "level": entry["level"],
                **entry["served_vs_profiled"],
            }
            _save_calibrated(options, profiles, fits)
    repeat = repeat_of(report["levels"])
    if repeat is not None:
        report["repeat"] = repeat


def _measured_and_simulated(
    options: ValidateOptions,
    base_url: str,
    pair: PairSpec,
    transfer: TransferModel,
    level: Level,
    profiles: dict[str, Profile],
    measured_profiles: dict[str, Profile] | None,
) -> tuple[dict[str, Any], Callable[[dict[str, Profile]], dict[str, Any]]]:
    """``level`` replayed through the proxy at ``base_url`` and simulated
    with ``profiles`` (and, given ``measured_profiles``, as ``as_profiled``):
    its entry, each request's latencies on both sides kept as its
    ``requests``, and how to simulate its requests with other profiles."""
    specs, fit, result, measured = _replay(options, base_url, pair, level)
    simulate = partial(simulate_pair, options, pair, transfer, specs, level)
    extra = {}
    if measured_profiles is not None:
        extra["as_profiled"] = compare(measured, simulate(measured_profiles))
    run = pair_run(pair, transfer, specs, level, profiles)
    entry = level_entry(
        level, specs, fit, measured, pair_metrics(options, run), **extra
    )
    entry["requests"] = request_columns(
        specs,
        client_latencies(result),
        latencies_by_request(run.decode),
        result["errors"],
    )
    return entry, simulate


#: A role's fit to its steps, or why its steps could not be fitted.
RoleFit = Calibration | CalibrationError


def _add_own_steps(
    entry: dict[str, Any],
    fits: dict[str, RoleFit],
    at_own_costs: Callable[[], dict[str, Any]],
) -> None:
    """A level's ``entry`` gains its roles' ``fits`` (``served_vs_profiled``)
    and, where a role has one, its errors simulated with the profiles
    refitted to them (``at_own_costs``: ``own_steps``, a diagnostic)."""
    entry["served_vs_profiled"] = _fit_reports(fits)
    if any(isinstance(fit, Calibration) for fit in fits.values()):
        simulated = at_own_costs()
        entry["own_steps"] = {**compare(entry["measured"], simulated),
                              "simulated": simulated}  # fmt: skip


def role_fits(
    profiles: dict[str, Profile],
    lines: dict[str, list[dict[str, Any]]],
    connector_s: ConnectorSeconds,
) -> dict[str, RoleFit]:
    """Each role's profile fitted to its first engine's served steps (its
    step log's ``lines[role]``), less what the simulator charges the
    connector in each (``connector_s``); the prefill engine's steps are
    timed to the empty step that follows each (its requests end in the
    step that prefills them) or to the next where requests were left
    waiting. A role whose lines hold too few busy steps gets the error."""
    fits: dict[str, RoleFit] = {}
    for role, profile in profiles.items():
        besides = connector_s(role, profile, lines[role])
        try:
            # A prefill request ends in its step: timed to the next step.
            fits[role] = calibration_fit(
                profile, lines[role], role == "prefill", besides
            )
        except CalibrationError as error:
            fits[role] = error
    return fits


def refitted(
    profiles: dict[str, Profile], fits: dict[str, RoleFit]
) -> dict[str, Profile]:
    """Each role's profile refitted to its fit (kept where it has none)."""
    refits = dict(profiles)
    for role, fit in fits.items():
        if isinstance(fit, Calibration):
            refits[role] = calibrated(profiles[role], fit)
    return refits


def _fit_reports(fits: dict[str, RoleFit]) -> dict[str, Any]:
    """Each role's fit as the report has it (``{"error": ...}``: none)."""
    return {
        role: {"error": str(fit)} if isinstance(fit, CalibrationError) else asdict(fit)
        for role, fit in fits.items()
    }


def _save_calibrated(
    options: ValidateOptions, profiles: dict[str, Profile], fits: dict[str, RoleFit]
) -> None:
    """Each refitted role's profile beside ``--save-profile``'s, as
    ``-calibrated`` (none without the option)."""
    if not options.save_profile:
        return
    for role, profile in profiles.items():
        if isinstance(fits[role], Calibration):
            profile.save(beside(_role_path(options.save_profile, role), "calibrated"))


def connector_seconds(pair: PairSpec, transfer: TransferModel) -> ConnectorSeconds:
    """What the simulated pair charges each role's logged steps for the
    folder's writes and reads (``storage_line_seconds``), with the role's
    KV bytes a token and block size as its pool has them."""
    from neuron_scheduler.sim.disaggregated import storage_line_seconds
    from neuron_scheduler.sim.profile_cost import ProfileCostModel

    specs = {"prefill": pair.prefill, "decode": pair.decode}

    def seconds(
        role: str, profile: Profile, lines: Sequence[dict[str, Any]]
    ) -> list[float]:
        kv_bytes = float(ProfileCostModel(profile).kv_bytes_per_token() or 0)
        block_size = specs[role].simulated(profile.kv_cache).block_size
        return storage_line_seconds(transfer, kv_bytes, block_size, role, lines)

    return seconds


def _profiles(
    options: ValidateOptions, pair: PairSpec, identity: dict[str, Any]
) -> dict[str, Profile]:
    """Each role's profile: ``--cost-profile`` (its ``-prefill`` and
    ``-decode`` files where they exist, what ``--save-profile`` wrote), or
    measured on the core the role's engine will run on."""
    from neuron_scheduler.offline.pd_servers import CORE_BINDING_ENV, engine_cores

    # Each role on the core its first engine runs on, as the servers will.
    cores = engine_cores(pair)
    role_cores = {"prefill": cores[0], "decode": cores[pair.prefill_engines]}
    profiles: dict[str, Profile] = {}
    for role, spec in (("prefill", pair.prefill), ("decode", pair.decode)):
        if options.cost_profile:
            profile = Profile.load(_role_path(options.cost_profile, role, exists=True))
        else:
            save = options.save_profile
            if save:
                save = _role_path(save, role)
            binding = {CORE_BINDING_ENV: role_cores[role]}
            profile = measure_profile(spec, save, options.progress, env=binding)
        try:
            check_profile_matches(profile, spec, identity)
        except ValidateError as error:
            raise ValidateError(f"the {role} engine: {error}") from None
        profiles[role] = profile
    return profiles


def _role_path(path_text: str, role: str, exists: bool = False) -> str:
    """``FILE-role.ext`` beside ``FILE.ext`` (with ``exists``: only if that
    file exists, else ``FILE.ext`` itself)."""
    role_path = beside(path_text, role)
    return str(role_path) if not exists or role_path.exists() else path_text


def _measure_folder(folder: Path, model: str) -> StorageTimes:
    """The shared folder's times for ``model``'s KV: a float32 K and V of
    each token, a file per layer (the connector's); the files removed."""
    import json
    import shutil

    from neuron_scheduler.offline.pd_servers import measure_storage

    config = json.loads((Path(model) / "config.json").read_text())
    heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(
        config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    )
    layers = int(config["num_hidden_layers"])
    times = measure_storage(folder / "measure", layers, 2 * heads * head_dim * 4)
    shutil.rmtree(folder / "measure", ignore_errors=True)
    return times


def _replay(
    options: ValidateOptions, base_url: str, pair: PairSpec, level: Level
) -> tuple[list[RequestSpec], FitReport, dict[str, Any], dict[str, Any]]:
    """``level``'s requests replayed through the proxy: the requests, how
    they were fitted to the model length, the benchmark client's
    per-request results and what was measured (``replay_level``)."""
    workload = replace(options.workload, request_rate=level.request_rate)
    return replay_level(base_url, level, workload, pair.prefill, options.goodput)


def simulate_pair(
    options: ValidateOptions,
    pair: PairSpec,
    transfer: TransferModel,
    specs: list[RequestSpec],
    level: Level,
    profiles: dict[str, Profile],
) -> dict[str, Any]:
    """The metrics of ``specs`` on the simulated xPyD with ``profiles``."""
    return pair_metrics(options, pair_run(pair, transfer, specs, level, profiles))


def pair_metrics(options: ValidateOptions, run: DisaggregatedRun) -> dict[str, Any]:
    """What the user saw of ``run``, as a level reports it."""
    from neuron_scheduler.sim.results import compute_metrics

    return compute_metrics(run.decode, options.goodput, percentiles=PERCENTILES)


def pair_run(
    pair: PairSpec,
    transfer: TransferModel,
    specs: list[RequestSpec],
    level: Level,
    profiles: dict[str, Profile],
) -> DisaggregatedRun:
    """``specs`` through the simulated xPyD with ``profiles``, sent as
    ``level`` sends them."""
    from neuron_scheduler.scheduler import NeuronScheduler
    from neuron_scheduler.sim.disaggregated import Pool, simulate_disaggregated
    from neuron_scheduler.sim.engines import Policy
    from neuron_scheduler.sim.profile_cost import ProfileCostModel

    pools = [
        Pool(
            role,
            engines,
            Policy(role, NeuronScheduler, spec.neuron_config),
            spec.simulated(profiles[role].kv_cache),
            ProfileCostModel(profiles[role]),
        )
        for role, engines, spec in (
            ("prefill", pair.prefill_engines, pair.prefill),
            ("decode", pair.decode_engines, pair.decode),
        )
    ]
    return simulate_disaggregated(
        specs, pools[0], pools[1], transfer, max_concurrency=level.max_concurrency
    )
