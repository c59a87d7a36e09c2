"""Child processes that never outlive the tool that started them.

Each child runs in its own process group (``start_new_session``), so a
Ctrl-C in a terminal reaches only the tool, which then stops the group,
grandchildren included (vLLM's engine core, its workers). What makes that
hold when the tool itself is stopped from outside:

- ``signals_raise()`` (the CLI wraps every command in it) turns SIGTERM and
  SIGHUP into ``Stopped``, an exception, so ``finally`` blocks run as they
  do for SIGINT's ``KeyboardInterrupt``;
- ``stop_group`` runs with those signals held back, so a second signal
  cannot cut a cleanup short;
- ``run_in_group`` waits for a command and stops its group on any
  exception, ``Stopped`` and ``KeyboardInterrupt`` included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

#: Seconds the rest of a group gets to exit on its own once its leader has.
FOLLOWERS_GRACE_S = 5.0

#: The signals ``signals_raise`` turns into ``Stopped`` (SIGINT already
#: raises ``KeyboardInterrupt``).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """The tool was sent ``signum``; not an ``Exception``, so no ``except
    Exception`` swallows it on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell's convention for a death by signal: 128 + its number."""
        return 128 + self.signum


def _raise_stopped(signum: int, _frame: object) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise ``Stopped`` in the main thread.
    The previous handlers come back on exit."""
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Within: SIGINT, SIGTERM and SIGHUP wait; they are delivered on exit."""
    held = {signal.SIGINT, *STOP_SIGNALS}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_group(process: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """Stop ``process``'s whole group (idempotent): SIGTERM, up to
    ``grace_s`` for the leader to exit and ``FOLLOWERS_GRACE_S`` more (within
    ``grace_s``) for the rest of the group to follow it, then SIGKILL for
    anything left. The rest is waited for
    because what outlives the leader may be cleaning up after it: Python's
    resource tracker unlinks the leader's shared memory (vLLM's message
    queues, ``/dev/shm/psm_*``) only once the leader is gone, and a SIGKILL
    then leaves those segments behind until the machine restarts. Signals
    to this process wait until it is done."""
    with signals_held():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
        followers = min(deadline, time.monotonic() + FOLLOWERS_GRACE_S)
        _wait_group_gone(process.pid, followers)
        # Children of the leader that outlived it (engine core, workers).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=grace_s)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of group ``pgid``, read from
    ``/proc`` (none where there is no ``/proc``)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # pid (comm) state ppid pgrp ...: comm may hold spaces or ")".
            fields = entry.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry.parent.name))
    return members


def _wait_group_gone(pgid: int, deadline: float) -> None:
    """Until no live process is left in group ``pgid`` or ``deadline``
    (``time.monotonic()``) passes."""
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def start_group(command: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """``command`` started as the leader of a new process group; the
    keyword arguments go to ``subprocess.Popen``."""
    return subprocess.Popen(command, start_new_session=True, **popen)


def run_in_group(command: Sequence[str], **popen: Any) -> int:
    """Run ``command`` in its own group to the end: its exit code. On any
    exception while it runs (a signal to this process included) the group
    is stopped before the exception goes on."""
    process = start_group(command, **popen)
    try:
        return process.wait()
    except BaseException:
        stop_group(process, grace_s=10.0)
        raise
