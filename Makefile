# Two commands: `make train` (default small model on CPU) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= configs/cpu/default.yaml

.PHONY: train test data clean-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,tpu]'
	touch $(STAMP)

data: $(STAMP)
	$(PY) -m effattn_jax.data.fetch

# CPU training; libtpu (installed for ahead-of-time TPU compiles in tests) must not probe for a TPU.
train: data
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) train.py --config $(CONFIG)

test: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q --durations=15 tests

clean-venv:
	rm -rf $(VENV)
