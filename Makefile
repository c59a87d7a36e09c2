VENV ?= .venv
# The vLLM `make install` puts in $(VENV): 0.29.0, 0.30.0, 0.31.0, 0.32.0
# (CPU wheels) or 0.24.0, 0.33.0 (pure-Python builds). Unset, scripts/
# install.sh decides: for a VENV named .venv-<major.minor> that version,
# otherwise the newest CPU one.
VLLM ?=
export VENV VLLM
PY := $(VENV)/bin/python
# pytest-xdist workers (2: one per core of the CI machine). The tests not
# marked `timing` run in one session, spread over them test by test, but
# a module's slow tests (engines, servers, vLLM's own suite) on one worker
# (--dist loadgroup; the groups are set in tests/conftest.py): a module's
# servers share ports and fixtures. A server pins its worker to a core and
# waits on its clients, so the other worker keeps the other core busy.
# Those marked `timing` (a server's step times compared with the
# simulator's) run last, one at a time, with the machine to themselves.
PYTEST_WORKERS ?= 2
# $(call untimed_tests,PREFIX): the tests selected by "PREFIX not timing",
# in one session on PYTEST_WORKERS workers.
untimed_tests = $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup \
    -m "$(1)not timing" tests
# $(call run_tests,PREFIX): untimed_tests, then "PREFIX timing" alone;
# fails if either failed. pytest's exit code 5 (nothing selected) is a
# pass for the timing part.
define run_tests
$(call untimed_tests,$(1)); most=$$?; \
$(PY) -m pytest -q -m "$(1)timing" tests; timing=$$?; \
[ $$most -eq 0 ] && { [ $$timing -eq 0 ] || [ $$timing -eq 5 ]; }
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
# where it has a CPU wheel), on the vLLM in $(VENV): no timing part (tests/
# conftest.py refuses a test marked both), one session on PYTEST_WORKERS.
test-matrix: $(PY)
	$(call untimed_tests,matrix and )

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
