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
from collections.abc import Iterator, Sequence
from typing import Any

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
    ``grace_s`` for the leader to exit, then SIGKILL for anything left.
    Signals to this process wait until it is done."""
    with signals_held():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
        # Children of the leader that outlived it (engine core, workers).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=grace_s)


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
