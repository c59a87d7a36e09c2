"""Keep a CPU engine's model worker on cores of its own.

vLLM's CPU worker binds its OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_
BIND``, ``auto`` by default) and leaves the rest "reserved" for the engine
core and the API server, but nothing holds those to the reserved cores: the
kernel moves the API server, the engine core and the benchmark client onto
the worker's core whenever theirs is busy, and the forward pass, which is
what stands in for the accelerator here, slows by however much the serving
path happens to be doing at that moment. On a Neuron host that cannot
happen: the forward runs on the device. ``keep_off_worker_cores`` binds
every thread of an engine's processes whose affinity is still every
allowed core to the cores the worker's bound threads leave free, and the
calling thread (the benchmark client, or the profiler's engine core) with
them while it lasts. Where no core is free (two engines on two cores, the
P/D pair), ``bind_unbound`` keeps an engine's serving threads with its own
worker (``worker_cores``), so what it costs slows that engine alone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def process_tree(root: int) -> list[int]:
    """``root`` and every living process under it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Fields after the command's closing parenthesis: state, ppid.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [root], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _thread_masks(root: int) -> dict[int, frozenset[int]]:
    """Each thread of ``root``'s process tree and the cores it may run on."""
    masks = {}
    for pid in process_tree(root):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    masks[int(task.name)] = frozenset(
                        os.sched_getaffinity(int(task.name))
                    )
    return masks


def worker_cores(root: int) -> frozenset[int]:
    """The cores the bound threads of ``root``'s process tree (its model
    worker's) use; empty where none is bound."""
    allowed = frozenset(os.sched_getaffinity(0))
    masks = _thread_masks(root).values()
    return frozenset[int]().union(*(m for m in masks if m < allowed))


def bind_unbound(root: int, cores: frozenset[int]) -> None:
    """Every thread of ``root``'s process tree whose affinity is still every
    allowed core runs on ``cores`` from now on (threads they start later
    inherit it); bound threads stay where they are. Nothing changes when
    ``cores`` is empty."""
    if not cores:
        return
    allowed = frozenset(os.sched_getaffinity(0))
    for tid, mask in _thread_masks(root).items():
        if mask >= allowed:
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, cores)


@contextlib.contextmanager
def on_cores(cores: frozenset[int]) -> Iterator[None]:
    """Within: the calling thread runs on ``cores`` (nothing changes when
    empty); its affinity comes back on exit."""
    before = frozenset(os.sched_getaffinity(0))
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def keep_off_worker_cores(root: int) -> Iterator[frozenset[int]]:
    """Within: the unbound threads of ``root``'s process tree, and the
    calling thread, run on the cores its bound threads (the model
    worker's) do not use; yields those cores (empty, and nothing changed,
    when no thread is bound or the bound ones use every core). The calling
    thread's affinity comes back on exit; the tree's stays."""
    bound = worker_cores(root)
    free = frozenset(os.sched_getaffinity(0)) - bound
    if not bound or not free:
        yield frozenset()
        return
    bind_unbound(root, free)
    with on_cores(free):
        yield free
