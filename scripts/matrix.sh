#!/usr/bin/env bash
# The version matrix: for every supported vLLM but the default (which
# `make test` covers in .venv), install it into .venv-<version> and run the
# tests marked `matrix` (scheduler level everywhere, the CPU engine's where
# vLLM has a CPU wheel; vLLM's own tests/v1/core of that version, stock vs
# ours). Runs every version, then fails if any failed.
#
#   MATRIX_VLLM="0.29.0 0.33.0" bash scripts/matrix.sh   # a subset
#
# The property suite checks MATRIX_WORKLOADS random workloads per version
# (default 250, in one run beside the other tests, so that its coverage
# check holds; the default version's `make test` checks 500 in two).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export NEURON_SCHEDULER_WORKLOADS="${MATRIX_WORKLOADS:-250}"
export NEURON_SCHEDULER_SHARDS=1

versions="${MATRIX_VLLM:-$(PYTHONPATH=src "$PYTHON" -c '
from neuron_scheduler.vllm_compat import DEFAULT_VLLM, SUPPORTED_VLLM
print(" ".join(v for v in SUPPORTED_VLLM if v != DEFAULT_VLLM))')}"

# Installs first, MATRIX_INSTALL_JOBS at a time (default 2): pip keeps one
# core busy, so two installs take little more than one. Each logs to
# $venv.install.log, printed when it fails (and $venv.install.failed marks it).
install_one() {
    local version="$1" venv=".venv-${1%.*}"
    rm -f "$venv.install.failed"
    if make --no-print-directory install VLLM="$version" VENV="$venv" \
        >"$venv.install.log" 2>&1; then
        echo "installed vLLM $version in $venv"
    else
        echo "=== vLLM $version: install failed" >&2
        cat "$venv.install.log" >&2
        touch "$venv.install.failed"
    fi
}
export -f install_one
started=$SECONDS
# shellcheck disable=SC2086
printf '%s\n' $versions | xargs -P "${MATRIX_INSTALL_JOBS:-2}" -I{} \
    bash -c 'install_one "$1"' _ {}
echo "installs: $((SECONDS - started)) s"

failed=()
summary=()
for version in $versions; do
    venv=".venv-${version%.*}"
    started=$SECONDS
    echo "=== vLLM $version ($venv)"
    if [ -e "$venv.install.failed" ]; then
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
