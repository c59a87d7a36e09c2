"""Child process groups stop with the tool that started them."""

import os
import signal
import sys
import threading

import pytest

from helpers import still_alive_after
from neuron_scheduler.offline.child_processes import (
    Stopped,
    run_in_group,
    signals_raise,
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
