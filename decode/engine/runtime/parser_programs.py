"""The host parser's programs, apart from the others: a guided Batcher (a server's) steps with the
Guide's static `parsers` False (device tables only: no host call in the programs, which JAX's
persistent compile cache keeps) while no live slot holds a host-parser constraint, and with it
True (the programs holding `io_callback`, decode.engine.step.host_guide) while one does. The state's
arrays are the same either way; only the programs differ, and a slot without a host parser
gets the same tokens from both.

The parsers=True family (the paged admission per prompt bucket, `generate` per live-slot bucket)
is compiled ahead of time (`lower().compile()` with the arguments' shapes, placements and
commitment as the Decoder passes them: the jitted call then finds the executable in JAX's
in-memory caches), inline (`ParserPrograms.compile`) or on a thread of its own after the server
is ready (`ParserPrograms.start`). While it compiles there, a request that needs a host parser
waits in the queue until the programs it runs are compiled (`ParserPrograms.admits`: `generate`
for every live-slot bucket first, then the admissions from the smallest prompt bucket up); the
others go on.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from decode.engine.step import guide as guides
from decode.engine.step import programs
from decode.engine.step.state import Request, request_row
from wedlm_jax.attention import paged
from wedlm_jax.axis_rules import DEFAULT_RULES

log = logging.getLogger(__name__)
PREFIX = "host parser: "          # the names the family's programs are reported by
_COMPILING: weakref.WeakSet = weakref.WeakSet()    # families compiling on their threads


@atexit.register
def _stop_all() -> None:
    """At exit, no compile left running on a thread (one the interpreter stops mid-compile
    aborts the process): each family stops after the program it is compiling."""
    for family in list(_COMPILING):
        family.stop()


def needs_parser(request: Request) -> bool:
    """Does the request's constraint run in a host parser?"""
    return request.automaton is not None and guides.is_host(request.automaton)


def with_parsers(state, on: bool):
    """`state` whose Guide (if any) selects the programs with the host parser's call (`on`) or
    without; the arrays are the same objects (no copy, no device work)."""
    if state.guide is None or state.guide.parsers == on:
        return state
    return state.replace(guide=state.guide.replace(parsers=on))


def abstract(x):
    """An array's ShapeDtypeStruct as a jitted call keys it: placed only when committed."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=getattr(x, "weak_type", False),
                                sharding=x.sharding if getattr(x, "committed", False) else None)


def prompt_buckets(decoder, lengths) -> list[int]:
    """The token buckets a paged admission of prompts of `lengths` can take (the suffix after a
    reused prefix is shorter: a smaller bucket, among these when `lengths` are warm-up's)."""
    held = 1 if decoder.method in ("ar", "verified") else 0
    return sorted({decoder.prompt_bucket(max(n - h, 1)) for n in lengths for h in {0, held}})


class ParserPrograms:
    """The parsers=True programs of one Decoder, compiled inline or in the background."""

    def __init__(self, decoder):
        self.decoder = decoder
        self._done = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._upto = 0      # the largest prompt bucket admitted with the host parser so far
        self.seconds: float | None = None     # how long the family took (once compiled)
        self.error: str | None = None         # why it failed (its programs compile on first use)

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    @property
    def holding(self) -> bool:
        """Do requests needing a host parser wait (their programs compiling in the background)?"""
        return self._thread is not None and not self._done.is_set()

    def admits(self, request: Request) -> bool:
        """May `request` be admitted now: not while the programs its host parser runs compile
        (a paged admission's prompt bucket, after every `generate`)?"""
        if not self.holding or not needs_parser(request):
            return True
        return self.decoder.paged and self.decoder.prompt_bucket(len(request.prompt)) <= self._upto

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the family is compiled (or `timeout` seconds); True when it is."""
        return self._done.wait(timeout) if self._thread is not None else self.ready

    def names(self, lengths) -> list[str]:
        """Its programs' names, in the order they compile (warm-up's prompt `lengths`)."""
        return [PREFIX + name for name, _, _, _ in self._jobs(None, lengths)]

    def compile(self, state, lengths, progress=None) -> float:
        """Compile the family now for `state` (the Batcher's: its shapes and placements only)
        and prompts of `lengths`; progress(name, seconds) after each. Returns the seconds."""
        report = progress or (lambda name, seconds: None)
        t0 = time.perf_counter()
        for name, fn, args, bucket in self._jobs(jax.tree.map(abstract, state), lengths):
            if self._stop.is_set():
                return time.perf_counter() - t0
            t1 = time.perf_counter()
            self._lower(fn, args).compile()
            self._upto = max(self._upto, bucket)
            report(PREFIX + name, time.perf_counter() - t1)
        self.seconds = time.perf_counter() - t0
        self._done.set()
        return self.seconds

    def start(self, state, lengths, progress=None) -> None:
        """Compile the family on a thread of its own (the shapes are read here, the caller's
        thread: the state itself is never touched there); progress(name, seconds) there after
        each program (default: a log line), a log line when all are compiled."""
        spec = jax.tree.map(abstract, state)
        report = progress or (lambda name, seconds: log.info("compiled %s in %.1f s", name, seconds))

        def run():
            try:
                self.compile(spec, lengths, report)
                if self._stop.is_set():
                    return
                log.info("compiled the host constraint parser's programs in %.1f s: requests "
                         "whose constraint needs it are admitted from now on", self.seconds)
            except Exception as e:  # noqa: BLE001 - its programs then compile on first use
                self.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                log.error("compiling the host constraint parser's programs failed (%s); they "
                          "compile on first use", self.error)
                self._done.set()
        self._thread = threading.Thread(target=run, name="wedlm-parser-programs", daemon=True)
        _COMPILING.add(self)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Compile no further program (at shutdown): wait for the one compiling, at most
        `timeout` seconds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _lower(self, fn, args):
        """`fn` lowered as the Decoder calls it (its mesh and axis rules around the call)."""
        mesh = self.decoder.mesh
        if mesh is None:
            return fn.lower(*args)
        with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES.as_flax_rules()):
            return fn.lower(*args)

    def _jobs(self, spec, lengths):
        """(name, jitted program, its arguments, the prompt bucket it admits or 0) for each
        program of the family, as the Decoder passes them (`spec`: the state's ShapeDtypeStructs;
        None: names only): every `generate`, then the admissions, smallest bucket first."""
        dec = self.decoder
        st, k = dec.static, dec.steps_per_call
        state = spec if spec is None else with_parsers(spec, True)
        mask_id, i32 = jnp.int32(dec.mask_id), jnp.int32
        jobs = []
        for size in dec.live_buckets():
            jobs.append((f"generate, {size} live slot(s)", programs.generate_live,
                         (st, k, dec.params, state, jnp.arange(size, dtype=jnp.int32), mask_id,
                          i32(0)), 0))
        if dec.compiled_generate is None:     # else one program, compiled with its layouts
            jobs.append((f"generate, {dec.slots} live slot(s)", programs.generate,
                         (st, k, dec.params, state, mask_id, i32(0)), 0))
        if dec.paged:
            row = self._row(spec)
            table = jnp.full((st.pages_per_seq,), paged.UNMAPPED, jnp.int32)
            for pb in prompt_buckets(dec, lengths):
                tokens = jnp.zeros((1, pb), jnp.int32)
                jobs.append((f"admission, prompt bucket {pb}", programs.prefill_slot,
                             (st, dec.params, state, row, i32(0), table, tokens, i32(0), i32(1),
                              mask_id), pb))
        return jobs

    def _row(self, spec):
        """A request's first row as the paged admission takes it (a free Guide row, parsers on)."""
        if spec is None:
            return None
        dec = self.decoder
        _, _, row = request_row(dec.static, dec.check_request(Request(prompt=(0,), max_new_tokens=1)),
                                dec.mask_id, dec.capacity)
        row = guides.attach(row, None, (), dec.model_config.vocab_size, guided=True)
        return with_parsers(jax.tree.map(jnp.asarray, row), True)
