"""Settings for every test process (and the subprocesses the tests start, which inherit them):
XLA's fast compile (tests/xla.py) and WEDLM_COMPILE_CACHE=off. The command-line programs turn on
JAX's persistent compilation cache by default; the tests that count compiles must see them, so it
is off unless a test names a folder. The in-process train tests keep their own cache for the run
(tests/synthetic/train_data.py), removed when the session ends.
"""

import os

os.environ.setdefault("WEDLM_COMPILE_CACHE", "off")

from tests.xla import FAST_COMPILE  # noqa: E402 - before any test imports jax

if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


def pytest_sessionfinish(session):
    if "WEDLM_TEST_RUN" in os.environ:        # this process made a run cache
        import shutil
        from tests.synthetic.train_data import compilation_cache_dir
        shutil.rmtree(compilation_cache_dir(), ignore_errors=True)
