#!/usr/bin/env bash
# The version matrix: for every supported vLLM but the default (which
# `make test` covers in .venv), install it into .venv-<version> and run the
# tests marked `matrix` (scheduler level everywhere, the CPU engine's where
# vLLM has a CPU wheel; vLLM's own tests/v1/core of that version, stock vs
# ours). Runs every version, then fails if any failed.
#
#   MATRIX_VLLM="0.29.0 0.33.0" bash scripts/matrix.sh   # a subset
#
# The property suite checks as many random workloads per version as on the
# default one (500; fewer let a run miss an abort kind its coverage check
# requires).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

versions="${MATRIX_VLLM:-$(PYTHONPATH=src "$PYTHON" -c '
from neuron_scheduler.vllm_compat import DEFAULT_VLLM, SUPPORTED_VLLM
print(" ".join(v for v in SUPPORTED_VLLM if v != DEFAULT_VLLM))')}"

failed=()
summary=()
for version in $versions; do
    venv=".venv-${version%.*}"
    started=$SECONDS
    echo "=== vLLM $version ($venv)"
    if ! make --no-print-directory install VLLM="$version" VENV="$venv"; then
        failed+=("$version (install)")
        summary+=("vLLM $version: install failed")
        continue
    fi
    if make --no-print-directory test-matrix VENV="$venv"; then
        summary+=("vLLM $version: passed ($((SECONDS - started)) s)")
    else
        failed+=("$version")
        summary+=("vLLM $version: FAILED ($((SECONDS - started)) s)")
    fi
done

echo "=== version matrix"
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed on vLLM ${failed[*]}" >&2
    exit 1
fi
