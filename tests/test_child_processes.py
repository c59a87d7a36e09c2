"""Child process groups stop with the tool that started them."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers import still_alive_after
from neuron_scheduler.offline.child_processes import (
    Stopped,
    group_members,
    run_in_group,
    signals_raise,
    start_group,
    stop_group,
)


def test_a_sigterm_while_waiting_stops_the_child_and_its_children(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    # The child starts a grandchild that would outlive it, then waits.
    command = [
        sys.executable, "-c",
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n",
    ]  # fmt: skip

    def terminate_once_started() -> None:
        while not pid_file.exists() or not pid_file.read_text():
            threading.Event().wait(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=terminate_once_started, daemon=True).start()
    with signals_raise(), pytest.raises(Stopped) as stopped:
        run_in_group(command)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert str(stopped.value) == "stopped by SIGTERM"
    assert still_alive_after({int(pid_file.read_text())}) == []
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is back


def test_a_command_that_ends_gives_its_exit_code():
    assert run_in_group([sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_stopping_a_group_leaves_no_shared_memory_of_its_leader():
    # vLLM's message queues are shared memory registered with Python's
    # resource tracker, a process of the same group that unlinks them once
    # the leader has gone; killed at that moment, it left them in /dev/shm.
    leader = (
        "import signal, sys, time\n"
        "from multiprocessing import shared_memory\n"
        "segment = shared_memory.SharedMemory(create=True, size=1 << 16)\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "print(segment.name, flush=True)\n"
        "time.sleep(120)\n"
    )
    names = []
    for _ in range(3):
        process = start_group(
            [sys.executable, "-c", leader], stdout=subprocess.PIPE, text=True
        )
        names.append(process.stdout.readline().strip())
        stop_group(process, grace_s=10.0)
        process.stdout.close()
    left = [name for name in names if Path("/dev/shm", name).exists()]
    for name in left:
        Path("/dev/shm", name).unlink()
    assert all(names) and left == []


def test_a_group_member_that_ignores_sigterm_is_killed_after_the_leader_exits():
    leader = (
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print(1, flush=True); time.sleep(120)'], stdout=subprocess.PIPE)\n"
        "child.stdout.readline()\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    process = start_group(
        [sys.executable, "-c", leader], stdout=subprocess.PIPE, text=True
    )
    stubborn = int(process.stdout.readline())
    assert stubborn in group_members(process.pid)
    stop_group(process, grace_s=2.0)
    process.stdout.close()
    assert still_alive_after({stubborn}) == []
