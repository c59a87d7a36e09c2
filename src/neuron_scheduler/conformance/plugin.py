"""pytest plugin: run vLLM's own scheduler tests with NeuronScheduler.

Load it with ``-p neuron_scheduler.conformance.plugin`` next to vLLM's
unedited ``tests/v1/core``. Options:

* ``--neuron-scheduler=stock|neuron``: with ``neuron``, every place the suite
  builds a scheduler builds ours instead: each test module's (and helper
  module's) global ``Scheduler`` becomes ``NeuronScheduler`` and
  ``AsyncScheduler`` becomes ``NeuronAsyncScheduler`` (``create_scheduler``
  looks them up at call time, as do tests that call ``Scheduler(...)``).
  Subclasses a test defines itself keep their own base.
* ``--neuron-conformance-report=FILE``: write ``{nodeid: outcome}`` as JSON
  (outcome ``passed``, ``failed``, ``error``, ``skipped``, or, for a test
  that passed although our scheduler preempted a request, ``preempted``:
  that breaks our promise, whatever the test asserts).

Tests listed in ``exclusions.PACKED`` for the installed vLLM get ours with
packing.

It also provides the ``caplog_vllm`` fixture of vLLM's root ``conftest.py``
(not part of the shared copy): ``caplog`` that sees vLLM's loggers.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from neuron_scheduler import NeuronAsyncScheduler, NeuronScheduler
from neuron_scheduler.conformance.exclusions import packed_by, packed_for, packing
from neuron_scheduler.vllm_compat import check_vllm_version

MODES = ("stock", "neuron")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("neuron-scheduler conformance")
    group.addoption(
        "--neuron-scheduler",
        choices=MODES,
        default="stock",
        help="which scheduler the suite builds (default: stock)",
    )
    group.addoption(
        "--neuron-conformance-report",
        default=None,
        help="write each test's outcome to this JSON file",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_test: vLLM's marker for CPU-only tests")
    config.pluginmanager.register(ConformanceRecorder(config), "neuron-conformance")


class _Packing:
    """Starts with ``exclusions.packing``'s ``neuron_config``, whatever the
    test's ``additional_config`` says."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        extra = dict(vllm_config.additional_config or {})
        extra["neuron_config"] = packing(vllm_config)
        vllm_config.additional_config = extra
        super().__init__(*args, **kwargs)


class PackedNeuronScheduler(_Packing, NeuronScheduler):
    """``NeuronScheduler`` with packing (for the tests in ``PACKED``)."""


class PackedNeuronAsyncScheduler(_Packing, NeuronAsyncScheduler):
    """``NeuronAsyncScheduler`` with packing (for the tests in ``PACKED``)."""


def swap_schedulers(
    test_root: Path,
    places: dict[tuple[str, str], bool],
    classes: tuple[type, type],
    under_root: dict[str, bool],
) -> None:
    """Point the vLLM scheduler names of every loaded module under
    ``test_root`` at ``classes`` (sync, async). ``places`` remembers each
    ``(module, name)`` swapped before, with whether it was the async one, so
    a later test can point it elsewhere. ``under_root`` (module name ->
    whether its file is under ``test_root``) carries what earlier calls
    found: a loaded module's file does not move, and resolving every path
    of every module for each test cost more than the suite itself."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    for module_name, module in list(sys.modules.items()):
        inside = under_root.get(module_name)
        if inside is None:
            path = getattr(module, "__file__", None)
            inside = path is not None and test_root in Path(path).resolve().parents
            under_root[module_name] = inside
        if not inside:
            continue
        for name, value in list(vars(module).items()):
            if value is Scheduler or value is AsyncScheduler:
                places[(module_name, name)] = value is AsyncScheduler
    for (module_name, name), is_async in places.items():
        setattr(sys.modules[module_name], name, classes[is_async])


class ConformanceRecorder:
    """Swaps schedulers in (``neuron`` mode) and records every outcome."""

    def __init__(self, config: pytest.Config) -> None:
        self.mode: str = config.getoption("--neuron-scheduler")
        self.report_path: str | None = config.getoption("--neuron-conformance-report")
        self.test_root = Path(str(config.rootpath)).resolve()
        #: nodeid -> passed / failed / error / skipped
        self.outcomes: dict[str, str] = {}
        #: (module, name) of each scheduler name swapped -> is the async one
        self.places: dict[tuple[str, str], bool] = {}
        #: module name -> whether its file is under the suite's root
        self.under_root: dict[str, bool] = {}
        #: Tests in which one of our schedulers preempted a request.
        self.preempted: set[str] = set()
        #: The installed vLLM's ``PACKED`` table.
        self.packed = packed_for(check_vllm_version())
        self._current: str | None = None
        if self.mode == "neuron":
            self._watch_preemptions()

    def _watch_preemptions(self) -> None:
        """Note the test under way whenever our scheduler preempts."""
        recorder = self
        preempt = NeuronScheduler._preempt_request

        def recording(self: Any, *args: Any, **kwargs: Any) -> None:
            if recorder._current is not None:
                recorder.preempted.add(recorder._current)
            preempt(self, *args, **kwargs)

        NeuronScheduler._preempt_request = recording  # type: ignore[method-assign]

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        # Per test, not once: a test may import a helper module lazily, and
        # a test listed in ``PACKED`` builds ours with packing.
        self._current = item.nodeid
        if self.mode == "neuron":
            classes: tuple[type, type] = (NeuronScheduler, NeuronAsyncScheduler)
            if packed_by(item.nodeid, self.packed) is not None:
                classes = (PackedNeuronScheduler, PackedNeuronAsyncScheduler)
            swap_schedulers(self.test_root, self.places, classes, self.under_root)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and report.passed:
            return
        if report.failed:
            outcome = "failed" if report.when == "call" else "error"
        elif report.passed and report.nodeid in self.preempted:
            outcome = "preempted"
        else:
            outcome = report.outcome
        # A teardown error after a pass still counts against the test.
        if self.outcomes.get(report.nodeid) in (None, "passed"):
            self.outcomes[report.nodeid] = outcome

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.outcomes[report.nodeid] = "error"

    def pytest_sessionfinish(self) -> None:
        if self.report_path:
            Path(self.report_path).write_text(
                json.dumps(
                    {"mode": self.mode, "outcomes": self.outcomes},
                    indent=1,
                    sort_keys=True,
                )
            )


@pytest.fixture
def caplog_vllm(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` that also sees vLLM's loggers (they do not propagate)."""
    logger = logging.getLogger("vllm")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
