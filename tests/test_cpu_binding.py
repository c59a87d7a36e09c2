"""keep_off_worker_cores: an engine's unbound threads (and the caller) move
to the cores its bound worker threads leave free; bound threads stay.
bind_unbound / worker_cores / on_cores: the pieces, as the P/D pair uses
them (an engine's serving threads kept with its own worker)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuron_scheduler.offline.cpu_binding import (
    bind_unbound,
    keep_off_worker_cores,
    on_cores,
    process_tree,
    worker_cores,
)

CORES = sorted(os.sched_getaffinity(0))

#: A stand-in engine: a child process with a grandchild and a second thread
#: that bind nothing, whose main thread then binds itself to the first core
#: (as vLLM's worker binds its OpenMP threads).
ENGINE = """
import os, subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
os.sched_setaffinity(0, {%d})
print("ready", flush=True)
time.sleep(60)
"""


def _masks(pid):
    return {
        int(t.name): frozenset(os.sched_getaffinity(int(t.name)))
        for t in Path(f"/proc/{pid}/task").iterdir()
    }


def _start_engine(worker_core):
    """The stand-in engine, ready, its grandchild started (or 10 s gone)."""
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE % worker_core],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert engine.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while len(process_tree(engine.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    except BaseException:
        os.killpg(engine.pid, 9)
        engine.wait()
        raise
    return engine


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to keep one free")
def test_unbound_threads_and_the_caller_leave_the_bound_core():
    worker_core, rest = CORES[0], frozenset(CORES[1:])
    engine = _start_engine(worker_core)
    try:
        tree = process_tree(engine.pid)
        assert len(tree) == 2 and tree[0] == engine.pid
        caller_before = frozenset(os.sched_getaffinity(0))
        with keep_off_worker_cores(engine.pid) as free:
            assert free == rest
            assert frozenset(os.sched_getaffinity(0)) == rest
            main_masks = _masks(engine.pid)
            assert main_masks.pop(engine.pid) == {worker_core}  # bound: stays
            assert set(main_masks.values()) == {rest}  # its other thread moved
            assert set(_masks(tree[1]).values()) == {rest}  # the grandchild too
        assert frozenset(os.sched_getaffinity(0)) == caller_before
        assert set(_masks(tree[1]).values()) == {rest}  # the tree's stays
    finally:
        os.killpg(engine.pid, 9)
        engine.wait()


def test_nothing_changes_where_no_thread_is_bound():
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        before = _masks(sleeper.pid)
        with keep_off_worker_cores(sleeper.pid) as free:
            assert free == frozenset()
            assert frozenset(os.sched_getaffinity(0)) == frozenset(CORES)
        assert _masks(sleeper.pid) == before
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to tell them apart")
def test_an_engines_unbound_threads_can_join_its_worker():
    worker_core, other = CORES[0], CORES[1]
    engine = _start_engine(worker_core)
    try:
        grandchild = process_tree(engine.pid)[1]
        assert worker_cores(engine.pid) == {worker_core}
        assert set(_masks(grandchild).values()) == {frozenset(CORES)}
        bind_unbound(engine.pid, frozenset())  # nothing to bind to: no change
        assert set(_masks(grandchild).values()) == {frozenset(CORES)}
        bind_unbound(engine.pid, worker_cores(engine.pid))
        assert set(_masks(engine.pid).values()) == {frozenset({worker_core})}
        assert set(_masks(grandchild).values()) == {frozenset({worker_core})}
        # Bound threads stay: the worker's core is not moved to another's.
        bind_unbound(engine.pid, frozenset({other}))
        assert set(_masks(grandchild).values()) == {frozenset({worker_core})}
    finally:
        os.killpg(engine.pid, 9)
        engine.wait()


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to tell them apart")
def test_on_cores_holds_the_caller_while_it_lasts():
    before = frozenset(os.sched_getaffinity(0))
    with on_cores(frozenset({CORES[1]})):
        assert os.sched_getaffinity(0) == {CORES[1]}
    assert frozenset(os.sched_getaffinity(0)) == before
    with on_cores(frozenset()):
        assert frozenset(os.sched_getaffinity(0)) == before
