"""Routers: which of a fleet's engines a new request goes to.

A router sees each engine through ``EngineLoad`` (what a load balancer can
know) and is told when a request it routed finishes. ``RouterKind`` names
the routers, ``make_router`` builds one (the shape of vLLM's
``request_queue.py``).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


class RouterKind(enum.Enum):
    """How a fleet spreads requests over its engines (`--router`)."""

    #: vLLM 0.32's own data-parallel load balancing (``DPLBAsyncMPClient``).
    VLLM = "vllm"
    ROUND_ROBIN = "round-robin"
    #: Fewest unfinished requests, looked up exactly at each arrival.
    LEAST_LOADED = "least-loaded"


@dataclass(frozen=True)
class EngineLoad:
    """One engine as its scheduler reports it now."""

    running: int
    waiting: int
    kv_cache_usage: float


class Router(ABC):
    """Chooses an engine per request, over ``num_engines`` engines."""

    #: ``choose`` reads the loads or hears ``finished``: False lets a fleet
    #: route every request before the engines run.
    reads_loads = True

    def __init__(self, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"a fleet needs at least 1 engine, got {num_engines}")
        self.num_engines = num_engines

    @abstractmethod
    def choose(self, now_s: float, loads: Sequence[EngineLoad]) -> int:
        """The engine for a request arriving at ``now_s``, given every
        engine's current load."""

    def finished(self, engine: int) -> None:  # noqa: B027 - optional hook
        """A request routed to ``engine`` finished (default: nothing)."""


class RoundRobinRouter(Router):
    reads_loads = False

    def __init__(self, num_engines: int) -> None:
        super().__init__(num_engines)
        self._next = 0

    def choose(self, now_s: float, loads: Sequence[EngineLoad]) -> int:
        engine = self._next
        self._next = (engine + 1) % self.num_engines
        return engine


class LeastLoadedRouter(Router):
    def choose(self, now_s: float, loads: Sequence[EngineLoad]) -> int:
        return min(
            range(self.num_engines), key=lambda i: loads[i].running + loads[i].waiting
        )


class VLLMRouter(Router):
    """vLLM 0.32's data-parallel load balancing, for one API-server client
    (``vllm/v1/engine/core_client.py``, ``DPLBAsyncMPClient.
    get_core_engine_for_request``): the score of an engine is the larger of
    this client's in-flight count and the ``waiting + running`` of the last
    stats snapshot, plus ``6 x waiting x (kv_cache_usage - 0.5)`` when
    requests wait and the KV cache is over half full; the lowest score wins,
    the scan starting at an index that rotates after every choice (ties go
    round); the chosen engine's snapshot counts one more waiting request
    until the next snapshot. Snapshots come from vLLM's DP coordinator at
    most every 100 ms (``coordinator.py``, ``min_stats_update_interval_ms``).
    """

    SNAPSHOT_INTERVAL_S = 0.1

    def __init__(self, num_engines: int) -> None:
        super().__init__(num_engines)
        self._start = 0
        self._inflight = [0] * num_engines
        #: [waiting, running, kv_cache_usage] per engine, as last published.
        self._snapshot: list[list[float]] = [[0, 0, 0.0] for _ in range(num_engines)]
        self._snapshot_s = float("-inf")

    def choose(self, now_s: float, loads: Sequence[EngineLoad]) -> int:
        if now_s - self._snapshot_s >= self.SNAPSHOT_INTERVAL_S:
            self._snapshot = [
                [load.waiting, load.running, load.kv_cache_usage] for load in loads
            ]
            self._snapshot_s = now_s
        best, best_score = 0, float("inf")
        for offset in range(self.num_engines):
            engine = (self._start + offset) % self.num_engines
            waiting, running, usage = self._snapshot[engine]
            score = max(float(self._inflight[engine]), waiting + running)
            if waiting:
                score += waiting * 6.0 * max(0.0, usage - 0.5)
            if score < best_score:
                best, best_score = engine, score
        self._snapshot[best][0] += 1
        self._start = (self._start + 1) % self.num_engines
        self._inflight[best] += 1
        return best

    def finished(self, engine: int) -> None:
        self._inflight[engine] -= 1


def make_router(kind: RouterKind, num_engines: int) -> Router:
    """A router of ``kind`` for ``num_engines`` engines."""
    routers: dict[RouterKind, type[Router]] = {
        RouterKind.VLLM: VLLMRouter,
        RouterKind.ROUND_ROBIN: RoundRobinRouter,
        RouterKind.LEAST_LOADED: LeastLoadedRouter,
    }
    return routers[kind](num_engines)
