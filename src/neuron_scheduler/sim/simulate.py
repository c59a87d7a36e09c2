"""Replay a workload through real vLLM schedulers on a virtual clock.

``simulate`` runs one policy over a workload on one engine or a fleet
(``engines`` holds what it steps; ``fleet_parallel`` steps a fleet's engines
in several processes with the same result).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.sim.cost_model import CostModel
from neuron_scheduler.sim.engines import ClientPacing, Fleet, Replica, drive, finish_run
from neuron_scheduler.sim.fleet_parallel import simulate_in_processes
from neuron_scheduler.sim.policies import Policy
from neuron_scheduler.sim.records import RequestRecord, RunResult, unstarted_run
from neuron_scheduler.sim.routing import Router, RouterKind, make_router
from neuron_scheduler.sim.workload import RequestSpec
from neuron_scheduler.step import StepRecord


def simulate(
    specs: list[RequestSpec],
    policy: Policy,
    settings: EngineSettings,
    cost: CostModel,
    *,
    on_finish: Callable[[int], None] | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    max_idle_steps: int = 1000,
    max_concurrency: int | None = None,
    stop_after_s: float | None = None,
    replicas: int = 1,
    router: RouterKind = RouterKind.VLLM,
    stop_when: Callable[[RequestRecord], bool] | None = None,
    jobs: int = 1,
    pacing: ClientPacing | None = None,
) -> RunResult:
    """Run ``specs`` through ``policy`` on ``settings``; time by ``cost``.

    ``on_finish`` gets each finished (or rejected) request's index;
    ``on_step`` each static-shape step's ``StepRecord``. With
    ``max_concurrency`` at most that many requests are in flight: a request
    is sent at its arrival time or when one finishes, whichever is later
    (``vllm bench serve --max-concurrency``); ``pacing`` delays sends as a
    client that polls does (``ClientPacing``). Rejected specs fail at once.
    With ``stop_after_s`` the run ends at the first step past that time
    (a benchmark of fixed length); requests not finished keep
    ``finish_s`` -1. With ``replicas`` > 1 the requests go, as they arrive,
    through ``router`` to that many engines, each a real scheduler with its
    own KV cache and its own clock, on one virtual timeline; the result
    sums them (``RunResult.replicas`` holds each engine's own counters).
    ``stop_when`` sees each finished request's record; when it returns
    True the run stops there (``RunResult.stopped_early``). With ``jobs`` > 1
    a fleet's engines are stepped in up to that many processes (the result
    is the same; see ``fleet_parallel``) where ``parallel_fleet_supported``
    allows; otherwise, and by default, in this one."""
    _check_at_least_one(max_concurrency=max_concurrency, replicas=replicas, jobs=jobs)
    wall_start = time.perf_counter()
    engine_settings = replace(
        settings, neuron_config=policy.neuron_config, **policy.engine_overrides
    )
    result = unstarted_run(policy.label, specs)
    chooser = make_router(router, replicas)
    if (
        jobs > 1
        and replicas > 1
        and parallel_fleet_supported(max_concurrency, on_step, stop_when, pacing)
    ):
        simulate_in_processes(
            specs,
            policy,
            engine_settings,
            cost,
            result,
            chooser,
            jobs=min(jobs, replicas),
            on_finish=on_finish,
            stop_after_s=stop_after_s,
            max_idle_steps=max_idle_steps,
        )
    else:
        fleet = Fleet(
            result,
            on_finish,
            stop_when,
            max_concurrency,
            len(specs),
            max_idle_steps,
            pacing=pacing,
        )
        engines = [
            Replica(i, policy, engine_settings, cost, fleet, on_step)
            for i in range(replicas)
        ]
        _run_here(specs, engines, fleet, chooser, stop_after_s, on_finish)
    result.wall_seconds = time.perf_counter() - wall_start
    return result


def _check_at_least_one(**counts: int | None) -> None:
    """``ValueError`` naming a count given below 1."""
    for name, value in counts.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")


def _run_here(
    specs: list[RequestSpec],
    engines: list[Replica],
    fleet: Fleet,
    chooser: Router,
    stop_after_s: float | None,
    on_finish: Callable[[int], None] | None,
) -> None:
    """Step ``engines`` in this process until the run ends."""
    result = fleet.result
    if len(engines) > 1:
        result.replicas = [engine.result for engine in engines]

    def route(index: int, send_s: float) -> int:
        if len(engines) == 1:
            return 0
        return chooser.choose(send_s, [e.load() for e in engines])

    drive(
        specs,
        dict(enumerate(engines)),
        fleet,
        route,
        chooser.finished,
        stop_after_s=stop_after_s,
        on_rejected=on_finish,
    )
    finish_run(result, engines)


def parallel_fleet_supported(
    max_concurrency: int | None,
    on_step: Callable[[StepRecord], None] | None,
    stop_when: Callable[[RequestRecord], bool] | None,
    pacing: ClientPacing | None,
) -> bool:
    """A fleet can run in several processes unless engines are coupled
    by more than the router: a closed loop (a finish anywhere sends the next
    request), a callback that must see every step, a stop condition, or a
    paced client."""
    return (
        max_concurrency is None
        and on_step is None
        and stop_when is None
        and pacing is None
    )
