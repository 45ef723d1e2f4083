"""Settings for every test process (and the subprocesses the tests start, which inherit them):
XLA's fast compile (tests/xla.py) and WEDLM_COMPILE_CACHE=off. The command-line programs turn on
JAX's persistent compilation cache by default; the tests that count compiles must see them, so it
is off unless a test names a folder. The train tests' subprocesses share a cache for the run
(tests/synthetic/train_data.py), removed when the session ends. A skipped test fails the run
unless WEDLM_ALLOW_SKIPS=1.

Each test module's compiled programs are let go when it ends (`jax.clear_caches()`): every
XLA:CPU executable keeps ~6 memory mappings while jax's caches hold it, and a pytest-xdist worker
that compiled a few thousand programs reached the kernel's limit (vm.max_map_count, 65530), after
which the next compile segfaulted the worker (seen as crashes in jax's compile and cache write).
"""

import os

import pytest

os.environ.setdefault("WEDLM_COMPILE_CACHE", "off")
ALLOW_SKIPS = "WEDLM_ALLOW_SKIPS"

from tests.xla import FAST_COMPILE  # noqa: E402 - before any test imports jax

if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


def pytest_sessionfinish(session):
    if "WEDLM_TEST_RUN" in os.environ:        # this process made a run cache
        import shutil
        from tests.synthetic.train_data import compilation_cache_dir
        shutil.rmtree(compilation_cache_dir(), ignore_errors=True)
    _fail_on_skips(session)


def _fail_on_skips(session) -> None:
    """A skipped test fails the run (an `importorskip` whose package is missing would otherwise
    drop tests silently on a broken install), unless WEDLM_ALLOW_SKIPS=1. Decided once, by the
    process that reports (with -n, the controller: it holds every worker's results)."""
    if hasattr(session.config, "workerinput") or os.environ.get(ALLOW_SKIPS) == "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped and session.exitstatus == pytest.ExitCode.OK:
        reporter.write_line(f"\n{len(skipped)} test(s) skipped: the full setup (`make setup`) runs "
                            f"every test; {ALLOW_SKIPS}=1 allows skips", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    import gc
    import sys
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
        gc.collect()


def _shares_a_module_fixture(path: str, seen: dict = {}) -> bool:  # noqa: B006 - a cache
    if path not in seen:
        try:
            text = open(path, encoding="utf-8").read()
        except OSError:
            text = ""
        seen[path] = 'scope="module"' in text or "scope='module'" in text
    return seen[path]


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With -n (`--dist load`): the tests of a module that defines a module-scoped fixture (a
    server, a checkpoint, a pipeline run, a compiled Decoder) go to one worker together; split
    across the two workers, each would build the fixture again (test_demo_pipeline's run ~60 s,
    test_lm_eval's server and lm-eval run ~80 s) and compile its programs again. The other tests
    are balanced one by one, as with `--dist load`. Largest groups first (xdist's loadscope)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _shares_a_module_fixture(os.path.join(str(config.rootpath), path)) \
                else nodeid

    return ModuleFixtureScheduling(config, log)
