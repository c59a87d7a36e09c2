"""The metrics snapshot transport: a private directory, no links followed,
stale snapshots of dead writers ignored and removed, one file per engine
(DP index)."""

import json
import os
import subprocess
import sys

import pytest

from neuron_scheduler import snapshots
from neuron_scheduler.offline import engine as offline_engine
from neuron_scheduler.offline.engine import EngineSettings, build_scheduler
from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.snapshots import (
    DIR_ENV,
    SnapshotDirError,
    read_snapshot,
    remove_stale,
    snapshot_dir,
    write_snapshot,
)


@pytest.fixture
def metrics_dir(tmp_path, monkeypatch):
    directory = tmp_path / "metrics"
    monkeypatch.setenv(DIR_ENV, str(directory))
    return directory


def _dead_pid():
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                             capture_output=True, text=True, check=True)  # fmt: skip
    return int(process.stdout)


def test_the_directory_is_created_private(metrics_dir):
    assert snapshot_dir() == metrics_dir
    assert metrics_dir.stat().st_mode & 0o777 == 0o700


def test_default_directory_is_per_user_under_the_temp_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(DIR_ENV, raising=False)
    monkeypatch.setattr(snapshots.tempfile, "gettempdir", lambda: str(tmp_path))
    assert snapshot_dir() == tmp_path / f"neuron-scheduler-metrics-{os.getuid()}"


def test_a_writable_directory_is_refused(metrics_dir):
    metrics_dir.mkdir(mode=0o700)
    metrics_dir.chmod(0o777)
    with pytest.raises(SnapshotDirError, match="mode 0777: group or others can write"):
        snapshot_dir()
    metrics_dir.chmod(0o720)
    with pytest.raises(SnapshotDirError, match="mode 0720"):
        snapshot_dir()


def test_a_symlinked_directory_is_refused(metrics_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    metrics_dir.symlink_to(elsewhere)
    with pytest.raises(SnapshotDirError, match="is a symbolic link"):
        snapshot_dir()


def test_a_file_in_its_place_is_refused(metrics_dir):
    metrics_dir.write_text("")
    with pytest.raises(SnapshotDirError, match="is not a directory"):
        snapshot_dir()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown")
def test_a_directory_of_another_user_is_refused(metrics_dir):
    metrics_dir.mkdir(mode=0o700)
    os.chown(metrics_dir, 65534, 65534)
    with pytest.raises(SnapshotDirError, match="owned by uid 65534, not this user"):
        snapshot_dir()


def test_writes_do_not_follow_a_planted_link(metrics_dir, tmp_path):
    directory = snapshot_dir()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path = directory / "instance-0.json"
    path.symlink_to(victim)
    write_snapshot(path, {"steps": 1})
    assert victim.read_text() == "keep"
    assert not path.is_symlink()
    assert read_snapshot(path) == {"steps": 1, "pid": os.getpid()}
    assert [p.name for p in directory.iterdir()] == ["instance-0.json"]


def test_reads_ignore_links_and_other_users_files(metrics_dir, tmp_path):
    directory = snapshot_dir()
    spoof = tmp_path / "spoof.json"
    spoof.write_text(json.dumps({"steps": 99, "pid": os.getpid()}))
    link = directory / "instance-1.json"
    link.symlink_to(spoof)
    assert read_snapshot(link) is None
    if os.getuid() == 0:
        planted = directory / "instance-2.json"
        planted.write_text(json.dumps({"steps": 99, "pid": os.getpid()}))
        os.chown(planted, 65534, 65534)
        assert read_snapshot(planted) is None


def test_stale_snapshots_are_ignored_and_removed(metrics_dir):
    directory = snapshot_dir()
    stale = directory / "old-0.json"
    stale.write_text(json.dumps({"steps": 5, "pid": _dead_pid()}))
    live = directory / "new-0.json"
    write_snapshot(live, {"steps": 6})
    assert remove_stale(directory) == 1
    assert not stale.exists() and read_snapshot(live)["steps"] == 6
    stale.write_text(json.dumps({"steps": 5, "pid": _dead_pid()}))
    assert read_snapshot(stale) is None and not stale.exists()


def test_each_dp_engine_publishes_under_its_index(metrics_dir, monkeypatch):
    stale = snapshot_dir() / "gone-0.json"
    stale.write_text(json.dumps({"pid": _dead_pid()}))
    build = offline_engine.build_vllm_config

    def second_engine(settings):
        config = build(settings)
        config.parallel_config.data_parallel_index = 1  # rank stays 0 (dense DP)
        return config

    monkeypatch.setattr(offline_engine, "build_vllm_config", second_engine)
    scheduler = build_scheduler(NeuronScheduler, EngineSettings(), log_stats=True)
    assert scheduler.vllm_config.parallel_config.data_parallel_rank == 0
    path = scheduler._snapshot_path
    assert path.parent == metrics_dir and path.name.endswith("-1.json")
    assert not stale.exists()  # cleaned at start
    scheduler._publish_metrics(0.0, force=True)
    assert read_snapshot(path)["pid"] == os.getpid()
    scheduler.shutdown()
    assert not path.exists()
