# `make train` (default small model on CPU), `make test` (lint + every test), `make test-fast` (lint +
# the quick subset); `make format` fixes style.
# jax >= 0.11 needs Python >= 3.12: the first of python3.13, python3.12, python3 that runs and is new
# enough, else pyenv's newest that is (a pyenv shim exits non-zero for a version it does not select).
PY312 := -c 'import sys; sys.exit(sys.version_info < (3, 12))'
PYTHON ?= $(shell for p in python3.13 python3.12 python3 \
	$$(ls -d "$${PYENV_ROOT:-$$HOME/.pyenv}"/versions/3.*/bin/python3 2>/dev/null | sort -rV); do \
	"$$p" $(PY312) >/dev/null 2>&1 && { echo "$$p"; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= configs/cpu/default.yaml

.PHONY: train test test-fast lint format data clean-venv

# A .venv on an older Python (from before the move to 3.12) is built again.
$(STAMP): pyproject.toml constraints.txt
	$(if $(PYTHON),,$(error no Python >= 3.12 found (python3.13, python3.12, python3, pyenv); run make PYTHON=/path/to/python3.12))
	$(PY) $(PY312) 2>/dev/null || rm -rf $(VENV)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,tpu,lm-eval]'
	touch $(STAMP)

data: $(STAMP)
	$(PY) -m effattn_jax.data.fetch

# CPU training; libtpu (installed for ahead-of-time TPU compiles in tests) must not probe for a TPU.
train: data
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) train.py --config $(CONFIG)

# Lint and format check first (cheap), then the suite; `data` fetches the corpus and tokenizer once.
# Two pytest workers (pytest-xdist), one test file each at a time: compiles are mostly
# single-threaded, so two files in parallel use both cores. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
test: data lint
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=15 tests

# The quick loop (under 3 minutes on 2 cores): unit tests and small interpreted kernels; tests
# marked slow (training runs, subprocesses, multi-process launches, AOT compiles) are left out.
test-fast: data lint
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=10 -m "not slow" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Rewrites files: ruff's safe fixes and formatting.
format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean-venv:
	rm -rf $(VENV)
