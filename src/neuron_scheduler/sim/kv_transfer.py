"""The KV transfer between a prefill and a decode engine, as the simulator
charges it.

A transfer is a flow of bytes (prompt tokens x the model's KV bytes per
token) over the link between its two engines. Flows on one link share its
bandwidth equally while they have bytes to move (processor sharing, what
several RDMA reads over one NIC get); a flow is done ``latency_s`` after
its last byte has moved (the connector's notification and bookkeeping).
Flows on different links do not interact. When the bytes are released is
the mode's (``TransferMode``): all at once after the prefill (``READ``), or
chunk by chunk as the prefill computes them (``WRITE``), so a pushed
transfer overlaps the prefill's compute and a pulled one follows it.

Default link, with its source: one trn2 chip's share of a trn2.48xlarge's
EFA (AWS, "Amazon EC2 Trn2 instances": 3.2 Tbit/s EFAv3 for 16 Trainium2
chips: 200 Gbit/s = 25 GB/s a chip), for a TP4 engine (one chip at LNC=2);
the latency (1 ms) is an assumption of this model, not a measurement:
measure yours and pass it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

#: One trn2 chip's share of trn2.48xlarge EFA, bytes/s (see above).
DEFAULT_LINK_BYTES_PER_S = 25e9
DEFAULT_LATENCY_S = 1e-3


class TransferMode(enum.Enum):
    """How a prompt's KV reaches the decode engine.

    ``READ`` (AWS's documented mode, NIXL's): the proxy sends the prompt to
    a prefill engine with ``max_tokens=1``, then to a decode engine, which
    pulls the KV once it has admitted the request; the prefill engine holds
    the blocks until they are read. ``WRITE``: the proxy sends to both at
    once; the prefill engine pushes each chunk's KV as it is computed, into
    blocks the decode engine allocated when it admitted the request."""

    READ = "read"
    WRITE = "write"
    #: vLLM's ExampleConnector (``offline.pd_connector``): the prefill
    #: engine writes the prompt's whole blocks to a shared folder inside its
    #: step, and frees its blocks at once; the decode engine reads them
    #: inside the step that schedules the request and computes the rest of
    #: the prompt (1 to block-size tokens) as a short prefill. Each side's
    #: step takes ``latency_s`` + bytes over its throughput longer.
    STORAGE = "storage"


@dataclass(frozen=True)
class TransferModel:
    """Latency and per-link bandwidth of KV transfers, and the mode."""

    mode: TransferMode = TransferMode.READ
    #: Bytes/s of a link; in ``STORAGE`` mode, of writing to the folder.
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S
    #: Per transfer; in ``STORAGE`` mode, per write and per read.
    latency_s: float = DEFAULT_LATENCY_S
    #: ``STORAGE`` mode: bytes/s of reading from the folder (``None``: as
    #: writing).
    read_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.link_bytes_per_s > 0 and math.isfinite(self.link_bytes_per_s)):
            raise ValueError(
                f"KV link bandwidth must be > 0 bytes/s, got {self.link_bytes_per_s!r}"
            )
        read = self.read_bytes_per_s
        if read is not None and not (read > 0 and math.isfinite(read)):
            raise ValueError(f"KV read throughput must be > 0 bytes/s, got {read!r}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(
                f"KV transfer latency must be >= 0 s, got {self.latency_s!r}"
            )

    def write_s(self, num_bytes: float) -> float:
        """``STORAGE`` mode: seconds a step spends writing ``num_bytes``."""
        return self.latency_s + num_bytes / self.link_bytes_per_s

    def read_s(self, num_bytes: float) -> float:
        """``STORAGE`` mode: seconds a step spends reading ``num_bytes``."""
        return self.latency_s + num_bytes / (
            self.read_bytes_per_s or self.link_bytes_per_s
        )

    def describe(self) -> str:
        if self.mode is TransferMode.STORAGE:
            read = self.read_bytes_per_s or self.link_bytes_per_s
            return (
                f"KV transfer storage: write {self.link_bytes_per_s / 1e9:g} GB/s, "
                f"read {read / 1e9:g} GB/s, {self.latency_s * 1e3:g} ms a side"
            )
        return (
            f"KV transfer {self.mode.value}: {self.link_bytes_per_s / 1e9:g} GB/s a "
            f"link, {self.latency_s * 1e3:g} ms latency"
        )


@dataclass
class _Flow:
    remaining: float = 0.0
    #: No more bytes will be released (the prefill is done).
    closed: bool = False
    closed_s: float = 0.0
    moved_s: float = 0.0


@dataclass
class _Link:
    """One link: its flows, advanced together to ``now``."""

    bytes_per_s: float
    now: float = 0.0
    flows: dict[int, _Flow] = field(default_factory=dict)

    def active(self) -> list[_Flow]:
        return [flow for flow in self.flows.values() if flow.remaining > 0]

    def next_drain_s(self) -> float:
        """When the next flow with bytes runs dry, at today's sharing."""
        active = self.active()
        if not active:
            return math.inf
        least = min(flow.remaining for flow in active)
        return self.now + least * len(active) / self.bytes_per_s

    def advance(self, to_s: float) -> None:
        """Move bytes until ``to_s``, re-sharing as flows run dry."""
        while self.now < to_s:
            active = self.active()
            if not active:
                self.now = to_s
                return
            drain_s = self.next_drain_s()
            until = min(drain_s, to_s)
            moved = (until - self.now) * self.bytes_per_s / len(active)
            for flow in active:
                flow.remaining -= moved
                if until == drain_s and flow.remaining <= 1e-6 * self.bytes_per_s:
                    flow.remaining = 0.0
                if flow.remaining <= 0.0:
                    flow.remaining = 0.0
                    flow.moved_s = until
            self.now = until


class Transfers:
    """Every KV transfer of a run, on a link per (prefill engine, decode
    engine) pair. Calls come in time order (the run's event loop); each
    transfer is named by its request's index."""

    def __init__(self, model: TransferModel) -> None:
        self.model = model
        self._links: dict[tuple[int, int], _Link] = {}
        self._link_of: dict[int, tuple[int, int]] = {}
        #: Requests whose transfer is done, with the time it was.
        self._done: dict[int, float] = {}

    def open(self, index: int, prefill: int, decode: int, now_s: float) -> None:
        """Start request ``index``'s transfer from ``prefill`` to ``decode``."""
        key = (prefill, decode)
        link = self._links.setdefault(key, _Link(self.model.link_bytes_per_s, now_s))
        link.advance(now_s)
        link.flows[index] = _Flow()
        self._link_of[index] = key

    def add_bytes(self, index: int, num_bytes: float, now_s: float) -> None:
        """Release ``num_bytes`` more of ``index``'s KV to move."""
        link = self._links[self._link_of[index]]
        link.advance(now_s)
        link.flows[index].remaining += num_bytes

    def close(self, index: int, now_s: float) -> None:
        """No more of ``index``'s KV will be released."""
        link = self._links[self._link_of[index]]
        link.advance(now_s)
        flow = link.flows[index]
        flow.closed, flow.closed_s = True, now_s

    def is_open(self, index: int) -> bool:
        return index in self._link_of

    def next_event_s(self) -> float:
        """The earliest time a transfer may finish (or a link re-share)."""
        soonest = min(self._done.values(), default=math.inf)
        for link in self._links.values():
            soonest = min(soonest, link.next_drain_s())
            for flow in link.flows.values():
                if flow.closed and flow.remaining == 0.0:
                    soonest = min(soonest, self._finish_s(flow))
        return soonest

    def _finish_s(self, flow: _Flow) -> float:
        """A closed, drained flow is done a latency after its last byte
        moved (or after it closed, if it was drained before)."""
        return max(flow.moved_s, flow.closed_s) + self.model.latency_s

    def finished_by(self, now_s: float) -> list[tuple[int, float]]:
        """The transfers done by ``now_s`` (index, when), each once."""
        for link in self._links.values():
            link.advance(now_s)
            for index, flow in list(link.flows.items()):
                if flow.closed and flow.remaining == 0.0:
                    self._done[index] = self._finish_s(flow)
                    del link.flows[index]
        done = sorted(
            ((i, s) for i, s in self._done.items() if s <= now_s), key=lambda d: d[1]
        )
        for index, _ in done:
            del self._done[index]
            del self._link_of[index]
        return done
