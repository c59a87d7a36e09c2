"""Requests whose KV never arrives, failed after ``kv_load_timeout_s``.

vLLM waits for a KV connector's worker to report each async load, finished
or failed, and has no timeout of its own: a transfer the connector loses
(a prefill engine that died, a storage file that never appears) leaves the
request in ``WAITING_FOR_REMOTE_KVS`` with its blocks held, and its client
waiting, for ever. With ``neuron_config['kv_load_timeout_s']`` the scheduler
fails such a request once it has waited that long since its load started:
its client gets an error (``FINISHED_ERROR``), its blocks go back to the
pool at once, and a report of that load arriving later is dropped (vLLM
would look the finished request up and stop the engine).

The choice stated: vLLM, aborting a loading request, keeps its blocks until
the worker reports the load (the worker may still be writing into them).
A load that is never reported would hold them for ever, so the timeout
frees them; a connector whose worker still writes after that would write
into blocks another request may hold by then. Set the timeout above the
connector's own failure detection (NIXL reports a lost peer itself, within
its handshake and heartbeat timeouts), so that it fires only for loads the
connector has lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class KvLoadWatch:
    """When each load started, and the loads given up on.

    ``clock``: seconds, monotonic (a simulator may pass its own clock)."""

    timeout_s: float
    clock: Callable[[], float] = time.monotonic
    _started: dict[str, float] = field(default_factory=dict)
    _abandoned: set[str] = field(default_factory=set)

    def expired(self, loading: Iterable[str]) -> list[str]:
        """Of the requests ``loading`` now, those loading for ``timeout_s``
        or more since first seen, given up on from now on (a request not
        loading any more is forgotten)."""
        now = self.clock()
        loading = set(loading)
        self._started = {
            request_id: self._started.get(request_id, now) for request_id in loading
        }
        expired = sorted(
            request_id
            for request_id, started in self._started.items()
            if now - started >= self.timeout_s
        )
        for request_id in expired:
            del self._started[request_id]
        self._abandoned.update(expired)
        return expired

    def drop_late_reports(self, kv_connector_output: Any) -> set[str]:
        """Remove from a worker's ``KVConnectorOutput`` its reports of loads
        given up on (``finished_recving``, and ``failed_recving`` where the
        vLLM has it); returns the ids dropped."""
        dropped: set[str] = set()
        for name in ("finished_recving", "failed_recving"):
            reported = set(getattr(kv_connector_output, name, None) or ())
            late = reported & self._abandoned
            if late:
                setattr(kv_connector_output, name, reported - late)
                dropped |= late
        self._abandoned -= dropped
        return dropped

    @property
    def abandoned(self) -> frozenset[str]:
        """Loads given up on whose late report has not come (yet)."""
        return frozenset(self._abandoned)
