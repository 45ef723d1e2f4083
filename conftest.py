"""Settings for every test process (and the subprocesses the tests start, which inherit them):
WEDLM_COMPILE_CACHE=off. The command-line programs turn on JAX's persistent compilation cache by
default; the tests that count compiles must see them, so it is off unless a test names a folder.
The in-process train tests keep their own cache for the run (tests/synthetic/train_data.py),
removed when the session ends.
"""

import os

os.environ.setdefault("WEDLM_COMPILE_CACHE", "off")


def pytest_sessionfinish(session):
    if "WEDLM_TEST_RUN" in os.environ:        # this process made a run cache
        import shutil
        from tests.synthetic.train_data import compilation_cache_dir
        shutil.rmtree(compilation_cache_dir(), ignore_errors=True)
