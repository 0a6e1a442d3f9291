# `make test` and `make perf` do all set-up: where torch + cutlass + tvm_ffi already import
# (the GPU machine), nothing is installed; elsewhere a local .venv gets the pinned CPU stack.
SHELL := /bin/bash
HAVE_STACK := $(shell python3 -c "import torch, cutlass, tvm_ffi, pytest" >/dev/null 2>&1 && echo yes)
ifeq ($(HAVE_STACK),yes)
PY := python3
ENV_DEP :=
else
PY := .venv/bin/python
ENV_DEP := .venv/.installed
endif

PYTEST_ARGS ?=
# pytest processes at once (tests/parallel.sh deals the tests over them); 1: one pytest run
TEST_JOBS ?= 1
PERF_ARGS ?=

.PHONY: test perf sanitize compile lint clean

# The package itself goes in editable, so `python -m cute_kernels ...` works from any directory.
.venv/.installed: requirements-test.txt pyproject.toml
	python3 -m venv .venv
	.venv/bin/python -m pip install --quiet --upgrade pip
	.venv/bin/python -m pip install --quiet -r requirements-test.txt
	.venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

test: $(ENV_DEP)
	bash tests/parallel.sh $(PY) $(TEST_JOBS) $(PYTEST_ARGS)

perf: $(ENV_DEP)
	$(PY) -m perf.run $(PERF_ARGS)

# GPU: compute-sanitizer memcheck, then racecheck, over small calls of every kernel variant;
# fails on any reported error (`--report-api-errors no`: the CUDA Python bindings probe the
# driver with calls that fail by design). Without a GPU, perf.sanitize says so.
SANITIZER ?= compute-sanitizer
SANITIZE_FLAGS := --report-api-errors no --error-exitcode 1
sanitize: $(ENV_DEP)
	@if $(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
	  $(SANITIZER) --tool memcheck $(SANITIZE_FLAGS) $(PY) -m perf.sanitize && \
	  $(SANITIZER) --tool racecheck $(SANITIZE_FLAGS) $(PY) -m perf.sanitize; \
	else $(PY) -m perf.sanitize; fi

compile: $(ENV_DEP)
	$(PY) -m cute_kernels compile --arch sm_90a && $(PY) -m cute_kernels compile --arch sm_100a

lint: $(ENV_DEP)
	$(PY) -m ruff check cute_kernels tests perf

clean:
	rm -rf .venv perf/results .pytest_cache
