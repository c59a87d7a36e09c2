"""A simulated KV connector for offline runs (the offline engine, tests, property
suite): remote KV hits, async loads and lookups that are not ready, with no
transfer behind them.

Modelled on vLLM's own test connector (``tests/v1/kv_connector/unit/
utils.py::MockKVConnector``), plus what an offline engine needs to finish
the loads it starts: the step metadata lists them, and ``OfflineEngine``
reports each one finished after ``load_steps`` steps, as a worker would.

Per request (``request.kv_transfer_params``) or for all requests
(``kv_connector_extra_config``):

* ``remote_tokens``: prompt tokens the remote side holds (default 0; a
  synchronous load always leaves the last token to compute, an async one
  may cover the whole prompt, as a P/D transfer does). A request loads them
  once, as P/D connectors consume ``do_remote_prefill``: vLLM may look a
  request up again after its load (a whole 1-token prompt loaded is reset to
  0 computed tokens) and then finds nothing more;
* ``async_load``: load asynchronously (the request waits in
  ``WAITING_FOR_REMOTE_KVS``) or within the step (default ``True``);
* ``lookup_defers``: how many lookups answer "not ready yet" (``None``)
  before the hit is known (default 0);
* ``load_steps``: engine steps an async load takes (default 1);
* ``do_remote_decode``: the prefill side of P/D (vLLM's NIXL name): a
  finished request keeps its KV blocks until the engine reports them sent
  (``finished_sending``), as ``request_finished`` answers for NIXL
  (default ``False``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request

#: ``kv_connector`` name and module for ``KVTransferConfig``.
CONNECTOR_NAME = "SimulatedKVConnector"
CONNECTOR_MODULE = __name__

_DEFAULTS: dict[str, Any] = {
    "remote_tokens": 0,
    "async_load": True,
    "lookup_defers": 0,
    "load_steps": 1,
    "do_remote_decode": False,
}


@dataclass
class SimulatedKVMetadata(KVConnectorMetadata):
    """One step's metadata: request id -> steps its async load takes, for
    the loads started in the step."""

    loads_started: dict[str, int] = field(default_factory=dict)


class SimulatedKVConnector(KVConnectorBase_V1):
    """Scheduler-side connector answering from the settings above; its
    worker-side methods do nothing."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        unknown = set(extra) - set(_DEFAULTS)
        if unknown:
            raise ValueError(
                f"{CONNECTOR_NAME}: unknown kv_connector_extra_config keys "
                f"{sorted(unknown)} (known: {sorted(_DEFAULTS)})"
            )
        self._defaults = {**_DEFAULTS, **extra}
        self._defers_left: dict[str, int] = {}
        self._loads_started: dict[str, int] = {}
        #: Lookups answered per request id, and those answered "not ready".
        self.lookups: defaultdict[str, int] = defaultdict(int)
        self.deferred_lookups = 0
        #: Requests whose last lookup answered "not ready".
        self.not_ready: set[str] = set()
        #: Requests whose remote tokens were handed out (loaded once).
        self._loaded: set[str] = set()

    def setting(self, request: Request, key: str) -> Any:
        """``key`` for ``request``: its ``kv_transfer_params`` or the default."""
        params = request.kv_transfer_params or {}
        return params.get(key, self._defaults[key])

    # ------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        request_id = request.request_id
        self.lookups[request_id] += 1
        defers = self._defers_left.setdefault(
            request_id, int(self.setting(request, "lookup_defers"))
        )
        if defers > 0:
            self._defers_left[request_id] = defers - 1
            self.deferred_lookups += 1
            self.not_ready.add(request_id)
            return None, False
        self.not_ready.discard(request_id)
        if request_id in self._loaded:
            return 0, False
        is_async = bool(self.setting(request, "async_load"))
        # A synchronous load leaves the last token to compute in the step.
        available = request.num_tokens - num_computed_tokens - (0 if is_async else 1)
        matched = max(0, min(int(self.setting(request, "remote_tokens")), available))
        return matched, is_async and matched > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self._loaded.add(request.request_id)
        if num_external_tokens > 0 and self.setting(request, "async_load"):
            self._loads_started[request.request_id] = int(
                self.setting(request, "load_steps")
            )

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        meta = SimulatedKVMetadata(dict(self._loads_started))
        self._loads_started.clear()
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._defers_left.pop(request.request_id, None)
        self.not_ready.discard(request.request_id)
        self._loaded.discard(request.request_id)
        held = bool(self.setting(request, "do_remote_decode")) and bool(block_ids)
        return held, None

    # --------------------------------------------------------- worker side

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
