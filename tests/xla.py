"""XLA flags of every test process (the root conftest.py sets them; tests that start processes
with devices forced pass `flags(n)`): XLA:CPU generates code at LLVM's lowest optimisation level,
its expensive passes off (XLA's own HLO passes, fusion and buffer assignment, run as always). The
suite compiles a few hundred small programs and runs each briefly, so compile time dominates it
(tests/test_paged_decode.py 196 s -> 131 s; the whole suite ~1220 s -> ~640 s on 2 cores); what
the tests check, the same tokens and values on two paths or against a reference within a
tolerance, does not depend on how fast the generated code is. XLA:CPU's older elemental emitters
instead of its fusion emitters (`--xla_cpu_use_fusion_emitters=false`) compile ~3x faster again
(tests/test_paged_decode.py 215 s -> 108 s); the code they generate runs float32 and integer work
about as fast, bfloat16 arithmetic ~2-3x slower, so a test that runs much bfloat16 code runs it in
a process with the fusion emitters (`fusion_emitters`)."""

NO_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                + NO_FUSION_EMITTERS)


def flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test's subprocess: the fast compile, `devices` host devices if given."""
    force = f" --xla_force_host_platform_device_count={devices}" if devices else ""
    return FAST_COMPILE + force


def full_compile(environ: dict) -> dict:
    """`environ` with the fast compile taken out of XLA_FLAGS: for the processes that compile for
    a TPU or GPU, whose memory and cost figures the tests read, and those whose compile times
    matter (the persistent cache keeps only programs that took >= 0.5 s to compile)."""
    rest = environ.get("XLA_FLAGS", "").replace(FAST_COMPILE, "").strip()
    return dict(environ, XLA_FLAGS=rest)


def fusion_emitters(environ: dict) -> dict:
    """`environ` with XLA:CPU's fusion emitters back (the rest of the fast compile kept): for a
    process that runs much bfloat16 code, which the older emitters make ~2-3x slower."""
    rest = environ.get("XLA_FLAGS", "").replace(NO_FUSION_EMITTERS, "").strip()
    return dict(environ, XLA_FLAGS=rest)


RUN_CACHE = "WEDLM_TEST_COMPILE_CACHE"     # the run's folder, once made (inherited by workers)
CACHE_MIN_COMPILE_SECONDS = "0.5"          # below it a program compiles about as fast as it loads
CACHE_MAX_BYTES = str(16 << 30)            # a size limit turns on jax's file lock for every read
                                           # and write: many processes share the folder


def share_compiled_programs(environ) -> str | None:
    """One persistent compilation cache for the whole test run, set in `environ` (os.environ, so
    the pytest-xdist workers and every subprocess inherit it): the suite compiles the same small
    programs in many tests and processes (a Decoder per fixture, a server per module, the doors'
    CLIs), and after the first each loads. Made here when no run folder is set yet (returns its
    path: the caller removes it when the run ends), else the inherited one is used (None).
    XLA's flags are part of jax's cache key, so the fast-compile processes, the full-compile ones
    and those with forced host devices never load each other's programs; programs with host
    callbacks are never persisted (jax does not serialize them)."""
    made = None
    if not environ.get(RUN_CACHE):
        import tempfile
        made = environ[RUN_CACHE] = tempfile.mkdtemp(prefix="wedlm-test-xla-")
    path = environ[RUN_CACHE]
    environ["JAX_COMPILATION_CACHE_DIR"] = path
    environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = CACHE_MIN_COMPILE_SECONDS
    environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = CACHE_MAX_BYTES
    environ["WEDLM_COMPILE_CACHE"] = path          # the doors' default (wedlm_jax/runtime/compile_cache.py)
    return made
