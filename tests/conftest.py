import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# The CLI quiets vLLM unless the level is set: tests that call main() in
# process keep vLLM's logs as every other test sees them.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")

import pytest  # noqa: E402

from helpers import SUMMARY  # noqa: E402  (after the environment above)
from neuron_scheduler.offline.ipc_directory import (  # noqa: E402
    use_process_ipc_directory,
)

# The in-process engines of every test bind their IPC sockets in one
# directory, removed when pytest exits.
use_process_ipc_directory()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-weight tiny Llama made locally, shared by the server tests."""
    from neuron_scheduler.offline.tinymodel import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def session_cores():
    """The cores this pytest process may run on when its tests begin."""
    return frozenset(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def cores_given_back(session_cores):
    """After each test, this process runs on the cores it began with: a CPU
    engine run in process (``profile``'s) binds the calling thread to its
    worker's core (vLLM binds its OpenMP threads, this one among them),
    which would leave the tests after it on this pytest-xdist worker one
    core, and ``cpu_binding``'s view of the free cores wrong."""
    yield
    if frozenset(os.sched_getaffinity(0)) != session_cores:
        os.sched_setaffinity(0, session_cores)


@pytest.fixture(autouse=True)
def vllm_environment_read_afresh():
    """After each test, vLLM reads its environment variables afresh: an
    engine started in process caches them all (``enable_envs_cache``, in
    the vLLMs that have it), so a later test's ``monkeypatch.setenv`` on
    this pytest-xdist worker would be ignored."""
    yield
    from vllm import envs

    disable = getattr(envs, "disable_envs_cache", None)
    if disable is not None:
        disable()


class Summaries:
    """Collects the ``SUMMARY`` properties of passed and failed tests."""

    def __init__(self):
        self.texts = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            for name, value in report.user_properties:
                if name == SUMMARY:
                    self.texts.append(f"{report.nodeid}:\n{value}")

    def pytest_terminal_summary(self, terminalreporter):
        for text in self.texts:
            terminalreporter.write_line(text)


def pytest_configure(config):
    config.pluginmanager.register(Summaries(), "neuron-summaries")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Keep each module's slow tests on one pytest-xdist worker (under
    ``--dist loadgroup``: a module's servers share ports and fixtures),
    and refuse a test marked both ``matrix`` and ``timing``: the matrix
    versions run no timing part (timing tests need the machine alone,
    and the default version's ``make test`` runs them)."""
    for item in items:
        if item.get_closest_marker("timing") and item.get_closest_marker("matrix"):
            raise pytest.UsageError(
                f"{item.nodeid} is marked both timing and matrix: "
                "the version matrix runs no timing tests"
            )
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_runtest_setup(item):
    """Under ``--dist loadgroup``, fail a grouped test whose id pytest-xdist
    did not end with its group (as under pytest 9.2, pytest-xdist issue
    #1386): its module's slow tests would be spread over the workers."""
    group = item.get_closest_marker("xdist_group")
    if not (group and item.config.getoption("loadgroup", default=False)):
        return
    if not item.nodeid.endswith(f"@{group.args[0]}"):
        pytest.fail(
            f"pytest-xdist did not group {item.nodeid} (pytest "
            f"{pytest.__version__}; pytest-xdist issue #1386): run `make "
            "install` for the pytest it pins",
            pytrace=False,
        )
