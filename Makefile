# The two commands of a fresh machine:
#   make demo   creates .venv, installs gpurouter, routes every model preset
#   make test   creates .venv, installs gpurouter[test,sim], runs the tests
#               (kernels on the CUDA simulator when no GPU is present)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A machine with an NVIDIA driver gets the CUDA 13 kernels; others the jnp backend.
GPU_EXTRAS := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda13,bench)
DEMO_EXTRAS ?= $(if $(GPU_EXTRAS),[$(GPU_EXTRAS)],)
TEST_EXTRAS ?= [test,$(if $(GPU_EXTRAS),cuda13,sim)]
PYTEST_ARGS ?=
# The tests, and the docstring examples of the reference and of config.py (doctests: they cannot drift from the code).
TEST_PATHS ?= tests --doctest-modules gpurouter/reference gpurouter/config.py
# Tests marked slow (the conformance battery's mutant list, its full dogfood runs) are
# left out here; `make test-slow` runs them (minutes each on a CPU).
TEST_MARKERS ?= not slow
# pytest-xdist workers: one per core up to 4 on the simulator (its tests are
# single-threaded Python; 2 workers halve CI's 2-core run), none with a GPU
# (the GPU suite has its own groups: make test-gpu). 0 runs in one process.
PYTEST_WORKERS ?= $(if $(GPU_EXTRAS),0,$(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n))

.PHONY: demo test test-slow test-gpu lint clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	touch $@

$(VENV)/.demo: $(VENV)/.created pyproject.toml
	$(PY) -m pip install -q -e ".$(DEMO_EXTRAS)"
	touch $@

$(VENV)/.test: $(VENV)/.created pyproject.toml
	$(PY) -m pip install -q -e ".$(TEST_EXTRAS)"
	touch $@

demo: $(VENV)/.demo
	$(PY) -m gpurouter

# Kernel tests run on the CUDA simulator here unless a GPU is present.
# --dist worksteal: an idle worker takes queued tests from a busy one (the
# suite's long simulator tests otherwise leave one of CI's two workers idle
# at the end of the run).
test: $(VENV)/.test
	NUMBA_ENABLE_CUDASIM=$${NUMBA_ENABLE_CUDASIM-$(if $(GPU_EXTRAS),0,1)} $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -m "$(TEST_MARKERS)" $(PYTEST_ARGS) $(TEST_PATHS)

# Only the slow tests (the mutant list of gpurouter.testing, the full dogfood runs).
test-slow: $(VENV)/.test
	$(MAKE) test TEST_MARKERS=slow

# The whole suite on a GPU, in parallel groups (tools/ci/gpu_suite.sh; logs in gpu-logs/).
test-gpu: $(VENV)/.test
	PYTHON=$(PY) bash tools/ci/gpu_suite.sh

lint: $(VENV)/.test
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m ruff check gpurouter tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
