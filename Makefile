# `make demo` and `make test` set everything up on a fresh machine (idempotently) and run.
# `make demo` installs the package only (no torch, no transformers: those are the `test` extra);
# `make test` (and `make setup`) add the `test` extra, torch pinned first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.installed-demo-stamp
TEST_STAMP := $(VENV)/.installed-test-stamp
TPU_COMPILER := $(VENV)/tpu-compiler

GPU_COMPILER := $(VENV)/gpu-compiler
INSTALL_GPU_COMPILER = $(PY) -m pip install -q --no-deps --upgrade --target $(GPU_COMPILER) "jax-cuda12-plugin==$$($(PY) -c 'import jax; print(jax.__version__)')" "jax-cuda12-pjrt==$$($(PY) -c 'import jax; print(jax.__version__)')"

.PHONY: setup test demo clean gpu-compiler offline-wheels

$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(DEMO_STAMP)

# the TPU compiler (libtpu, the version the installed jax asks for) goes to its own folder, not
# into the venv: the TPU compile tests put it on their subprocesses' path (tests/tpu_compiler.py),
# and nothing else in the venv tries to start a TPU backend
$(TEST_STAMP): $(DEMO_STAMP)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps --upgrade --target $(TPU_COMPILER) "$$($(PY) -c 'import importlib.metadata as m; print(next(r.split(";")[0].strip() for r in m.requires("jax") if r.startswith("libtpu")))')"
	$(INSTALL_GPU_COMPILER)
	touch $(TEST_STAMP)

setup: $(TEST_STAMP)

test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 --durations=15 tests benchmarks/tests

demo: $(DEMO_STAMP)
	$(PY) -m demo

# XLA's GPU compiler without a GPU (compile-only: benchmarks.compiled.compile_for --compile-for h100,
# --topology h100 of the dry runs, tests/test_gpu_compile.py), ~480 MB, in its own folder like
# libtpu (part of the test setup); put it on PYTHONPATH:
#   PYTHONPATH=.:$(GPU_COMPILER) JAX_PLATFORMS=cpu python -m benchmarks.compiled.compile_for --compile-for h100
gpu-compiler: $(DEMO_STAMP)
	$(INSTALL_GPU_COMPILER)

# For a GPU machine without network access (Python 3.12 with jax for CUDA, flax, optax, orbax,
# tokenizers): what it lacks to train and decode (demo/pipeline.py, benchmarks/gpu/on_gpu.py), grain and
# its two missing needs and qwix (the model's quantized projections), as wheels in .whl/ (git ignores
# it), to copy there and install with `pip install --no-index .whl/*.whl`
OFFLINE_WHEELS := grain==0.2.18 array_record==0.8.6 portpicker==1.6.0 qwix==0.1.8
offline-wheels: $(DEMO_STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl $(OFFLINE_WHEELS)

clean:
	rm -rf $(VENV)
