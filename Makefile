VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export VLLM_ENABLE_V1_MULTIPROCESSING := 0

.PHONY: install demo test test-fast lint bench

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

lint: $(PY)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

bench: $(PY)
	$(PY) -m neuron_scheduler.cli bench
