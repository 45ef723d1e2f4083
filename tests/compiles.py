"""Counting this process's compiles, for the tests that assert nothing is compiled (a refusal
before any compile, a request served by programs compiled ahead). The suite shares a persistent
compilation cache (tests/xla.py), so a program compiled earlier in the run may load from it
instead of compiling: a load counts here as a compile, as it would be one without the cache.

    from tests.compiles import COMPILES
    before = len(COMPILES); ...; assert len(COMPILES) == before
"""

from __future__ import annotations

import jax

COMPILES: list = []     # every backend compile and every cache load of this process

jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **k: COMPILES.append(name) if name.endswith("backend_compile_duration") else None)
jax.monitoring.register_event_listener(
    lambda name, *a, **k: COMPILES.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
