"""The offline engine's config-only model directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from neuron_scheduler.offline.engine import CONFIG_ONLY_MODEL

_BUILD = (
    "from neuron_scheduler.offline.engine import (\n"
    "    EngineSettings, build_scheduler, config_only_model_dir)\n"
    "from neuron_scheduler.scheduler import NeuronScheduler\n"
    "build_scheduler(NeuronScheduler, EngineSettings())\n"
    "print(config_only_model_dir())\n"
)


def _build_in_process(tmp: Path) -> str:
    """The model directory a fresh process with ``TMPDIR=tmp`` builds a
    scheduler from."""
    done = subprocess.run(
        [sys.executable, "-c", _BUILD],
        env={**os.environ, "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def test_processes_share_one_model_directory(tmp_path):
    first = _build_in_process(tmp_path)
    second = _build_in_process(tmp_path)
    assert first == second
    made = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("neuron-"))
    assert made == [Path(first).name]
    written = json.loads((Path(first) / "config.json").read_text())
    assert written == CONFIG_ONLY_MODEL


def test_a_stranger_directory_of_the_same_name_is_left_alone(tmp_path):
    shared = Path(_build_in_process(tmp_path))
    (shared / "config.json").write_text('{"model_type": "someone else\'s"}')
    ours = Path(_build_in_process(tmp_path))
    assert ours != shared and ours.parent == tmp_path
    assert json.loads((ours / "config.json").read_text()) == CONFIG_ONLY_MODEL
    assert "someone else" in (shared / "config.json").read_text()
