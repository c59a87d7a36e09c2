"""keep_off_worker_cores: an engine's unbound threads (and the caller) move
to the cores its bound worker threads leave free; bound threads stay."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuron_scheduler.offline.cpu_binding import keep_off_worker_cores, process_tree

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


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to keep one free")
def test_unbound_threads_and_the_caller_leave_the_bound_core():
    worker_core, rest = CORES[0], frozenset(CORES[1:])
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
