VENV ?= .venv
# The vLLM `make install` puts in $(VENV): 0.29.0, 0.30.0, 0.31.0, 0.32.0
# (CPU wheels) or 0.33.0 (a pure-Python build); default: the newest CPU one.
VLLM ?= 0.32.0
export VENV VLLM
PY := $(VENV)/bin/python
# pytest-xdist workers for the test targets (auto: one per CPU).
PYTEST_WORKERS ?= auto
export HF_HUB_OFFLINE := 1
export VLLM_ENABLE_V1_MULTIPROCESSING := 0

.PHONY: install demo test test-fast test-matrix matrix soak lint bench conformance

install:
	bash scripts/install.sh

$(PY):
	bash scripts/install.sh

demo: $(PY)
	$(PY) -m neuron_scheduler.cli demo

test: $(PY)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) tests

test-fast: $(PY)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not slow" tests

# The tests every supported vLLM runs (scheduler level; the CPU engine's too
# where it has a CPU wheel), on the vLLM in $(VENV).
test-matrix: $(PY)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m matrix tests

# test-matrix on every supported vLLM but the default, each in .venv-<version>.
matrix:
	bash scripts/matrix.sh

# Long randomised run of the property suite (local, not CI).
SOAK_WORKLOADS ?= 20000
soak: $(PY)
	NEURON_SCHEDULER_WORKLOADS=$(SOAK_WORKLOADS) $(PY) -m pytest -q -s tests/test_properties.py

lint: $(PY)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

bench: $(PY)
	$(PY) -m neuron_scheduler.cli bench

# vLLM's own scheduler tests (../shared/vllm-<installed>-tests) with the
# stock scheduler and with ours, compared.
conformance: $(PY)
	$(PY) -m neuron_scheduler.cli conformance
