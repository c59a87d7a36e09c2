"""vLLM's IPC sockets go in a directory of the tool's own, removed when it
is done: a server's when it stops (test_kv_load_timeout), in-process
engines' (``profile``, the demo) when the process exits."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from neuron_scheduler.offline.ipc_directory import (
    MAX_SOCKET_PATH_CHARS,
    PROCESS_IPC_DIRECTORY,
    RPC_BASE_PATH,
    new_ipc_directory,
    use_process_ipc_directory,
)
from neuron_scheduler.offline.server import server_environment

#: Starts ``profile``'s engine, which is refused after timing one step, and
#: prints where the engine's sockets went and what was there before exit.
PROFILE_AND_LIST = """
import json, os, stat, sys
from neuron_scheduler.cli import main
try:
    main(["profile", "--max-seconds", "0.001", "--output", sys.argv[1],
          "--no-progress"])
except SystemExit as stop:
    code = stop.code
directory = os.environ["VLLM_RPC_BASE_PATH"]
sockets = [n for n in os.listdir(directory)
           if stat.S_ISSOCK(os.stat(os.path.join(directory, n)).st_mode)]
print(json.dumps({"code": code, "directory": directory, "sockets": sockets}))
"""


def _sockets_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_socket()]


@pytest.mark.slow
def test_an_in_process_engine_leaves_no_socket_behind(tmp_path):
    # A socket's path has room for 107 characters: pytest's tmp_path is
    # too deep for a temp directory.
    temp = Path(tempfile.mkdtemp(prefix="ipc-test-"))
    try:
        _profile_and_check(temp, tmp_path / "profile.json")
    finally:
        shutil.rmtree(temp)


def _profile_and_check(temp: Path, output: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (RPC_BASE_PATH, PROCESS_IPC_DIRECTORY)
    }
    env["TMPDIR"] = str(temp)
    done = subprocess.run(
        [sys.executable, "-c", PROFILE_AND_LIST, str(output)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["code"] == 2  # refused: it would take too long
    directory = Path(seen["directory"])
    # The engine (mp executor) bound its sockets in the tool's directory,
    # under the temp directory, which holds none now, nor the directory.
    assert directory.parent == temp
    assert seen["sockets"]
    assert not directory.exists()
    assert _sockets_under(temp) == []


def test_a_server_started_from_the_tool_gets_its_own_directory(monkeypatch):
    directory = use_process_ipc_directory()  # conftest made it for pytest
    assert os.environ[RPC_BASE_PATH] == directory
    assert use_process_ipc_directory() == directory  # once a process
    inherited = server_environment()
    assert RPC_BASE_PATH not in inherited
    assert PROCESS_IPC_DIRECTORY not in inherited
    # One the user chose is theirs: every process started gets it.
    monkeypatch.setenv(RPC_BASE_PATH, "/srv/vllm-ipc")
    assert server_environment()[RPC_BASE_PATH] == "/srv/vllm-ipc"
    assert use_process_ipc_directory() == "/srv/vllm-ipc"


def test_no_directory_where_a_socket_path_would_be_too_long(monkeypatch):
    short = Path(tempfile.mkdtemp(prefix="ipc-"))
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(short))
        made = new_ipc_directory()
        assert made is not None and made.parent == short
        deep = short / ("d" * (MAX_SOCKET_PATH_CHARS - len(str(short))))
        deep.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(deep))
        # vLLM then binds in the temp directory itself, as by default.
        assert new_ipc_directory() is None
        assert list(deep.iterdir()) == []
    finally:
        shutil.rmtree(short)
