"""Disaggregated prefill/decode (xPyD) on the virtual clock.

``x`` prefill engines and ``y`` decode engines (``PoolSizes``, written as
AWS and vLLM write it: ``2P3D``), each a real scheduler with its own KV
cache, ``neuron_config``, engine settings and cost model (``Pool``). A
request goes, through a router per pool, to a prefill engine for its prompt
(``max_tokens=1``; the prefill engine's token is not the user's) and to a
decode engine, which takes the whole prompt as a KV transfer
(``kv_transfer.Transfers``), computes its last token as a decode row and
produces every token the user sees: TTFT includes the prefill's queueing and
compute, the decode engine's wait for room, and the transfer. The KV moves
through vLLM's own connector flows on both schedulers (a simulated
connector: the prefill side holds its blocks until the transfer is done,
the decode side waits in ``WAITING_FOR_REMOTE_KVS``), so every KV rule and
admission rule of either engine applies as on a real pair. The decode
pool's ``neuron_config`` takes ``kv_loads_take_slots`` by default (a
decode engine pulls only into a free slot, as AWS's plugin does). In
``STORAGE`` mode (vLLM's ExampleConnector, the real pair of
``offline.pd_servers``) there is no link: the prefill engine's step writes
the prompt's whole blocks and frees them, the decode engine's step that
schedules the request reads them and computes the rest of the prompt.
"""

from __future__ import annotations

import heapq
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.sim.cost_model import CostModel
from neuron_scheduler.sim.engines import Fleet, Replica, SimulationStalled
from neuron_scheduler.sim.kv_transfer import TransferMode, TransferModel, Transfers
from neuron_scheduler.sim.policies import Policy
from neuron_scheduler.sim.records import RequestRecord, RunResult, unstarted_run
from neuron_scheduler.sim.routing import RouterKind, make_router
from neuron_scheduler.sim.run_setup import (
    EngineChoice,
    check_profile_covers,
    engine_setup,
)
from neuron_scheduler.sim.workload import RequestSpec

_SIZES = re.compile(r"\s*(\d+)\s*p\s*(\d+)\s*d\s*", re.IGNORECASE)


@dataclass(frozen=True)
class PoolSizes:
    """Engines per role: ``2P3D`` is 2 prefill and 3 decode engines."""

    prefill: int
    decode: int

    @classmethod
    def parse(cls, text: str) -> PoolSizes:
        """``xPyD`` in any case; ``ValueError`` naming the text otherwise,
        or a pool of 0 engines."""
        match = _SIZES.fullmatch(text)
        if match is None:
            raise ValueError(
                f"--disaggregated {text!r}: expected xPyD, e.g. 1P1D or 2P3D"
            )
        sizes = cls(int(match.group(1)), int(match.group(2)))
        for role, count in (("prefill", sizes.prefill), ("decode", sizes.decode)):
            if count < 1:
                raise ValueError(
                    f"--disaggregated {text!r}: a {role} pool of {count} engines; "
                    "each pool needs at least 1"
                )
        return sizes

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class Pool:
    """One role's engines: how many, their policy (``neuron_config``), their
    engine settings and their cost model (its TP, its hardware)."""

    role: str
    engines: int
    policy: Policy
    settings: EngineSettings
    cost: CostModel


def check_pools(prefill: Pool, decode: Pool) -> None:
    """The two pools must agree on what a transfer carries: ``ValueError``
    naming the values where ``max_model_len`` or the block size differs, or
    where neither cost model knows the KV bytes a token holds."""
    for name in ("max_model_len", "block_size"):
        ours, theirs = getattr(prefill.settings, name), getattr(decode.settings, name)
        if ours != theirs:
            raise ValueError(
                f"the decode pool's {name} {theirs} differs from the prefill "
                f"pool's {ours}: a transferred prompt must fit both"
            )
    if prefill.cost.kv_bytes_per_token() is None:
        raise ValueError(
            f"the prefill pool's cost model ({prefill.cost.describe()}) does not "
            "know the KV bytes a token holds; a transfer cannot be charged"
        )


@dataclass
class Handoff:
    """One request's way between the pools (seconds on the virtual clock;
    -1: not reached). ``sent_s``: when the decode engine received it;
    ``transfer_start_s``: when it admitted it and the transfer opened."""

    prefill_engine: int = -1
    decode_engine: int = -1
    prefill_first_step_s: float = -1.0
    prefill_done_s: float = -1.0
    sent_s: float = -1.0
    transfer_start_s: float = -1.0
    transfer_done_s: float = -1.0
    transfer_bytes: float = 0.0


@dataclass
class DisaggregatedRun:
    """What an xPyD run recorded: the user's view (``decode.records``:
    sent by the client, first and later tokens from the decode engines),
    each pool's own counters (``replicas``: per engine) and each request's
    hand-off."""

    sizes: PoolSizes
    transfer: TransferModel
    prefill: RunResult
    decode: RunResult
    handoffs: list[Handoff] = field(default_factory=list)
    wall_seconds: float = 0.0
    #: ``stop_when`` ended the run before every request finished.
    stopped_early: bool = False


def _pool_engines(
    pool: Pool, fleet: Fleet, decode_defaults: bool, transfer: TransferModel
) -> list[Replica]:
    config = dict(pool.policy.neuron_config or {})
    if decode_defaults:
        config.setdefault("kv_loads_take_slots", True)
    # Both sides speak through a (simulated) KV connector.
    settings = replace(
        pool.settings,
        neuron_config=config,
        kv_connector={},
        **pool.policy.engine_overrides,
    )
    policy = replace(pool.policy, neuron_config=config)
    engines = [
        Replica(i, policy, settings, pool.cost, fleet, None)
        for i in range(pool.engines)
    ]
    fleet.result.replicas = [engine.result for engine in engines]
    if transfer.mode is TransferMode.STORAGE:
        role = "decode" if decode_defaults else "prefill"
        extra = storage_step_seconds(
            transfer,
            float(pool.cost.kv_bytes_per_token() or 0),
            settings.block_size,
            role,
        )
        for engine in engines:
            engine.connector_step_s = extra
    return engines


def simulate_disaggregated(
    specs: list[RequestSpec],
    prefill: Pool,
    decode: Pool,
    transfer: TransferModel,
    *,
    router: RouterKind = RouterKind.VLLM,
    max_concurrency: int | None = None,
    on_finish: Callable[[int], None] | None = None,
    stop_when: Callable[[RequestRecord], bool] | None = None,
    max_idle_steps: int = 1000,
) -> DisaggregatedRun:
    """Run ``specs`` through ``prefill.engines`` prefill and
    ``decode.engines`` decode engines joined by ``transfer``; requests are
    spread over each pool by ``router``, sent as ``simulate`` sends them
    (``max_concurrency``: a closed loop; ``on_finish``: each finished or
    rejected request's index; ``stop_when``: as ``simulate``'s, on each
    request the user sees finish)."""
    check_pools(prefill, decode)
    wall_start = time.perf_counter()
    sizes = PoolSizes(prefill.engines, decode.engines)
    label = str(sizes)
    user = Fleet(
        unstarted_run(label, specs),
        on_finish,
        stop_when,
        max_concurrency,
        len(specs),
        max_idle_steps,
    )
    prefill_side = Fleet(
        unstarted_run(f"{label} prefill", specs),
        None,
        None,
        None,
        len(specs),
        max_idle_steps,
    )
    run = _Run(
        specs,
        _pool_engines(prefill, prefill_side, False, transfer),
        _pool_engines(decode, user, True, transfer),
        user,
        prefill_side,
        Transfers(transfer),
        router,
        float(prefill.cost.kv_bytes_per_token() or 0),
    )
    run.loop(on_finish)
    result = DisaggregatedRun(
        sizes,
        transfer,
        prefill_side.result,
        user.result,
        run.handoffs,
        stopped_early=user.stopped,
    )
    _finish(result, run.prefill + run.decode)
    result.wall_seconds = time.perf_counter() - wall_start
    result.decode.wall_seconds = result.wall_seconds
    return result


def _finish(result: DisaggregatedRun, engines: list[Replica]) -> None:
    duration = max(engine.clock for engine in engines)
    for pool in (result.prefill, result.decode):
        pool.duration_s = duration
    for engine in engines:
        engine.result.duration_s = duration
        engine.own.clock_s = engine.clock


#: Event kinds, in the order they are handled at equal times.
_HANDOFF, _RELEASE, _CLOSE = 0, 1, 2


class _Run:
    """The event loop of one xPyD run (``simulate_disaggregated``)."""

    def __init__(
        self,
        specs: list[RequestSpec],
        prefill: list[Replica],
        decode: list[Replica],
        user: Fleet,
        prefill_side: Fleet,
        transfers: Transfers,
        router: RouterKind,
        kv_bytes_per_token: float,
    ) -> None:
        self.specs = specs
        self.prefill, self.decode = prefill, decode
        self.user, self.prefill_side = user, prefill_side
        self.transfers = transfers
        self.mode = transfers.model.mode
        self.routers = (
            make_router(router, len(prefill)),
            make_router(router, len(decode)),
        )
        self.kv_bytes_per_token = kv_bytes_per_token
        self.handoffs = [Handoff() for _ in specs]
        #: Bytes a prefill computed before its transfer opened (write mode).
        self.buffered: dict[int, float] = {}
        self.events: list[tuple[float, int, int, int, float]] = []
        self.order = 0
        #: (clock, order, pool, engine) of every engine with requests.
        self.busy: list[tuple[float, int, int, int]] = []
        self.queued: set[tuple[int, int]] = set()
        self.block_cache: dict[int, list[int]] = {}
        prefill_side.on_finish = self._prefill_finished

    # ------------------------------------------------------------ the loop

    def loop(self, on_rejected: Callable[[int], None] | None) -> None:
        specs, user = self.specs, self.user
        next_index = 0
        while True:
            send_s = math.inf
            if next_index < len(specs) and user.has_slot():
                send_s = specs[next_index].arrival_s
                if not specs[next_index].rejected:
                    send_s = user.send_s(send_s)
            event_s = self.events[0][0] if self.events else math.inf
            step_s = self.busy[0][0] if self.busy else math.inf
            transfer_s = self.transfers.next_event_s()
            now = min(send_s, event_s, step_s, transfer_s)
            if now == math.inf:
                self.check_finished()
                return
            if transfer_s <= now:
                self._transfers_done(now)
            elif event_s <= now:
                self._event(heapq.heappop(self.events))
            elif send_s <= now:
                spec = specs[next_index]
                if spec.rejected:
                    if on_rejected is not None:
                        on_rejected(next_index)
                else:
                    self._send(next_index, now)
                next_index += 1
            else:
                self._step(heapq.heappop(self.busy))
                if user.stopped:
                    return

    def _push(self, pool: int, engine: Replica) -> None:
        key = (pool, engine.index)
        if key not in self.queued:
            self.queued.add(key)
            self.order += 1
            heapq.heappush(self.busy, (engine.clock, self.order, pool, engine.index))

    def _wake(self, pool: int, engine: Replica, now: float) -> None:
        """Queue ``engine``'s next step, no earlier than ``now`` (an engine
        parked with nothing to do waits idle until then)."""
        if (pool, engine.index) not in self.queued:
            engine._wait_until(now)
            self._push(pool, engine)

    def _later(self, when_s: float, kind: int, index: int, amount: float = 0.0) -> None:
        self.order += 1
        heapq.heappush(self.events, (when_s, kind, self.order, index, amount))

    # -------------------------------------------------------------- events

    def _send(self, index: int, now: float) -> None:
        """The client sends request ``index``: to a prefill engine, and in
        write mode to a decode engine too."""
        user = self.user
        if user.free_slots_s:
            heapq.heappop(user.free_slots_s)
        user.result.records[index].arrival_s = now
        user.last_send_s = now
        user.in_flight += 1
        self.prefill_side.result.records[index].arrival_s = now
        engine = self._choose(0, self.prefill, now)
        self.handoffs[index].prefill_engine = engine.index
        engine.add(
            index,
            self.specs[index],
            self.block_cache,
            max_tokens=1,
            # A storage connector frees its blocks at once: it wrote them.
            kv_transfer_params={
                "do_remote_decode": self.mode is not TransferMode.STORAGE
            },
        )
        self._wake(0, engine, now)
        if self.mode is TransferMode.WRITE:
            self._to_decode(index, now)

    def _choose(self, pool: int, engines: list[Replica], now: float) -> Replica:
        if len(engines) == 1:
            return engines[0]
        return engines[self.routers[pool].choose(now, [e.load() for e in engines])]

    def _to_decode(self, index: int, now: float) -> None:
        engine = self._choose(1, self.decode, now)
        handoff = self.handoffs[index]
        handoff.decode_engine, handoff.sent_s = engine.index, now
        prompt_len = self.specs[index].input_len
        params: dict[str, Any]
        if self.mode is TransferMode.STORAGE:
            block_size = engine.settings.block_size
            params = {
                "remote_tokens": _stored_tokens(prompt_len, block_size),
                "async_load": False,
            }
        else:
            params = {"remote_tokens": prompt_len}
        engine.add(
            index,
            self.specs[index],
            self.block_cache,
            sent_s=now,
            counted=False,
            kv_transfer_params=params,
        )
        self._wake(1, engine, now)

    def _prefill_finished(self, index: int) -> None:
        """A prefill engine's step finished ``index``'s prompt (at the
        step's end): hand it off then (read), or close its push (write)."""
        done_s = self.prefill_side.result.records[index].finish_s
        self.handoffs[index].prefill_done_s = done_s
        self._later(
            done_s, _CLOSE if self.mode is TransferMode.WRITE else _HANDOFF, index
        )

    def _event(self, event: tuple[float, int, int, int, float]) -> None:
        now, kind, _, index, amount = event
        if kind == _HANDOFF:
            self._to_decode(index, now)
        elif self.transfers.is_open(index):
            if kind == _RELEASE:
                self.transfers.add_bytes(index, amount, now)
            else:
                self.transfers.close(index, now)
        elif kind == _RELEASE:
            self.buffered[index] = self.buffered.get(index, 0.0) + amount

    def _transfers_done(self, now: float) -> None:
        """Report each finished transfer to both its engines, in their next
        step's output (as a connector's worker side does)."""
        for index, done_s in self.transfers.finished_by(now):
            handoff = self.handoffs[index]
            handoff.transfer_done_s = done_s
            request_id = str(index)
            sender = self.prefill[handoff.prefill_engine]
            sender.kv_sent.add(request_id)
            self._wake(0, sender, done_s)
            receiver = self.decode[handoff.decode_engine]
            receiver.kv_received.add(request_id)
            self._wake(1, receiver, done_s)

    def _step(self, entry: tuple[float, int, int, int]) -> None:
        """Step one engine. One that scheduled nothing is parked until an
        event wakes it (a request, a transfer done), unless it just
        reported transfers: then it looks again at once, as vLLM's engine
        core loops while requests wait."""
        _, _, pool, index = entry
        self.queued.discard((pool, index))
        engine = (self.prefill, self.decode)[pool][index]
        start_s = engine.clock
        had_notices = bool(engine.kv_sent or engine.kv_received)
        for finished in engine.step(next_s=start_s):
            self.routers[pool].finished(finished)
        output = engine.last_output
        assert output is not None
        if pool == 0:
            self._prefill_stepped(engine, start_s)
        else:
            self._decode_stepped(engine, start_s)
        if not engine.scheduler.has_requests():
            return
        if output.total_num_scheduled_tokens > 0 or had_notices:
            self._push(pool, engine)

    def check_finished(self) -> None:
        """``SimulationStalled`` naming an engine left with requests."""
        for role, engines in (("prefill", self.prefill), ("decode", self.decode)):
            for engine in engines:
                left = engine.scheduler.get_num_unfinished_requests()
                if left:
                    raise SimulationStalled(
                        f"{role} engine {engine.index}: {left} requests unfinished "
                        "and nothing left that could move them"
                    )

    def _prefill_stepped(self, engine: Replica, start_s: float) -> None:
        output = engine.last_output
        assert output is not None
        for new in output.scheduled_new_reqs:
            handoff = self.handoffs[int(new.req_id)]
            if handoff.prefill_first_step_s < 0:
                handoff.prefill_first_step_s = start_s
        if self.mode is TransferMode.WRITE:
            for request_id, tokens in output.num_scheduled_tokens.items():
                self._later(
                    engine.clock,
                    _RELEASE,
                    int(request_id),
                    tokens * self.kv_bytes_per_token,
                )

    def _decode_stepped(self, engine: Replica, start_s: float) -> None:
        """Open the transfer of every load the step started (at its start:
        the scheduler allocated the blocks then)."""
        from neuron_scheduler.offline.sim_connector import SimulatedKVMetadata

        output = engine.last_output
        assert output is not None
        if self.mode is TransferMode.STORAGE:
            self._storage_loads(output, start_s)
            return
        meta = output.kv_connector_metadata
        if not isinstance(meta, SimulatedKVMetadata):
            return
        for request_id in meta.loads_started:
            index = int(request_id)
            handoff = self.handoffs[index]
            handoff.transfer_start_s = start_s
            total = self.specs[index].input_len * self.kv_bytes_per_token
            handoff.transfer_bytes = total
            self.transfers.open(index, handoff.prefill_engine, engine.index, start_s)
            if self.mode is TransferMode.READ:
                self.transfers.add_bytes(index, total, start_s)
                self.transfers.close(index, start_s)
                continue
            self.transfers.add_bytes(index, self.buffered.pop(index, 0.0), start_s)
            if 0 <= handoff.prefill_done_s <= start_s:
                self.transfers.close(index, start_s)

    def _storage_loads(self, output: Any, start_s: float) -> None:
        """Record the reads a decode step did (``STORAGE`` mode): the
        requests it scheduled first with tokens loaded."""
        transfer = self.transfers.model
        for new in output.scheduled_new_reqs:
            handoff = self.handoffs[int(new.req_id)]
            handoff.transfer_start_s = start_s
            handoff.transfer_bytes = new.num_computed_tokens * self.kv_bytes_per_token
            handoff.transfer_done_s = start_s + (
                transfer.read_s(handoff.transfer_bytes)
                if new.num_computed_tokens
                else 0.0
            )


def _stored_tokens(prompt_len: int, block_size: int) -> int:
    from neuron_scheduler.offline.pd_connector import stored_prompt_tokens

    return stored_prompt_tokens(prompt_len, block_size)


def storage_step_seconds(
    transfer: TransferModel, kv_bytes_per_token: float, block_size: int, role: str
) -> Callable[[Any], float]:
    """What a ``STORAGE`` connector adds to a step of a ``role`` engine:
    the prefill side writes the whole blocks of each prompt it starts, the
    decode side reads the tokens loaded for each request it starts."""

    def prefill_side(output: Any) -> float:
        seconds = 0.0
        for new in output.scheduled_new_reqs:
            stored = _stored_tokens(len(new.prompt_token_ids or ()), block_size)
            if stored:
                seconds += transfer.write_s(stored * kv_bytes_per_token)
        return seconds

    def decode_side(output: Any) -> float:
        return sum(
            transfer.read_s(new.num_computed_tokens * kv_bytes_per_token)
            for new in output.scheduled_new_reqs
            if new.num_computed_tokens
        )

    return prefill_side if role == "prefill" else decode_side


def storage_line_seconds(
    transfer: TransferModel,
    kv_bytes_per_token: float,
    block_size: int,
    role: str,
    lines: Sequence[dict[str, Any]],
) -> list[float]:
    """What ``storage_step_seconds`` charges each step of a ``role``
    engine's step log (``step_log``), one a line: the prefill side writes
    the whole blocks of each prompt a step starts (its real tokens,
    ``scheduled``: a prefill engine takes a prompt whole), the decode side
    reads the tokens loaded for each request it starts (its first chunk's
    tokens computed before). A line without ``scheduled`` is charged no
    write."""
    seen: set[str] = set()
    charges = []
    for line in lines:
        seconds = 0.0
        if line["kind"] == "prefill":
            chunks = line["chunks"]
            scheduled = line.get("scheduled") or [0] * len(chunks)
            for request_id, (_, before), tokens in zip(
                line["ids"], chunks, scheduled, strict=True
            ):
                if request_id in seen:
                    continue
                if role == "prefill" and before == 0:
                    stored = _stored_tokens(tokens, block_size)
                    if stored:
                        seconds += transfer.write_s(stored * kv_bytes_per_token)
                elif role == "decode" and before:
                    seconds += transfer.read_s(before * kv_bytes_per_token)
        seen.update(line["ids"])
        charges.append(seconds)
    return charges


@dataclass(frozen=True)
class DisaggregationOptions:
    """An xPyD run as ``bench --disaggregated`` asks for it: the pool sizes,
    each role's ``neuron_config``, tensor-parallel size and profile
    (``None``: the run's own), and the transfer."""

    sizes: PoolSizes
    prefill_config: dict[str, Any] = field(default_factory=dict)
    decode_config: dict[str, Any] = field(default_factory=dict)
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None
    prefill_cost_profile: str | None = None
    decode_cost_profile: str | None = None
    transfer: TransferModel = field(default_factory=TransferModel)


def build_pools(
    options: DisaggregationOptions, choice: EngineChoice
) -> tuple[Pool, Pool]:
    """The prefill and decode pools: ``choice`` (the run's engine and cost
    model) with each role's TP size and profile; checked (``check_pools``;
    ``CostModelError`` where a role's choice contradicts its profile)."""
    pools = []
    for role, engines in (
        ("prefill", options.sizes.prefill),
        ("decode", options.sizes.decode),
    ):
        tp = getattr(options, f"{role}_tensor_parallel_size")
        profile = getattr(options, f"{role}_cost_profile")
        role_choice = replace(
            choice,
            tensor_parallel_size=tp or choice.tensor_parallel_size,
            cost_profile=profile or choice.cost_profile,
        )
        cost, settings = engine_setup(role_choice)
        config = getattr(options, f"{role}_config")
        policy = Policy(role, NeuronScheduler, dict(config))
        check_profile_covers(cost, settings, [policy])
        pools.append(Pool(role, engines, policy, settings, cost))
    prefill, decode = pools
    check_pools(prefill, decode)
    return prefill, decode
