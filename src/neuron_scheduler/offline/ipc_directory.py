"""A directory of this process's own for vLLM's ZMQ IPC sockets.

vLLM binds them under ``VLLM_RPC_BASE_PATH`` (the temp directory by
default) and leaves them there when its process ends: an in-process engine
with the ``mp`` executor (``profile``, validate's profile) left 4 sockets in
/tmp a start. Servers get a directory each (``ServerProcess``); in-process
engines (those, the demo's, the tests') share this one, since vLLM reads
its environment once an engine core has started
(``vllm.envs.enable_envs_cache``) and every later engine of the process
binds where the first did.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

RPC_BASE_PATH = "VLLM_RPC_BASE_PATH"

#: The most characters of a Unix socket's path (``sockaddr_un.sun_path``);
#: vLLM names a socket with a UUID4 (36 characters) in its directory.
MAX_SOCKET_PATH_CHARS = 107
SOCKET_NAME_CHARS = 36

#: Names the directory ``use_process_ipc_directory`` made, so that servers
#: started from this process get their own instead of inheriting it.
PROCESS_IPC_DIRECTORY = "NEURON_SCHEDULER_IPC_DIR"


def new_ipc_directory() -> Path | None:
    """A new directory in the temp directory for vLLM's sockets, or None
    where their paths would be too long for a Unix socket (then vLLM binds
    in the temp directory itself, as by default, where they are shorter)."""
    directory = Path(tempfile.mkdtemp(prefix="vllm-ipc-"))
    if len(str(directory)) + 1 + SOCKET_NAME_CHARS > MAX_SOCKET_PATH_CHARS:
        directory.rmdir()
        return None
    return directory


def use_process_ipc_directory() -> str | None:
    """Point ``VLLM_RPC_BASE_PATH`` at a ``new_ipc_directory``, removed when
    the process exits, unless it is set already (by the caller, or by an
    earlier call); return the path it holds. Call before the engine starts."""
    if RPC_BASE_PATH not in os.environ:
        directory = new_ipc_directory()
        if directory is None:
            return None
        os.environ[RPC_BASE_PATH] = str(directory)
        os.environ[PROCESS_IPC_DIRECTORY] = str(directory)
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return os.environ[RPC_BASE_PATH]


def set_by_this_tool(environ: Mapping[str, str]) -> bool:
    """Whether ``environ``'s ``VLLM_RPC_BASE_PATH`` is a directory that
    ``use_process_ipc_directory`` made (not one the user chose)."""
    directory = environ.get(PROCESS_IPC_DIRECTORY)
    return directory is not None and environ.get(RPC_BASE_PATH) == directory
