"""The files that carry each engine's scheduler metrics to ``/metrics``.

The scheduler (engine-core process) writes a JSON snapshot; the API-server
process reads it at scrape time (see ``stat_logger``). Both run as the same
user, so the files live in a directory only that user can write:
``$NEURON_SCHEDULER_METRICS_DIR`` or ``<tempdir>/neuron-scheduler-metrics-<uid>``,
created with mode 0700 and refused (``SnapshotDirError``, naming the path
and what is wrong) when it is a link, not a directory, owned by another user
or writable by group or others. Files are created exclusively under random
names with ``O_NOFOLLOW`` and renamed into place, and read with
``O_NOFOLLOW`` only when owned by this user: nobody else can plant, spoof or
redirect a snapshot. Each snapshot records the writer's pid; a snapshot
whose writer is gone is stale: readers ignore it and remove it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: Overrides the directory (both processes inherit it from the server's
#: environment).
DIR_ENV = "NEURON_SCHEDULER_METRICS_DIR"
#: The snapshot's field naming the process that wrote it.
PID_KEY = "pid"


class SnapshotDirError(RuntimeError):
    """The metrics directory is not one only this user can write."""


def snapshot_dir() -> Path:
    """The metrics directory, created (0700) if missing and checked."""
    configured = os.environ.get(DIR_ENV)
    directory = (
        Path(configured)
        if configured
        else Path(tempfile.gettempdir()) / f"neuron-scheduler-metrics-{os.getuid()}"
    )
    with contextlib.suppress(FileExistsError):  # not a directory: said below
        directory.mkdir(mode=0o700, parents=bool(configured), exist_ok=True)
    check_private_dir(directory)
    return directory


def snapshot_path(vllm_config: VllmConfig, engine_index: int) -> Path:
    """Where the scheduler of ``engine_index`` (its data-parallel index)
    publishes its snapshot; both processes derive it from the same
    ``vllm_config.instance_id``."""
    return snapshot_dir() / f"{vllm_config.instance_id}-{engine_index}.json"


def check_private_dir(directory: Path) -> None:
    """Raise ``SnapshotDirError`` unless ``directory`` is a real directory
    owned by this user that neither group nor others can write."""
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode):
        raise SnapshotDirError(
            f"metrics directory {directory} is a symbolic link; refusing to use it"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise SnapshotDirError(f"metrics directory {directory} is not a directory")
    if info.st_uid != os.getuid():
        raise SnapshotDirError(
            f"metrics directory {directory} is owned by uid {info.st_uid}, not "
            f"this user (uid {os.getuid()}); remove it or set {DIR_ENV}"
        )
    if info.st_mode & 0o022:
        raise SnapshotDirError(
            f"metrics directory {directory} has mode "
            f"{stat.S_IMODE(info.st_mode):04o}: group or others can write it; "
            f"chmod 700 it or set {DIR_ENV}"
        )


def write_snapshot(path: Path, snapshot: dict[str, Any]) -> None:
    """Atomically replace ``path`` with ``snapshot`` (and this pid) as JSON,
    through a new file no link can redirect."""
    temporary = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    descriptor = os.open(temporary, flags, 0o600)
    try:
        with os.fdopen(descriptor, "w") as handle:
            json.dump({**snapshot, PID_KEY: os.getpid()}, handle)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_snapshot(path: Path) -> dict[str, Any] | None:
    """The snapshot at ``path``, or ``None`` if there is none, it is not a
    regular file of this user's, or its writer is gone (then it is removed)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(descriptor) as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return None
        try:
            snapshot = json.load(handle)
        except ValueError:
            return None
    if not isinstance(snapshot, dict):
        return None
    pid = snapshot.get(PID_KEY)
    if isinstance(pid, int) and not process_alive(pid):
        path.unlink(missing_ok=True)
        return None
    return snapshot


def remove_snapshots(paths: Iterable[Path]) -> None:
    """Remove these snapshots (the engines they describe have stopped)."""
    for path in paths:
        path.unlink(missing_ok=True)


def remove_stale(directory: Path) -> int:
    """Remove the snapshots in ``directory`` whose writer is gone; return
    how many."""
    removed = 0
    for path in directory.glob("*.json"):
        if read_snapshot(path) is None and not path.exists():
            removed += 1
    return removed


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (this machine's pid namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
