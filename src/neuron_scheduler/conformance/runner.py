"""Run vLLM's scheduler tests with the stock scheduler and with ours, compare.

``run_conformance`` runs the unedited suite twice, side by side (one pytest
process per scheduler, with the plugin in ``plugin.py`` and the local model
configs of ``models.py``), and classifies every test:

* stock passes, ours passes: **passed**;
* stock passes, ours fails, listed in the installed vLLM's
  ``exclusions.exclusions_for``: **excluded** (the test asserts what the
  static-shape design forbids);
* stock passes, ours fails, not listed: **failed** (a defect, or an exclusion
  nobody justified);
* stock fails here (no weights, no torchvision, ...): **not comparable**.

An exclusion that matches no test, or a listed test that passes with ours,
is **stale**: the list must stay exactly as long as the design requires.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from neuron_scheduler.conformance.exclusions import (
    exclusions_for,
    not_importable_for,
    packed_for,
)
from neuron_scheduler.conformance.models import write_hub_cache
from neuron_scheduler.offline.child_processes import start_group, stop_group
from neuron_scheduler.vllm_compat import base_version, check_vllm_version

#: The suite: vLLM's scheduler, KV cache manager and prefix-cache tests.
SUITE = "tests/v1/core"


#: Where ``scripts/install.sh`` keeps the scheduler tests of a vLLM it built
#: from its source distribution, inside that environment.
SOURCE_TESTS = "vllm-tests"


def default_tests_dir(version: str | None = None) -> Path:
    """The installed vLLM's own scheduler tests: the copy from the source
    distribution it was built from, where the installer kept one
    (``sys.prefix/vllm-tests``), else the shared, unedited copy of vLLM
    ``version``'s tests (default: the installed one's), relative to the
    project root."""
    if version is None:
        kept = Path(sys.prefix) / SOURCE_TESTS
        if (kept / SUITE).is_dir():
            return kept
    version = base_version(version or check_vllm_version())
    return Path("..") / "shared" / f"vllm-{version}-tests"


PASSED, EXCLUDED, FAILED, NOT_COMPARABLE = (
    "passed",
    "excluded",
    "failed",
    "not comparable",
)


@dataclass
class ConformanceReport:
    """Outcomes per test id for both schedulers and what they add up to."""

    stock: Mapping[str, str]
    ours: Mapping[str, str]
    exclusions: Mapping[str, str]
    #: the ``PACKED`` table the run used (its patterns must match tests)
    packed: Mapping[str, str] = field(default_factory=dict)
    #: test modules known not to import here (``NOT_IMPORTABLE``)
    not_importable: Mapping[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    vllm_version: str = ""
    #: test id -> PASSED / EXCLUDED / FAILED / NOT_COMPARABLE
    verdicts: dict[str, str] = field(init=False)
    #: exclusion patterns that match no test, or only tests ours passes,
    #: and ``PACKED`` patterns that match no test
    stale_exclusions: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.verdicts = {}
        used: Counter[str] = Counter()
        for test_id in sorted(set(self.stock) | set(self.ours)):
            pattern = excluded_by(test_id, self.exclusions)
            if self.stock.get(test_id) != "passed":
                self.verdicts[test_id] = NOT_COMPARABLE
            elif self.ours.get(test_id) == "passed":
                self.verdicts[test_id] = PASSED
            elif pattern is not None:
                self.verdicts[test_id] = EXCLUDED
                used[pattern] += 1
            else:
                self.verdicts[test_id] = FAILED
        self.stale_exclusions = [p for p in self.exclusions if not used[p]]
        tests = list(self.verdicts)
        self.stale_exclusions += [
            p for p in self.packed if not any(fnmatch.fnmatchcase(t, p) for t in tests)
        ]
        unimported = set(self._unimported())
        self.stale_exclusions += [m for m in self.not_importable if m not in unimported]

    def uncollected(self) -> list[str]:
        """Test modules the stock run could not import and that are not
        known not to import here: a copy of the suite that does not match
        the installed vLLM (or a helper it lacks)."""
        return [m for m in self._unimported() if m not in self.not_importable]

    def _unimported(self) -> list[str]:
        stock = self.stock
        return sorted(t for t, o in stock.items() if "::" not in t and o == "error")

    def count(self, verdict: str) -> int:
        return sum(1 for v in self.verdicts.values() if v == verdict)

    def failures(self) -> list[str]:
        return [t for t, v in self.verdicts.items() if v == FAILED]

    @property
    def ok(self) -> bool:
        return not (self.failures() or self.stale_exclusions or self.uncollected())

    def format(self) -> str:
        stock_counts = Counter(self.stock.values())
        ours_counts = Counter(self.ours.values())
        lines = [
            f"vLLM {self.vllm_version} {SUITE}: {len(self.verdicts)} tests, "
            f"{self.seconds:.0f} s",
            f"{'':28}{'stock':>8}{'ours':>8}",
        ]
        for outcome in ("passed", "failed", "error", "skipped", "preempted"):
            lines.append(
                f"  {outcome:<26}{stock_counts[outcome]:>8}{ours_counts[outcome]:>8}"
            )
        lines += [
            "Of the tests stock passes:",
            f"  passed with ours          {self.count(PASSED):>8}",
            f"  excluded (design rule)    {self.count(EXCLUDED):>8}",
            f"  failed, unexplained       {self.count(FAILED):>8}",
            f"Not comparable (stock fails here): {self.count(NOT_COMPARABLE)}",
        ]
        for test_id in self.failures():
            outcome = self.ours.get(test_id, "not run")
            lines.append(f"FAILED {test_id} (stock passes, ours: {outcome})")
        for module in self.uncollected():
            lines.append(f"UNCOLLECTED {module} (stock cannot import it here)")
        for pattern in self.stale_exclusions:
            lines.append(f"STALE exclusion {pattern!r}: no test of ours fails there")
        return "\n".join(lines)


def excluded_by(test_id: str, exclusions: Mapping[str, str]) -> str | None:
    """The exclusion pattern covering ``test_id`` (fnmatch), if any."""
    for pattern in exclusions:
        if fnmatch.fnmatchcase(test_id, pattern):
            return pattern
    return None


def _pytest_command(tests_dir: Path, mode: str, report: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "neuron_scheduler.conformance.plugin",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        "-W",
        "ignore",
        "--tb=no",
        "--no-header",
        f"--rootdir={tests_dir}",
        f"--neuron-scheduler={mode}",
        f"--neuron-conformance-report={report}",
        str(tests_dir / SUITE),
    ]


def run_conformance(
    tests_dir: Path, exclusions: Mapping[str, str] | None = None
) -> ConformanceReport:
    """Run the suite with both schedulers (concurrently) and compare, with
    the installed vLLM's exclusions unless ``exclusions`` are given.

    Raises ``FileNotFoundError`` when ``tests_dir`` has no ``tests/v1/core``,
    ``RuntimeError`` when a run produced no report (its output is included).
    """
    version = base_version(check_vllm_version())
    if exclusions is None:
        exclusions = exclusions_for(version)
    tests_dir = tests_dir.resolve()
    if not (tests_dir / SUITE).is_dir():
        raise FileNotFoundError(f"no vLLM test suite at {tests_dir / SUITE}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="neuron-conformance-") as tmp:
        work = Path(tmp)
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            HF_HUB_CACHE=str(write_hub_cache(work / "hub")),
            # The suite imports ``tests.v1...`` from its own root; its files
            # are read-only, so no bytecode is written next to them.
            PYTHONPATH=os.pathsep.join(
                p for p in (str(tests_dir), env.get("PYTHONPATH", "")) if p
            ),
            PYTHONDONTWRITEBYTECODE="1",
        )
        if _no_device_platform():
            # A vLLM built without a device (0.24, 0.33 here) cannot infer
            # one; the suite's schedulers need only the CPU's.
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        runs = {}
        for mode in ("stock", "neuron"):
            report = work / f"{mode}.json"
            log = (work / f"{mode}.log").open("w")
            # Own working directory: some tests write relative paths.
            cwd = work / mode
            cwd.mkdir()
            process = start_group(
                _pytest_command(tests_dir, mode, report),
                cwd=cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            runs[mode] = (process, report, log)
        try:
            for process, _, _ in runs.values():
                process.wait()
        except BaseException:  # a signal: neither run outlives this one
            for process, _, _ in runs.values():
                stop_group(process, grace_s=10.0)
            raise
        outcomes = {}
        for mode, (_, report, log) in runs.items():
            log.close()
            if not report.exists():
                tail = (work / f"{mode}.log").read_text()[-3000:]
                raise RuntimeError(f"the {mode} run wrote no report:\n{tail}")
            outcomes[mode] = json.loads(report.read_text())["outcomes"]
    return ConformanceReport(
        stock=outcomes["stock"],
        ours=outcomes["neuron"],
        exclusions=exclusions,
        packed=packed_for(version),
        not_importable=not_importable_for(version),
        seconds=time.monotonic() - started,
        vllm_version=version,
    )


def _no_device_platform() -> bool:
    """Whether the installed vLLM finds no device platform on this machine."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_unspecified())


def run_command(tests_dir: str | None, json_path: str | None) -> int:
    """``neuron-scheduler conformance``: print the report, write ``--json``,
    exit 0 only with no unexplained failure and no stale exclusion (2: it
    cannot run, e.g. without pytest, which the package does not require)."""
    try:
        import pytest  # noqa: F401 - vLLM's suite runs under it
    except ImportError:
        print(
            "neuron-scheduler conformance: error: vLLM's scheduler tests run "
            "under pytest, which is not installed (pip install "
            "'neuron-scheduler[dev]')",
            file=sys.stderr,
        )
        return 2
    try:
        report = run_conformance(Path(tests_dir) if tests_dir else default_tests_dir())
    except (FileNotFoundError, RuntimeError) as error:
        print(f"neuron-scheduler conformance: error: {error}", file=sys.stderr)
        return 2
    print(report.format())
    if json_path:
        Path(json_path).write_text(
            json.dumps(
                {
                    "vllm": report.vllm_version,
                    "seconds": round(report.seconds, 1),
                    "stock": report.stock,
                    "ours": report.ours,
                    "verdicts": report.verdicts,
                    "stale_exclusions": report.stale_exclusions,
                },
                indent=1,
                sort_keys=True,
            )
        )
    return 0 if report.ok else 1
