"""Simulated engines: what ``simulate`` steps.

A ``Replica`` is one real vLLM scheduler with its own KV cache and clock, a
``Fleet`` their shared bookkeeping, ``drive`` the loop that sends requests
and steps engines on one virtual timeline. No model runs: each step is
applied with ``offline.engine.apply_step`` and the clock advances by the
cost model's time for the step's shapes (``step_shapes``: padded for
static-shape policies, actual for the dynamic reference).
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.request import Request

from neuron_scheduler.offline.engine import (
    EngineSettings,
    apply_step,
    build_scheduler,
    make_request,
)
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.sim import time_breakdown
from neuron_scheduler.sim.cost_model import CostModel
from neuron_scheduler.sim.policies import Execution, Policy
from neuron_scheduler.sim.records import RequestRecord, RunResult
from neuron_scheduler.sim.routing import EngineLoad
from neuron_scheduler.sim.step_shapes import (
    count_dynamic_step,
    count_graph_step,
    count_static_step,
    dynamic_shape,
    graph_per_phase_shapes,
    static_shape,
)
from neuron_scheduler.sim.workload import RequestSpec
from neuron_scheduler.step import (
    StepRecord,
    scheduled_requests,
)


@dataclass(frozen=True)
class ClientPacing:
    """How a benchmark client that sends one request at a time paces
    itself: no sooner than ``send_gap_s`` after its previous send, and,
    while every concurrency slot is taken, looking again only every
    ``poll_s`` (0: it sees a freed slot at once, as ``vllm bench serve``).
    guidellm 0.1's throughput mode is ``GUIDELLM_0_1_THROUGHPUT``."""

    send_gap_s: float = 0.0
    poll_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("send_gap_s", "poll_s"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")


#: guidellm 0.1's throughput loop (``scheduler/base.py``, ``_run_async`` at
#: v0.1.0): ``asyncio.sleep(0.001)`` after each send; while the concurrency
#: gate is shut, ``asyncio.sleep(0.1)`` between looks.
GUIDELLM_0_1_THROUGHPUT = ClientPacing(send_gap_s=0.001, poll_s=0.1)


class SimulationStalled(RuntimeError):
    """The scheduler stopped making progress with work pending."""


def _prompt(
    index: int, spec: RequestSpec, block_cache: dict[int, list[int]]
) -> list[int]:
    """Prompt token ids. Requests are distinct from their first block on,
    except where ``hash_ids`` say blocks are shared (equal ids, equal tokens)."""
    if not spec.hash_ids:
        head = [index // 30000 + 1, index % 30000 + 1]
        body = [(index * 131 + j) % 250 + 1 for j in range(max(spec.input_len - 2, 0))]
        return (head + body)[: spec.input_len]
    tokens: list[int] = []
    for hash_id in spec.hash_ids:
        block = block_cache.get(hash_id)
        if block is None:
            block = [hash_id // 30000 + 1, hash_id % 30000 + 1] + [
                (hash_id * 7 + j) % 250 + 1 for j in range(spec.hash_block_tokens - 2)
            ]
            block_cache[hash_id] = block
        tokens.extend(block)
        if len(tokens) >= spec.input_len:
            break
    while len(tokens) < spec.input_len:  # more tokens than hash ids cover
        tokens.append((index * 131 + len(tokens)) % 250 + 1)
    return tokens[: spec.input_len]


def drive(
    specs: list[RequestSpec],
    engines: dict[int, Replica],
    fleet: Fleet,
    route: Callable[[int, float], int],
    engine_finished: Callable[[int], None],
    *,
    stop_after_s: float | None,
    on_rejected: Callable[[int], None] | None,
) -> None:
    """The event loop of a run: send each request at its time through
    ``route`` (spec index, send time -> engine index), step the busy engine
    whose clock is earliest, until everything is done. ``engines`` may be
    part of a fleet: a request routed to an engine not in it is another
    process's, and only its time matters here (where a stuck engine waits).
    ``engine_finished`` hears the engine of each finished request."""
    block_cache: dict[int, list[int]] = {}
    next_index = 0
    #: (clock, engine index) of every engine with requests: the next step.
    busy: list[tuple[float, int]] = []
    while busy or next_index < len(specs):
        # The next event: the earliest step of a busy engine, or the next
        # request the client may send (at its arrival, or when a
        # concurrency slot frees, whichever is later).
        step_s = busy[0][0] if busy else float("inf")
        send_s = float("inf")
        if next_index < len(specs) and fleet.has_slot():
            send_s = specs[next_index].arrival_s
            if not specs[next_index].rejected:  # rejected at once, no slot
                send_s = fleet.send_s(send_s)
        elif not busy:
            break  # nothing runs and nothing can be sent (cannot happen)
        if stop_after_s is not None and min(step_s, send_s) > stop_after_s:
            break
        if send_s <= step_s:
            spec = specs[next_index]
            if not spec.rejected:
                engine = _send(next_index, spec, send_s, engines, fleet, route)
                if engine is not None:
                    was_idle = not engine.scheduler.has_requests()
                    engine.add(next_index, spec, block_cache)
                    if was_idle:
                        heapq.heappush(busy, (engine.clock, engine.index))
            elif on_rejected is not None:
                on_rejected(next_index)
            next_index += 1
            continue
        _, index = heapq.heappop(busy)
        engine = engines[index]
        for finished in engine.step(next_s=send_s):
            engine_finished(finished)
        if engine.scheduler.has_requests():
            heapq.heappush(busy, (engine.clock, index))
        if fleet.stopped:
            fleet.result.stopped_early = True
            break


def _send(
    index: int,
    spec: RequestSpec,
    send_s: float,
    engines: dict[int, Replica],
    fleet: Fleet,
    route: Callable[[int, float], int],
) -> Replica | None:
    """Send request ``index`` at ``send_s`` (it takes a concurrency slot):
    the engine here it is routed to, ``None`` for another process's."""
    if fleet.free_slots_s:
        heapq.heappop(fleet.free_slots_s)
    # Sent when it arrived, or when the client could send it.
    fleet.result.records[index].arrival_s = send_s
    fleet.last_send_s = send_s
    return engines.get(route(index, send_s))


def finish_run(result: RunResult, engines: list[Replica]) -> None:
    """Close a run: its duration (the last engine's clock, every engine's
    too) and the preemptions of requests still unfinished."""
    result.duration_s = max(engine.clock for engine in engines)
    for engine in engines:
        engine.result.duration_s = result.duration_s
        engine.own.clock_s = engine.clock
        for request in engine.live.values():
            records = result.records
            records[int(request.request_id)].num_preemptions = request.num_preemptions


class Fleet:
    """What the engines of one run share: the client (requests in flight,
    concurrency slots) and the fleet-wide result."""

    def __init__(
        self,
        result: RunResult,
        on_finish: Callable[[int], None] | None,
        stop_when: Callable[[RequestRecord], bool] | None,
        max_concurrency: int | None,
        num_specs: int,
        max_idle_steps: int,
        *,
        pacing: ClientPacing | None = None,
    ) -> None:
        self.result = result
        self.on_finish = on_finish
        self.stop_when = stop_when
        self.stopped = False
        self.max_idle_steps = max_idle_steps
        self.in_flight = 0
        self.closed_loop = max_concurrency is not None
        self.limit = max_concurrency or num_specs + 1
        #: When each concurrency slot became free (a min-heap; unused unlimited).
        self.free_slots_s = [0.0] * self.limit if max_concurrency else []
        self.last_token_s: dict[str, float] = {}
        #: Running requests of every engine, as of each engine's last step.
        self.running_total = 0
        self.pacing = pacing
        self.last_send_s = -math.inf

    def has_slot(self) -> bool:
        return self.in_flight < self.limit

    def slot_free_s(self) -> float:
        return self.free_slots_s[0] if self.free_slots_s else 0.0

    def send_s(self, arrival_s: float) -> float:
        """When the client sends a request that arrives at ``arrival_s``
        (a slot is free by then or later): at once or when the slot frees;
        with ``pacing``, not before the gap after the previous send, and a
        slot that frees while the client waits is seen at its next look."""
        pacing = self.pacing
        ready = arrival_s
        if pacing is not None:
            ready = max(ready, self.last_send_s + pacing.send_gap_s)
        free = self.slot_free_s()
        if free <= ready:
            return ready
        if pacing is None or pacing.poll_s == 0.0:
            return free
        looks = math.ceil((free - ready) / pacing.poll_s)
        return ready + looks * pacing.poll_s


class Replica:
    """One engine of a run: a real scheduler on its own clock."""

    def __init__(
        self,
        index: int,
        policy: Policy,
        settings: EngineSettings,
        cost: CostModel,
        fleet: Fleet,
        on_step: Callable[[StepRecord], None] | None,
    ) -> None:
        scheduler = build_scheduler(policy.scheduler_cls, settings)
        if policy.static_shapes and not isinstance(scheduler, NeuronScheduler):
            raise ValueError(
                f"policy {policy.label!r}: static shapes need a NeuronScheduler, "
                f"got {policy.scheduler_cls.__name__}"
            )
        if on_step is not None:
            if not isinstance(scheduler, NeuronScheduler):
                raise ValueError(
                    f"policy {policy.label!r}: on_step needs a NeuronScheduler"
                )
            scheduler.step_listeners.append(on_step)
        self.index = index
        self.scheduler = scheduler
        #: Where a static step fits only a largest bucket (its config's).
        self.largest_only = (
            scheduler.metrics.largest_only
            if isinstance(scheduler, NeuronScheduler)
            else None
        )
        self.policy = policy
        self.settings = settings
        self.cost = cost
        self.fleet = fleet
        self.clock = 0.0
        if isinstance(scheduler, NeuronScheduler) and scheduler.kv_load_watch:
            # kv_load_timeout_s counts virtual seconds, as everything here.
            scheduler.kv_load_watch.clock = lambda: self.clock
        self.idle_steps = 0
        #: Seconds a step's KV connector work adds to it (a synchronous
        #: connector's writes and reads); ``None``: none.
        self.connector_step_s: Callable[[SchedulerOutput], float] | None = None
        self.running = 0
        self.live: dict[str, Request] = {}
        self.prompt_len_of: dict[str, int] = {}
        #: This engine's own counters (a fleet's per-replica report).
        self.result = RunResult(f"{policy.label}#{index}", [])
        #: When kept (a fleet stepped in several processes): per step that
        #: scheduled tokens, its start clock, running requests after it,
        #: its seconds, and the slice of ``fleet.result.itl_s`` it appended
        #: -- what the parent needs to replay the fleet-wide counters.
        self.step_log: array | None = None
        #: KV transfers done, for the next step's model output to report
        #: (a KV connector's worker side: loads received, sends finished).
        self.kv_received: set[str] = set()
        self.kv_sent: set[str] = set()
        #: The last step's scheduler output (what a P/D driver inspects).
        self.last_output: SchedulerOutput | None = None

    def load(self) -> EngineLoad:
        running, waiting = self.scheduler.get_request_counts()
        return EngineLoad(running, waiting, self.scheduler.kv_cache_manager.usage)

    def add(
        self,
        index: int,
        spec: RequestSpec,
        block_cache: dict[int, list[int]],
        *,
        sent_s: float | None = None,
        max_tokens: int | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        counted: bool = True,
    ) -> None:
        """Receive request ``index``, sent at ``sent_s`` (default: its
        record's ``arrival_s``), for ``max_tokens`` (default: its output
        length), with what a P/D proxy gives the KV connector;
        ``counted``: it takes a client slot here (not where the client
        sent it elsewhere first)."""
        if sent_s is None:
            sent_s = self.fleet.result.records[index].arrival_s
        if not self.scheduler.has_requests():
            self._wait_until(sent_s)  # idle until it arrives
        request_id = str(index)
        request = make_request(
            request_id,
            _prompt(index, spec, block_cache),
            spec.output_len if max_tokens is None else max_tokens,
            arrival_time=sent_s,
            block_size=self.settings.block_size,
            enable_prefix_caching=self.settings.enable_prefix_caching,
            kv_transfer_params=kv_transfer_params,
        )
        self.live[request_id] = request
        self.prompt_len_of[request_id] = spec.input_len
        if counted:
            self.fleet.in_flight += 1
        self.result.routed += 1
        self.scheduler.add_request(request)

    def step(self, next_s: float) -> list[int]:
        """One engine step; returns this engine's index once per request
        the step finished, what the router's ``finished`` callback counts
        (``next_s``: when the client sends next, where an engine that cannot
        progress waits)."""
        output = self.scheduler.schedule()
        self.last_output = output
        if output.total_num_scheduled_tokens == 0:
            self._idle(output, next_s)
            return []
        self.idle_steps = 0
        result = self.fleet.result
        dt = self._charge(output)
        if self.connector_step_s is not None:
            dt += self.connector_step_s(output)
        self._count_running(dt)
        started_s = self.clock
        self.clock += dt
        itl_start = len(result.itl_s)
        finished = self._apply(output)
        if self.step_log is not None:
            self.step_log.extend(
                (started_s, self.running, dt, itl_start, len(result.itl_s))
            )
        return finished

    def _idle(self, output: SchedulerOutput, next_s: float) -> None:
        """A step that scheduled nothing: the clock waits for the next
        arrival; ``SimulationStalled`` when none will come."""
        scheduler = self.scheduler
        # Nothing computed, but a request may fail (kv_load_timeout_s).
        self._record(
            apply_step(scheduler, output, self.prompt_len_of, *self._kv_done())
        )
        if scheduler.get_num_unfinished_requests() == 0:
            return
        self.idle_steps += 1
        if next_s < float("inf"):
            self._wait_until(next_s)
        elif self.idle_steps > self.fleet.max_idle_steps:
            raise SimulationStalled(
                f"{self.policy.label}: no progress for {self.idle_steps} steps "
                f"with {scheduler.get_num_unfinished_requests()} requests "
                "unfinished"
            )

    def _kv_done(self) -> tuple[set[str] | None, set[str] | None]:
        """The KV transfers to report in this step's output, handed over
        (``None``: none, the common case, with nothing allocated)."""
        if not self.kv_received and not self.kv_sent:
            return None, None
        received, sent = self.kv_received, self.kv_sent
        self.kv_received, self.kv_sent = set(), set()
        return received, sent

    @property
    def own(self) -> RunResult:
        """The counters kept per engine: its own in a fleet of several, the
        run's otherwise."""
        return self.result if self.fleet.result.replicas else self.fleet.result

    def _wait_until(self, when_s: float) -> None:
        """Idle until ``when_s`` (no earlier than now)."""
        if when_s > self.clock:
            self.own.time_s["idle"] += when_s - self.clock
            self.clock = when_s

    def _charge(self, output: SchedulerOutput) -> float:
        """The step's seconds on the cost model, for the shapes the policy
        executes it as; counts its padding in the fleet's counters (and in
        a fleet of several, in this engine's own)."""
        result = self.fleet.result
        step = scheduled_requests(output, self.prompt_len_of.__getitem__)
        counted = (result, self.result) if result.replicas else (result,)
        if self.policy.execution is Execution.PADDED:
            # Charge exactly the shapes the scheduler padded this step to.
            record = self.scheduler.last_step  # type: ignore[attr-defined]
            shapes = [static_shape(record, step)]
            assert self.largest_only is not None  # a NeuronScheduler (checked)
            for counters in counted:
                count_static_step(counters, record, self.largest_only)
        elif self.policy.execution is Execution.DYNAMIC:
            shapes = [dynamic_shape(step)]
            for counters in counted:
                count_dynamic_step(counters, shapes[0])
        else:
            shapes = graph_per_phase_shapes(
                step, self.settings.max_num_seqs, self.settings.max_model_len
            )
            for counters in counted:
                count_graph_step(counters, shapes, step)
        seconds = [self.cost.step_time(shape, self.index) for shape in shapes]
        time_breakdown.add_step(
            self.own.time_s,
            shapes,
            seconds,
            time_breakdown.actual_shapes(shapes, step),
            self.cost,
            any(shape.prefill_chunks for shape in shapes)
            and self._decodes_waiting(output),
        )
        return sum(seconds)

    def _decodes_waiting(self, output: SchedulerOutput) -> bool:
        """A running request past its prompt that this step leaves out."""
        scheduled = output.num_scheduled_tokens
        return any(
            r.request_id not in scheduled
            and r.num_computed_tokens >= r.num_prompt_tokens
            for r in self.scheduler.running
        )

    def _count_running(self, dt: float) -> None:
        """Running requests over the ``dt`` seconds the step takes."""
        fleet, result = self.fleet, self.fleet.result
        running = len(self.scheduler.running)
        fleet.running_total += running - self.running
        self.running = running
        result.max_running = max(result.max_running, fleet.running_total)
        result.running_time_integral += running * dt
        result.running_timeline.append((self.clock, fleet.running_total))
        if result.replicas:
            self.result.max_running = max(self.result.max_running, running)
            self.result.running_time_integral += running * dt

    def _apply(self, output: SchedulerOutput) -> list[int]:
        """Apply the step at ``self.clock``: tokens and finishes into the
        records, free slots to a closed loop."""
        received, sent = self._kv_done()
        return self._record(
            apply_step(self.scheduler, output, self.prompt_len_of, received, sent)
        )

    def _record(self, items: list[EngineCoreOutput]) -> list[int]:
        """A step's outputs at ``self.clock`` into the records; this engine's
        index once per request finished."""
        fleet, result, clock = self.fleet, self.fleet.result, self.clock
        records, last_token_s = result.records, fleet.last_token_s
        finished = []
        for item in items:
            index = int(item.request_id)
            rec = records[index]
            if item.new_token_ids:
                if rec.num_tokens == 0:
                    rec.first_token_s = clock
                else:
                    result.itl_s.append(clock - last_token_s[item.request_id])
                last_token_s[item.request_id] = clock
                rec.num_tokens += len(item.new_token_ids)
            if item.finish_reason is None:
                continue
            rec.finish_s = clock
            # The scheduler failed it (kv_load_timeout_s): the client gets
            # an error, as for a request the server rejects.
            rec.failed = rec.failed or item.finish_reason == FinishReason.ERROR
            fleet.in_flight -= 1
            if fleet.closed_loop:
                heapq.heappush(fleet.free_slots_s, clock)
            rec.num_preemptions = self.live.pop(item.request_id).num_preemptions
            last_token_s.pop(item.request_id, None)
            del self.prompt_len_of[item.request_id]
            finished.append(self.index)
            if fleet.on_finish is not None:
                fleet.on_finish(index)
            if fleet.stop_when is not None and fleet.stop_when(rec):
                fleet.stopped = True
        return finished
