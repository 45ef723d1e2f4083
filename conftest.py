"""Settings for every test process (and the subprocesses the tests start, which inherit them):
XLA's fast compile (tests/xla.py) and one persistent compilation cache for the whole run
(tests/xla.py `share_compiled_programs`): a folder made once by the process that starts the run,
shared by the pytest-xdist workers and every subprocess they start (the doors' programs, servers,
training runs), removed when the run ends; never the user's own cache. The tests that assert
"nothing compiled" count cache hits as compiles (tests/compiles.py). A skipped test fails the run
unless WEDLM_ALLOW_SKIPS=1.

Each test module's compiled programs are let go when it ends (`jax.clear_caches()`): every
XLA:CPU executable keeps ~6 memory mappings while jax's caches hold it, and a pytest-xdist worker
that compiled a few thousand programs reached the kernel's limit (vm.max_map_count, 65530), after
which the next compile segfaulted the worker (seen as crashes in jax's compile and cache write).
"""

import os

import pytest

ALLOW_SKIPS = "WEDLM_ALLOW_SKIPS"

from tests.xla import FAST_COMPILE, share_compiled_programs  # noqa: E402 - before jax is imported

if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
_RUN_CACHE_MADE_HERE = share_compiled_programs(os.environ)


def pytest_sessionfinish(session):
    if _RUN_CACHE_MADE_HERE:                  # the run's cache, by the process that made it
        import shutil
        shutil.rmtree(_RUN_CACHE_MADE_HERE, ignore_errors=True)
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
