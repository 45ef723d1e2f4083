"""Settings for every test process (and the subprocesses the tests start, which inherit them):
XLA's fast compile (tests/xla.py) and WEDLM_COMPILE_CACHE=off. The command-line programs turn on
JAX's persistent compilation cache by default; the tests that count compiles must see them, so it
is off unless a test names a folder. The train tests' subprocesses share a cache for the run
(tests/synthetic/train_data.py), removed when the session ends.

Each test module's compiled programs are let go when it ends (`jax.clear_caches()`): every
XLA:CPU executable keeps ~6 memory mappings while jax's caches hold it, and a pytest-xdist worker
that compiled a few thousand programs reached the kernel's limit (vm.max_map_count, 65530), after
which the next compile segfaulted the worker (seen as crashes in jax's compile and cache write).
"""

import os

import pytest

os.environ.setdefault("WEDLM_COMPILE_CACHE", "off")

from tests.xla import FAST_COMPILE  # noqa: E402 - before any test imports jax

if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


def pytest_sessionfinish(session):
    if "WEDLM_TEST_RUN" in os.environ:        # this process made a run cache
        import shutil
        from tests.synthetic.train_data import compilation_cache_dir
        shutil.rmtree(compilation_cache_dir(), ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    import gc
    import sys
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
        gc.collect()
