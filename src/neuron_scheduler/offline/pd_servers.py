"""A real disaggregated 1P1D (or xPyD) on this machine: vLLM OpenAI servers
for each role joined by vLLM's ``ExampleConnector`` (with its lookup fixed:
``pd_connector``), behind the read-mode proxy (``pd_proxy``).

Why that connector: it is the one of vLLM's connectors that runs on the CPU
platform with nothing installed beyond vLLM (NIXL is not installed here; its
TCP transport would need the ``nixl`` package and UCX). Every role stores
and loads a prompt's KV as safetensors files in one shared folder, keyed by
the prompt's tokens: the prefill server writes each layer's KV inside its
forward pass, the decode server reads it in the step that schedules the
request. What it moves is the prompt's whole blocks, the last token left
out (``stored_prompt_tokens``); the decode engine computes the rest (1 to
``block_size`` tokens) as a short prefill, then decodes. A prompt whose KV
is not in the folder (the prefill never ran it, or failed) is computed
whole by the decode engine: this connector never leaves a request waiting.
The connector stores a prompt only when its first step covers all of it:
``check_pair`` refuses a prefill engine whose ``max_num_batched_tokens`` is
below ``max_model_len``.

Each engine's worker is bound to its own core where there are enough
(``engine_cores``; vLLM's ``VLLM_CPU_OMP_THREADS_BIND``): left to vLLM, every
CPU engine binds all the cores but one reserved, so two engines on this
2-core machine both bind cores 0 and 1 and their OpenMP threads fight
(measured: the default validation workload's TTFT 7x what the profiles
predict). A profile meant for a role must be measured on its core alone.

The rest of each server (its API server and engine core: every thread the
worker leaves unbound) is bound too, once the servers are up
(``DisaggregatedServers.start``): to the cores no worker uses where
there are any, else to its own worker's core, the proxy and the client
with the decode engines. Left to the kernel, the decode engine core (which
spins on the worker's reply, a third of a core) ran on the prefill
worker's core, and a prompt's prefill step took up to 3x as long whenever
the decode engine was busy: measured 2026-12-03, the engine core holding
3.0 s of a 5.1 s step. With the binding an engine's serving cost slows its
own steps, which ``validate --calibrate`` fits, and never the other's.

The shared folder is in memory (``kv_folder_parent``: ``/dev/shm`` where
it has room) so that a hop costs what a memory copy costs. On this
machine's disk-backed ``/tmp`` the folder's write speed was bimodal, from
the page cache or from the disk (measured 2026-12-03: 0.11-0.13 or 4.1-4.4
GB/s, changing from one minute to the next), so neither the measured
transfer model nor the served prefill steps held still; in ``/dev/shm``
1.9-3.0 GB/s.

``DisaggregatedServers`` starts the servers side by side and the proxy
after them, each in its own process group, and stops every one of them by
process group on exit, on success and on failure alike, and removes the
KV folder it made.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from neuron_scheduler.offline.cpu_binding import bind_unbound, worker_cores
from neuron_scheduler.offline.engine_spec import EngineSpec, server_args
from neuron_scheduler.offline.server import ServerProcess

#: The memory-backed folder the KV folder goes in, where it has room.
MEMORY_FOLDER = Path("/dev/shm")
#: Room ``MEMORY_FOLDER`` must have (a container's default /dev/shm is 64 MB;
#: one 4096-token prompt of the validation model writes 100 MB).
MEMORY_FOLDER_MIN_FREE_BYTES = 2 << 30

#: The connector module, imported by the servers (not here: it imports vLLM).
CONNECTOR = "AlignedExampleConnector"
CONNECTOR_MODULE = "neuron_scheduler.offline.pd_connector"


def kv_transfer_config(storage: Path) -> str:
    """``--kv-transfer-config`` of either role."""
    return json.dumps(
        {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
    )


@dataclass(frozen=True)
class PairSpec:
    """The engines of each role (``EngineSpec``: each its own
    ``neuron_config``, limits and KV cache) and how many of each."""

    prefill: EngineSpec
    decode: EngineSpec
    prefill_engines: int = 1
    decode_engines: int = 1


def check_pair(pair: PairSpec) -> None:
    """``ValueError`` naming the values where the roles disagree on what a
    transfer carries or the prefill engine would chunk a prompt."""
    for name in ("model", "max_model_len", "block_size", "dtype"):
        ours, theirs = getattr(pair.prefill, name), getattr(pair.decode, name)
        if ours != theirs:
            raise ValueError(
                f"the decode engine's {name} {theirs!r} differs from the prefill "
                f"engine's {ours!r}: a transferred prompt must fit both"
            )
    if pair.prefill.max_num_batched_tokens < pair.prefill.max_model_len:
        raise ValueError(
            f"the prefill engine's max_num_batched_tokens "
            f"{pair.prefill.max_num_batched_tokens} is below its max_model_len "
            f"{pair.prefill.max_model_len}: {CONNECTOR} stores a prompt only "
            "when one step prefills all of it"
        )
    for role, count in (
        ("prefill", pair.prefill_engines),
        ("decode", pair.decode_engines),
    ):
        if count < 1:
            raise ValueError(f"a {role} pool of {count} engines; each needs at least 1")


#: vLLM's CPU worker binding (a core list, ``|`` between ranks).
CORE_BINDING_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def engine_cores(pair: PairSpec) -> list[str]:
    """The core each engine's worker runs on (prefill engines first, then
    decode), the usable cores taken in turn: a ``CORE_BINDING_ENV`` value."""
    cores = sorted(os.sched_getaffinity(0))
    count = pair.prefill_engines + pair.decode_engines
    return [str(cores[i % len(cores)]) for i in range(count)]


class ProxyProcess(ServerProcess):
    """``pd_proxy`` in front of ``prefill`` and ``decode`` base URLs."""

    what = "the P/D proxy"

    def __init__(
        self, prefill: Sequence[str], decode: Sequence[str], log_path: Path
    ) -> None:
        self._targets = (list(prefill), list(decode))
        super().__init__("", [], log_path, startup_timeout_s=60.0)

    def build_command(self, model: str, args: Sequence[str]) -> list[str]:
        prefill, decode = self._targets
        command = [sys.executable, "-m", "neuron_scheduler.offline.pd_proxy"]
        for url in prefill:
            command += ["--prefill", url]
        for url in decode:
            command += ["--decode", url]
        return [*command, "--port", str(self.port)]


class DisaggregatedServers:
    """The servers of ``pair`` and the proxy; a context manager.
    ``base_url`` is the proxy's. Logs go to ``log_dir`` (``prefill-0.log``,
    ``decode-0.log``, ``proxy.log``); the KV folder is a temporary one in
    ``kv_folder_parent()``, removed by ``stop``, unless ``storage`` is
    given."""

    def __init__(
        self,
        pair: PairSpec,
        log_dir: Path,
        *,
        storage: Path | None = None,
        env: dict[str, dict[str, str]] | None = None,
    ) -> None:
        """``env``: added to the environment of each role's servers, by
        role name (``"prefill"``, ``"decode"``)."""
        check_pair(pair)
        role_env = env or {}
        self._owned_storage = (
            tempfile.TemporaryDirectory(prefix="pd-kv-", dir=kv_folder_parent())
            if storage is None
            else None
        )
        self.storage = storage or Path(self._owned_storage.name)  # type: ignore[union-attr]
        connector = ["--kv-transfer-config", kv_transfer_config(self.storage)]
        cores = iter(engine_cores(pair))

        def servers(
            role: str, spec: EngineSpec, count: int, *extra: str
        ) -> list[ServerProcess]:
            return [
                ServerProcess(
                    spec.model,
                    [*server_args(spec), *connector, *extra],
                    log_dir / f"{role}-{i}.log",
                    env={**role_env.get(role, {}), CORE_BINDING_ENV: next(cores)},
                )
                for i in range(count)
            ]

        self.prefill = servers("prefill", pair.prefill, pair.prefill_engines)
        # The decode side's usage then says how many prompt tokens were loaded.
        self.decode = servers(
            "decode", pair.decode, pair.decode_engines, "--enable-prompt-tokens-details"
        )
        self.proxy = ProxyProcess(
            [s.base_url for s in self.prefill],
            [s.base_url for s in self.decode],
            log_dir / "proxy.log",
        )
        self.base_url = self.proxy.base_url
        #: Where the client of the pair should run (``start`` sets it).
        self.client_cores: frozenset[int] = frozenset()

    @property
    def processes(self) -> list[ServerProcess]:
        return [*self.prefill, *self.decode, self.proxy]

    def start(self) -> DisaggregatedServers:
        """Start every server side by side, then the proxy; if any fails
        (or a signal arrives), everything started is stopped first."""
        try:
            for server in (*self.prefill, *self.decode):
                server.launch()
            for server in (*self.prefill, *self.decode):
                server.wait_healthy()
            self.proxy.start()
            self.client_cores = self._bind_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def _bind_serving(self) -> frozenset[int]:
        """Each server's unbound threads on the cores no worker uses where
        any are left, else on its own worker's; the proxy where the decode
        servers' went. Returns the cores the client should use (empty: no
        worker is bound, nothing was changed)."""
        servers = (*self.prefill, *self.decode)
        workers = [worker_cores(_pid(server)) for server in servers]
        if not any(workers):
            return frozenset()
        free = frozenset(os.sched_getaffinity(0)).difference(*workers)
        for server, cores in zip(servers, workers, strict=True):
            bind_unbound(_pid(server), free or cores)
        decode_workers = workers[len(self.prefill) :]
        client = free or frozenset[int]().union(*decode_workers)
        bind_unbound(_pid(self.proxy), client)
        return client

    def clear_storage(self) -> None:
        """Empty the KV folder: a prompt found there is loaded, on either
        side, not computed (the connector is also a prefix cache), so a run
        that must prefill prompts sent before starts from an empty one."""
        import shutil

        for entry in self.storage.iterdir():
            shutil.rmtree(entry, ignore_errors=True)

    def stop(self) -> None:
        """Stop the proxy and every server (idempotent), by process group."""
        for process in reversed(self.processes):
            process.stop()
        if self._owned_storage is not None:
            self._owned_storage.cleanup()
            self._owned_storage = None

    def __enter__(self) -> DisaggregatedServers:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def kv_folder_parent(
    memory: Path = MEMORY_FOLDER, min_free_bytes: int = MEMORY_FOLDER_MIN_FREE_BYTES
) -> Path | None:
    """``memory`` if it is a writable folder with ``min_free_bytes`` free,
    else None (the system's temporary folder)."""
    if not (memory.is_dir() and os.access(memory, os.W_OK | os.X_OK)):
        return None
    usage = os.statvfs(memory)
    return memory if usage.f_bavail * usage.f_frsize >= min_free_bytes else None


def _pid(server: ServerProcess) -> int:
    assert server.process is not None, "launch() first"
    return server.process.pid


@dataclass(frozen=True)
class StorageTimes:
    """Seconds the connector's folder takes on this machine: a fixed part
    per prompt (``*_s``) and a throughput (``*_bytes_per_s``), each side."""

    write_s: float
    write_bytes_per_s: float
    read_s: float
    read_bytes_per_s: float


def measure_storage(
    folder: Path,
    num_layers: int,
    layer_bytes_per_token: int,
    tokens: Sequence[int] = (64, 512, 2048),
    repeats: int = 3,
) -> StorageTimes:
    """Time what ``ExampleConnector`` does per prompt in ``folder``: one
    safetensors file a layer written (the prefill side), then read (the
    decode side), for prompts of ``tokens``; medians of ``repeats``, fitted
    as a fixed part plus bytes over a throughput (least squares)."""
    import statistics
    import time

    import safetensors.torch
    import torch

    sizes, writes, reads = [], [], []
    for count in tokens:
        tensor = torch.rand(count, layer_bytes_per_token // 4)
        write, read = [], []
        for repeat in range(repeats):
            target = folder / f"measure-{count}-{repeat}"
            target.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            for layer in range(num_layers):
                safetensors.torch.save_file(
                    {"kv_cache": tensor}, target / f"{layer}.st"
                )
            write.append(time.perf_counter() - start)
            start = time.perf_counter()
            for layer in range(num_layers):
                # The connector copies what it read into the KV cache.
                safetensors.torch.load_file(target / f"{layer}.st")["kv_cache"].clone()
            read.append(time.perf_counter() - start)
        sizes.append(count * layer_bytes_per_token * num_layers)
        writes.append(statistics.median(write))
        reads.append(statistics.median(read))
    write_s, write_rate = _fit_line(sizes, writes)
    read_s, read_rate = _fit_line(sizes, reads)
    return StorageTimes(write_s, write_rate, read_s, read_rate)


def _fit_line(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Intercept (>= 0) and throughput of ``seconds = a + sizes / rate``
    (least squares)."""
    import numpy as np

    slope, intercept = np.polyfit(sizes, seconds, 1)
    slope = max(float(slope), 1e-15)
    return max(0.0, float(intercept)), 1.0 / slope
