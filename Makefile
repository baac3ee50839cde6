# `make demo` and `make test` are the whole set-up on a fresh machine.
SHELL := /bin/bash
VENV := .venv
# The first Python >= 3.12 found: python3.12 / python3.13 on PATH, else pyenv's installs.
PYTHON ?= $(shell for p in python3.12 python3.13; do \
	  $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { command -v $$p; exit; }; done; \
	  root=$$(pyenv root 2>/dev/null) && for v in $$(ls $$root/versions 2>/dev/null | grep -E '^3\.1[2-9]\.' | sort -V); do \
	  echo $$root/versions/$$v/bin/python3; exit; done)
PYTEST_ARGS ?= -n 2 -q

.PHONY: demo test test-gpu clean

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "no Python >= 3.12 found (tried python3.12, python3.13, pyenv)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip setuptools wheel
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	JAX_PLATFORMS=$${JAX_PLATFORMS:-} $(VENV)/bin/glint demo

test: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# On a GPU machine: the kernel, model and engine tests with the Pallas kernels compiled for the GPU, the kernel sweep,
# one summary line (tools/test_gpu.sh). Needs a CUDA jax in GPU_PYTHON: the venv's (pip install -e '.[cuda13]') or
# python3's.
GPU_PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
test-gpu:
	GPU_PYTHON=$(GPU_PYTHON) bash tools/test_gpu.sh

clean:
	rm -rf $(VENV)
