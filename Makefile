# `make demo` and `make test` set everything up on a fresh machine (idempotently) and run.
# `make demo` installs the package only (no torch, no transformers: those are the `test` extra);
# `make test` (and `make setup`) add the `test` extra, torch pinned first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.installed-demo-stamp
TEST_STAMP := $(VENV)/.installed-test-stamp
TPU_COMPILER := $(VENV)/tpu-compiler

.PHONY: setup test demo clean

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
	touch $(TEST_STAMP)

setup: $(TEST_STAMP)

test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 --durations=15 tests benchmarks/tests

demo: $(DEMO_STAMP)
	$(PY) -m demo

clean:
	rm -rf $(VENV)
