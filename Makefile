VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export VLLM_ENABLE_V1_MULTIPROCESSING := 0

.PHONY: install demo test test-fast soak lint bench conformance

install:
	bash scripts/install.sh

$(PY):
	bash scripts/install.sh

demo: $(PY)
	$(PY) -m neuron_scheduler.cli demo

test: $(PY)
	$(PY) -m pytest -q tests

test-fast: $(PY)
	$(PY) -m pytest -q -m "not slow" tests

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

# vLLM's own scheduler tests (../shared/vllm-0.32.0-tests) with the stock
# scheduler and with ours, compared.
conformance: $(PY)
	$(PY) -m neuron_scheduler.cli conformance
