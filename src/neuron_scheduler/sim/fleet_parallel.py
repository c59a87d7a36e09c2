"""A fleet's engines stepped in several processes, with the serial answer.

Engines of a fleet share nothing but the router, so each worker process
drives its share of them through the same event loop as a serial run
(``engines.drive``), over every request's send time. Routing stays in the
parent: a router that reads loads (``Router.reads_loads``) gets, at each
arrival, every engine's load as the serial run would see it -- each worker
has stepped its engines up to that time and reported the requests finished
so far -- and its choice goes back to all workers (a conservative,
per-arrival synchronisation). A router that reads nothing routes every
request before the engines start, and the workers never wait.

The fleet-wide counters a serial run builds step by step (running
requests over time, inter-token latencies in step order) are rebuilt from
each engine's step log, merged in the serial run's order (clock, then
engine index). The result equals the serial run's, field by field; a test
holds it to that. Needs the ``fork`` start method (Linux): workers inherit
the workload, policy and cost model instead of pickling them.
"""

from __future__ import annotations

import contextlib
import heapq
import multiprocessing
from array import array
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.sim.cost_model import CostModel
from neuron_scheduler.sim.engines import Fleet, Replica, drive, finish_run
from neuron_scheduler.sim.policies import Policy
from neuron_scheduler.sim.records import RunResult, unstarted_run
from neuron_scheduler.sim.routing import EngineLoad, Router
from neuron_scheduler.sim.workload import RequestSpec

#: Finished requests a worker buffers before telling the parent (progress
#: and a load-blind router's ``finished``; a load-reading router hears them
#: at every arrival anyway).
_REPORT_EVERY = 64

#: Integer counters of a run that a fleet's total sums over its engines.
_SUMMED = (
    "prefill_steps_at_largest",
    "decode_batch_steps_at_largest",
    "decode_context_steps_at_largest",
    "prefill_tokens",
    "prefill_tokens_padded",
    "decode_slots",
    "decode_slots_padded",
    "prefill_steps",
    "decode_steps",
    "mixed_steps",
    "decode_context_read",
    "decode_context_needed",
)


def simulate_in_processes(
    specs: list[RequestSpec],
    policy: Policy,
    settings: EngineSettings,
    cost: CostModel,
    result: RunResult,
    router: Router,
    *,
    jobs: int,
    on_finish: Callable[[int], None] | None,
    stop_after_s: float | None,
    max_idle_steps: int,
) -> None:
    """Fill ``result`` (records, fleet and per-engine counters, duration)
    for ``router.num_engines`` engines stepped in ``jobs`` worker processes.
    ``on_finish`` hears each finished request, in the order workers report
    them (not the clock's). A worker's exception is raised here; every
    worker is stopped on return."""
    replicas = router.num_engines
    if not 2 <= jobs <= replicas:
        raise ValueError(f"jobs must be in 2..{replicas} (the replicas), got {jobs}")
    #: Engines interleaved over workers, so that neighbours in the router's
    #: rotation land in different processes.
    groups = [list(range(worker, replicas, jobs)) for worker in range(jobs)]
    ahead = None if router.reads_loads else _route_ahead(specs, router, stop_after_s)
    context = multiprocessing.get_context("fork")
    work = (specs, policy, settings, cost, ahead, stop_after_s, max_idle_steps)
    connections: list[Connection] = []
    processes: list[Any] = []
    try:
        for group in groups:
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_worker, args=(child_end, group, *work), daemon=True
            )
            process.start()
            child_end.close()
            connections.append(parent_end)
            processes.append(process)
        parent = _Parent(connections, router, on_finish)
        _send_all(specs, router, parent, stop_after_s, route_here=ahead is None)
        payloads = parent.collect_done()
    finally:
        _stop(connections, processes)
    _merge(result, payloads, replicas, cost)


def _stop(connections: list[Connection], processes: list[Any]) -> None:
    """Close every pipe and end every worker (killed if it lingers)."""
    for connection in connections:
        connection.close()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


def _sent(spec: RequestSpec, stop_after_s: float | None) -> bool:
    """The run reaches ``spec``'s arrival (open loop: sent at arrival)."""
    return stop_after_s is None or spec.arrival_s <= stop_after_s


def _route_ahead(
    specs: list[RequestSpec], router: Router, stop_after_s: float | None
) -> list[int]:
    """Each request's engine (-1: rejected or never sent), for a router that
    reads no loads, in the serial run's order of sends."""
    ahead = [-1] * len(specs)
    for index, spec in enumerate(specs):
        if not _sent(spec, stop_after_s):
            break
        if not spec.rejected:
            ahead[index] = router.choose(spec.arrival_s, ())
    return ahead


def _send_all(
    specs: list[RequestSpec],
    router: Router,
    parent: _Parent,
    stop_after_s: float | None,
    *,
    route_here: bool,
) -> None:
    """Walk the requests in the order they are sent: a rejected one fails at
    once (progress hears it); with ``route_here``, each other one is routed
    when every worker has reached its arrival."""
    for index, spec in enumerate(specs):
        if not _sent(spec, stop_after_s):
            break
        if spec.rejected:
            if parent.on_finish is not None:
                parent.on_finish(index)
        elif route_here:
            loads = parent.gather_loads()
            engines = [loads[i] for i in range(router.num_engines)]
            parent.broadcast(router.choose(spec.arrival_s, engines))


class _Parent:
    """The parent's end of the workers' pipes: ``finished`` reports are
    handled whenever they come, between the replies it waits for."""

    def __init__(
        self,
        connections: list[Connection],
        router: Router,
        on_finish: Callable[[int], None] | None,
    ) -> None:
        self.connections = connections
        self.router = router
        self.on_finish = on_finish

    def _handle(self, message: str, payload: Any) -> None:
        """A report that needs no reply: finished requests, or an error."""
        if message == "error":
            raise payload
        if message != "finished":  # pragma: no cover - a protocol error
            raise RuntimeError(f"worker sent an unexpected {message!r}")
        requests, engines = payload
        for engine in engines:
            self.router.finished(engine)
        if self.on_finish is not None:
            for request in requests:
                self.on_finish(request)

    def _receive(self, connection: Connection, kind: str) -> Any:
        while True:
            message, payload = connection.recv()
            if message == kind:
                return payload
            self._handle(message, payload)

    def gather_loads(self) -> dict[int, EngineLoad]:
        loads: dict[int, EngineLoad] = {}
        for connection in self.connections:
            loads.update(self._receive(connection, "loads"))
        return loads

    def broadcast(self, engine: int) -> None:
        for connection in self.connections:
            connection.send(engine)

    def collect_done(self) -> list[dict[str, Any]]:
        """Every worker's final payload, reading whichever pipe is ready (so
        progress reports flow while workers still run)."""
        pending = {id(c): c for c in self.connections}
        payloads = []
        while pending:
            for ready in wait(list(pending.values())):
                assert isinstance(ready, Connection)
                message, payload = ready.recv()
                if message == "done":
                    payloads.append(payload)
                    del pending[id(ready)]
                else:
                    self._handle(message, payload)
        return payloads


def _worker(
    connection: Connection,
    group: list[int],
    specs: list[RequestSpec],
    policy: Policy,
    settings: EngineSettings,
    cost: CostModel,
    ahead: list[int] | None,
    stop_after_s: float | None,
    max_idle_steps: int,
) -> None:
    """Drive the engines ``group`` over every send time; report finished
    requests, loads when asked, and the engines' results at the end (an
    error raised here is handed to the parent)."""
    try:
        side = _GroupSide(connection, group, specs, policy, settings, cost, ahead)
        connection.send(("done", side.run(stop_after_s, max_idle_steps)))
    except BaseException as error:  # noqa: BLE001 - handed to the parent
        with contextlib.suppress(OSError):  # the parent has gone: nobody to tell
            try:
                connection.send(("error", error))
            except Exception:  # noqa: BLE001 - an unpicklable error: say what
                connection.send(("error", RuntimeError(repr(error))))
    finally:
        connection.close()


class _GroupSide:
    """A worker's engines and its half of the conversation with the
    parent: finished requests and engines in batches, loads when the parent
    routes (``ahead``: the routes known in advance, no asking)."""

    def __init__(
        self,
        connection: Connection,
        group: list[int],
        specs: list[RequestSpec],
        policy: Policy,
        settings: EngineSettings,
        cost: CostModel,
        ahead: list[int] | None,
    ) -> None:
        self.connection, self.group, self.specs = connection, group, specs
        self.policy, self.settings, self.cost, self.ahead = (
            policy,
            settings,
            cost,
            ahead,
        )
        self.finished_requests: list[int] = []
        self.finished_engines: list[int] = []
        self.routed: list[int] = []
        self.engines: dict[int, Replica] = {}

    def report(self) -> None:
        if self.finished_requests or self.finished_engines:
            message = (self.finished_requests.copy(), self.finished_engines.copy())
            self.connection.send(("finished", message))
            self.finished_requests.clear()
            self.finished_engines.clear()

    def request_finished(self, index: int) -> None:
        self.finished_requests.append(index)
        if len(self.finished_requests) >= _REPORT_EVERY:
            self.report()

    def route(self, index: int, send_s: float) -> int:
        if self.ahead is not None:
            chosen = self.ahead[index]
        else:
            self.report()
            loads = {i: engine.load() for i, engine in self.engines.items()}
            self.connection.send(("loads", loads))
            chosen = self.connection.recv()
        if chosen in self.engines:
            self.routed.append(index)
        return chosen

    def run(self, stop_after_s: float | None, max_idle_steps: int) -> dict[str, Any]:
        """Drive the run to its end; what the parent merges."""
        specs, cost, policy = self.specs, self.cost, self.policy
        counts_before = cost.report()
        local = unstarted_run(policy.label, specs)
        fleet = Fleet(
            local, self.request_finished, None, None, len(specs), max_idle_steps
        )
        engines = {
            i: Replica(i, policy, self.settings, cost, fleet, None) for i in self.group
        }
        self.engines = engines
        local.replicas = [engine.result for engine in engines.values()]
        for engine in engines.values():
            engine.step_log = array("d")
        drive(
            specs,
            engines,
            fleet,
            self.route,
            self.finished_engines.append,
            stop_after_s=stop_after_s,
            on_rejected=None,
        )
        finish_run(local, list(engines.values()))
        self.report()
        counts = {
            key: value - counts_before.get(key, 0)
            for key, value in cost.report().items()
            if isinstance(value, int)
        }
        return {
            "engines": {i: e.result for i, e in engines.items()},
            "clocks": {i: e.clock for i, e in engines.items()},
            "step_logs": {i: e.step_log for i, e in engines.items()},
            "itl_s": local.itl_s,
            "records": [(i, local.records[i]) for i in self.routed],
            "cost_counts": counts,
        }


def _steps(engine: int, log: array, itl_s: array) -> Iterator[tuple[Any, ...]]:
    """One engine's logged steps as (start clock, engine, running, seconds,
    its inter-token latencies)."""
    for at in range(0, len(log), 5):
        start, running, dt, lo, hi = log[at : at + 5]
        yield start, engine, int(running), dt, itl_s[int(lo) : int(hi)]


def _merge(
    result: RunResult,
    payloads: list[dict[str, Any]],
    replicas: int,
    cost: CostModel,
) -> None:
    """Fill ``result`` from the workers' payloads as a serial run would."""
    engines: dict[int, RunResult] = {}
    clocks: dict[int, float] = {}
    streams = []
    for payload in payloads:
        engines.update(payload["engines"])
        clocks.update(payload["clocks"])
        for engine, log in payload["step_logs"].items():
            streams.append(_steps(engine, log, payload["itl_s"]))
        for index, record in payload["records"]:
            result.records[index] = record
        cost.add_counts(payload["cost_counts"])
    result.replicas = [engines[i] for i in range(replicas)]
    for own in result.replicas:
        for name in _SUMMED:
            setattr(result, name, getattr(result, name) + getattr(own, name))
        for mine, theirs in (
            (result.prefill_buckets, own.prefill_buckets),
            (result.decode_buckets, own.decode_buckets),
        ):
            for bucket, (actual, padded) in theirs.items():
                total = mine.setdefault(bucket, [0, 0])
                total[0] += actual
                total[1] += padded
    running = [0] * replicas
    total_running = 0
    for start, engine, now_running, dt, itl in heapq.merge(
        *streams, key=lambda step: (step[0], step[1])
    ):
        total_running += now_running - running[engine]
        running[engine] = now_running
        result.max_running = max(result.max_running, total_running)
        result.running_time_integral += now_running * dt
        result.running_timeline.append((start, total_running))
        result.itl_s.extend(itl)
    result.duration_s = max(clocks.values())
    for own in result.replicas:
        own.duration_s = result.duration_s
