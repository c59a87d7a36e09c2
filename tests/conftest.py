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
