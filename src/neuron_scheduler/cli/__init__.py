"""``neuron-scheduler`` command line: one module per command, imported
only when that command runs (``cli.options``: the options they share)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Collection, Sequence
from importlib import import_module

from neuron_scheduler import __version__
from neuron_scheduler.offline.child_processes import Stopped, signals_raise
from neuron_scheduler.offline.server import QUIETED_BY_CLI
from neuron_scheduler.vllm_compat import (
    VLLMVersionError,
    installed_vllm_version,
    supported_range,
)


def version_line() -> str:
    """This package's version, the vLLM versions it supports, and the
    installed one."""
    installed = installed_vllm_version() or "none"
    return (
        f"neuron-scheduler {__version__} for vLLM {supported_range()} "
        f"(installed vLLM: {installed})"
    )


def quiet_vllm() -> None:
    """Keep vLLM's platform notices (Triton, SSM cache, model-runner
    choice) and deprecation warnings out of this tool's output: vLLM logs
    errors only, unless the user set ``VLLM_LOGGING_LEVEL`` or passed
    ``--verbose``. Must run before vLLM is imported."""
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
        os.environ[QUIETED_BY_CLI] = "1"
    # Some notices are logged before vLLM configures its handlers.
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["--version"]:
        # Before the commands import vLLM's internals: works on any vLLM.
        print(version_line())
        return 0
    if arguments[:1] == ["--verbose"]:
        arguments = arguments[1:]
    else:
        quiet_vllm()
    try:
        with signals_raise():
            return _main(arguments)
    except VLLMVersionError as error:
        print(f"neuron-scheduler: error: {error}", file=sys.stderr)
        return 2
    except (Stopped, KeyboardInterrupt) as stop:
        # The commands' ``finally`` blocks have stopped what they started.
        code = stop.exit_code if isinstance(stop, Stopped) else 130
        name = " ".join(filter(None, ("neuron-scheduler", chosen_tool(arguments))))
        print(f"{name}: {str(stop) or 'interrupted'}", file=sys.stderr)
        return code


#: The commands: name, module (``add_arguments`` and ``run``), help line.
_TOOLS = (
    ("demo", "neuron_scheduler.cli.demo",
     "run vLLM with NeuronScheduler on a tiny local model"),
    ("bench", "neuron_scheduler.cli.bench",
     "simulate a workload through the real schedulers on a cost model"),
    ("tune", "neuron_scheduler.cli.tune",
     "print the neuron_config buckets that minimise padding for a workload"),
    ("plan", "neuron_scheduler.cli.plan",
     "the fewest replicas (or the highest rate) meeting latency SLOs"),
    ("profile", "neuron_scheduler.cli.profile",
     "measure engine step times for every shape a configuration makes"),
    ("validate", "neuron_scheduler.cli.validate",
     "compare the simulator with the real server on this machine"),
    ("conformance", "neuron_scheduler.cli.conformance",
     "run vLLM's own scheduler tests with the stock scheduler and ours"),
)  # fmt: skip


def build_parser(loaded: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The command line: every command, with the options of the tools in
    ``loaded`` (default: all). A tool's module (and so vLLM's scheduler
    and the simulator) is imported only when it is loaded."""
    parser = argparse.ArgumentParser(
        prog="neuron-scheduler",
        description="Static-shape scheduling for vLLM on Neuron-like accelerators.",
    )
    parser.add_argument(
        "--version",
        action="store_true",
        help="print the version and the vLLM it is made for, then exit",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="first argument: keep vLLM's info logs and warnings (default: "
        "vLLM logs errors only, unless VLLM_LOGGING_LEVEL is set)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module_name, description in _TOOLS:
        tool = commands.add_parser(name, help=description)
        if loaded is None or name in loaded:
            module = import_module(module_name)
            module.add_arguments(tool)
            tool.set_defaults(run=module.run)
    return parser


def chosen_tool(argv: Sequence[str]) -> str | None:
    """The tool ``argv`` runs: its first word that names one (the options
    before a command take no values), or ``None``."""
    names = {name for name, *_ in _TOOLS}
    return next((word for word in argv if word in names), None)


def _main(argv: list[str]) -> int:
    tool = chosen_tool(argv)
    parser = build_parser(() if tool is None else (tool,))
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except ValueError as error:  # bad workload / option: say what, no traceback
        parser.exit(2, f"neuron-scheduler {args.command}: error: {error}\n")


if __name__ == "__main__":
    raise SystemExit(main())
