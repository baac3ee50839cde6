# `make demo` and `make test` are the whole set-up on a fresh machine.
SHELL := /bin/bash
VENV := .venv
# The first Python >= 3.12 found: python3.12 / python3.13 on PATH, else pyenv's installs.
PYTHON ?= $(shell for p in python3.12 python3.13; do \
	  $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { command -v $$p; exit; }; done; \
	  root=$$(pyenv root 2>/dev/null) && for v in $$(ls $$root/versions 2>/dev/null | grep -E '^3\.1[2-9]\.' | sort -V); do \
	  echo $$root/versions/$$v/bin/python3; exit; done)
PYTEST_ARGS ?= -n 2 -q

.PHONY: demo test test-gpu h200-compile clean

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

# Without a GPU: compile the step programs for an H200 (XLA's deviceless compilation through the CUDA plugin, without
# CUDA's libraries, in .venv-h200 beside .venv) and count their kernels per layer (tools/h200_compile.py; more
# settings through H200_ARGS, e.g. H200_ARGS="--quantize none,int4 --widths 1,64").
H200_VENV := .venv-h200
H200_ARGS ?= --quantize none,int8,int4,fp8 --widths 1,64
$(H200_VENV)/.installed: $(VENV)/.installed
	$(VENV)/bin/python -m venv $(H200_VENV)
	$(H200_VENV)/bin/pip install -q --no-deps jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2
	echo "import site; site.addsitedir('$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
	  > $$($(H200_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/glint_venv.pth
	touch $@

h200-compile: $(H200_VENV)/.installed  # XLA's log level 3: not the plugin's "failed call to cuInit" (no GPU here)
	JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=3 $(H200_VENV)/bin/python tools/h200_compile.py $(H200_ARGS)

clean:
	rm -rf $(VENV) $(H200_VENV)
