VENV ?= .venv
# The vLLM `make install` puts in $(VENV): 0.29.0, 0.30.0, 0.31.0, 0.32.0
# (CPU wheels) or 0.33.0 (a pure-Python build); default: the newest CPU one.
VLLM ?= 0.32.0
export VENV VLLM
PY := $(VENV)/bin/python
# pytest-xdist workers for the tests not marked slow (auto: one per CPU).
# The slow ones (engines, servers, vLLM's own suite, which runs two pytest
# processes itself) run one at a time after them: a server's timings and
# its stream's pacing are part of what they check.
PYTEST_WORKERS ?= auto
# $(call run_tests,PREFIX): the tests selected by "PREFIX not slow" on every
# core, then those of "PREFIX slow" alone; fails if either part failed.
define run_tests
$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "$(1)not slow" tests; fast=$$?; \
$(PY) -m pytest -q -m "$(1)slow" tests; slow=$$?; \
[ $$fast -eq 0 ] && [ $$slow -eq 0 ]
endef
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
	$(call run_tests,)

test-fast: $(PY)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not slow" tests

# The tests every supported vLLM runs (scheduler level; the CPU engine's too
# where it has a CPU wheel), on the vLLM in $(VENV).
test-matrix: $(PY)
	$(call run_tests,matrix and )

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
