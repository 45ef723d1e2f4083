"""The Decoder: compiled decoding over a fixed set of slots (continuous batching, JetStream's shape).

    plan = make_plan(model_config, EngineOptions(method="streaming", window=16, slots=8,
                                                 capacity=1024))      # decode/engine/planning/plan.py
    decoder = Decoder(params, plan)
    state = decoder.init_state()                        # every slot free
    prefix = decoder.prefill(Request(prompt=(1, 2, 3), max_new_tokens=64, tau=0.4))
    state = decoder.insert(prefix, state, slot=0)
    state, result = decoder.generate(state)             # k steps in one jitted call
    result.tokens[slot, i, :result.counts[slot, i]]     # the ids slot emitted at step i

Ahead of time (no weights, no device of the target: decode/compile/aot.py): `abstract_args(program)`,
`lower(program)`, `compile(program)` for the programs "generate", "prefill" and "admit".

`generate` runs up to `steps_per_call` steps of every slot as one `lax.while_loop` over the donated
state (no host round trip inside; it stops early when every slot is done). Between calls the host
hands out the new ids, frees finished slots and inserts waiting requests (`decode.engine.runtime.batcher`).
prefill + insert are the dense cache's admission; a paged cache (the plan's page size: the
default on TPU, and on CPU at the serving doors) admits with `prefill_into_slot` into pages the
host hands out (`decode.engine.runtime.batcher` does both), and for streaming / block runs the request's
first step there too (its window's first fill, committing nothing: `programs.fills_at_prefill`).

Compiled programs (decode/engine/step/programs.py): one prefill and one insert per prompt bucket (powers of
two), one generate, one free; all keyed by the plan's `Static`, so Decoders with equal plans share
them (jax's own cache) and nothing compiled reads module state. A request's settings (the runtime
options of `Sampling`, decode/config.py) are values in the state, one per slot
(`decode.engine.step.state.SlotSettings`). A request's random draws depend only on its seed and its own
step count, so its output does not depend on its slot or its neighbours.

Prefill conventions: streaming / block write the prompt's rows 0..P-1 and start with a window of
masks at position P; ar / verified write rows 0..P-2 and hold the last prompt token as the pending
token (slot 0) at position P-1.
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P

from decode.engine.runtime import adapters
from decode.engine.runtime import window_policy
from decode.engine.step import guide as guides
from decode.engine.planning import layouts
from decode.engine.step import programs
from decode.config import DecodeConfigError, is_int
from decode.engine.runtime.pages import static_batch_table
from decode.engine.planning.plan import Plan
from decode.engine.step.programs import cache_axes
from decode.engine.step.state import (DecodeState, Prefix, Request, ResultTokens, free_rows,
                                 request_row)
from wedlm_jax import model as model_lib
from wedlm_jax.attention import paged
from wedlm_jax.buckets import pow2_at_least
from wedlm_jax import quantize
from wedlm_jax.quantize_scheme import QuantizeError
from wedlm_jax.axis_rules import DEFAULT_RULES
from wedlm_jax.sharding import is_axes, spec_for, tree_shardings

MIN_PROMPT_BUCKET = 16
PROGRAMS = ("generate", "prefill", "admit")      # what `abstract_args` / `lower` / `compile` take


class Decoder:
    """Compiled WeDLM decoding over the plan's slots of a preallocated, donated KV cache
    (decode/engine/planning/plan.py says what a plan decides). The weights are placed once: on the plan's mesh
    (slots over data x fsdp, heads over tensor), one tree per layer where the plan's programs
    take them so (GPU), and with weight_layout "compiler" in the layouts the compiled `generate`
    picks (decode/engine/planning/layouts.py)."""

    def __init__(self, params, plan: Plan):
        if not isinstance(plan, Plan):
            raise DecodeConfigError(f"a Decoder takes (params, plan) with a Plan from "
                                    f"decode.engine.planning.plan.make_plan, got {type(plan).__name__}")
        self.plan = plan
        config = plan.model_config
        try:   # float weights quantized as the plan says; quantized ones must match it
            params = quantize.conform(params, plan.static.quantize, plan.static.quantize_group)
        except QuantizeError as e:
            raise DecodeConfigError(str(e), e.field) from None
        if plan.static.stacked_layers and not model_lib.layers_stacked(params):
            raise DecodeConfigError("the plan takes stacked layer weights and these are one tree "
                                    "per layer: make the plan with stacked_params=False")
        if not plan.static.stacked_layers and model_lib.layers_stacked(params):
            # one tree per layer (decode/engine/planning/layouts.py); a checkpoint opened for this platform is
            # loaded so already (decode.checkpoint), with no stacked copy beside it
            params = model_lib.unstack_layers(params, config.num_layers)
        if plan.mesh is not None:
            self._param_shardings = self._make_shardings(params)
            params = self._place(params, self._param_shardings)
        if plan.static.max_loras:     # an empty LoRA adapter table (decode.engine.runtime.adapters)
            params = (adapters.with_table_shapes(params, plan.static) if layouts.is_abstract(params)
                      else adapters.with_table(params, plan.static, plan.mesh))
        self.params = params
        self.adapters = adapters.Adapters(self) if plan.static.max_loras else None
        self.weight_layout = plan.weight_layout
        self._generate_compiled = None
        self.compiler_options = None          # the step's, when compiled here (layouts.step_options)
        if self.weight_layout == "compiler":
            self.use_compiler_layouts()

    # the plan's decisions, as the callers read them
    static = property(lambda self: self.plan.static)
    model_config = property(lambda self: self.plan.model_config)
    mask_id = property(lambda self: self.plan.mask_id)
    method = property(lambda self: self.plan.method)
    window = property(lambda self: self.plan.window)
    refill = property(lambda self: self.plan.refill)
    slots = property(lambda self: self.plan.slots)
    capacity = property(lambda self: self.plan.capacity)
    steps_per_call = property(lambda self: self.plan.steps_per_call)
    sampling = property(lambda self: self.plan.sampling)
    mesh = property(lambda self: self.plan.mesh)
    memory_estimate = property(lambda self: self.plan.memory_estimate)
    compiled_generate = property(lambda self: self._generate_compiled,
                                 doc="`generate` compiled for the weights' layouts (or None)")

    def use_compiler_layouts(self, compiler_options: dict | None = None) -> None:
        """Compile `generate` with the weights' layouts left to the compiler, keep that program for
        `generate` calls and put the weights into the layouts it chose (decode/engine/planning/layouts.py)."""
        self._generate_compiled, formats, self.compiler_options = layouts.choose(self, compiler_options)
        self.params = layouts.place(self.params, formats)
        self.weight_layout = "compiler"

    # -- construction helpers
    @property
    def paged(self) -> bool:
        return self.static.paged

    def end_of(self, request: Request) -> int:
        """The row a request's budget ends at: prompt + max_new_tokens, at most the capacity."""
        return min(len(request.prompt) + request.max_new_tokens, self.capacity)

    def pages_needed(self, request: Request) -> int:
        """The most pages a request can hold: its budget plus a window's span (the rows its last
        forwards write), as the dense cache reserves rows."""
        return self.pages_for_call(0, self.end_of(request), whole=True)

    def pages_for_call(self, length: int, end: int, whole: bool = False) -> int:
        """Pages a slot at `length` cache rows (budget ending at `end`) needs through the next
        `generate` call: every row its forwards can write (a step advances the length by at most
        a span and writes a span from it), never more than its budget's (`whole`: the budget's)."""
        st = self.static
        rows = min(end + st.span, st.rows)
        if not whole:
            rows = min(rows, length + (self.steps_per_call + 1) * st.span)
        return -(-rows // st.page_size)

    def _make_shardings(self, params):
        mesh, config = self.mesh, self.model_config
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        axes = model_lib.param_logical_axes(config)
        if not self.static.stacked_layers:
            axes = model_lib.unstack_layers(axes, config.num_layers)
        return tree_shardings(quantize.logical_axes(axes, params), shapes, mesh, DEFAULT_RULES)

    def _place(self, tree, shardings):
        if layouts.is_abstract(tree):   # shapes only (decode.compile.aot: devices maybe not here)
            return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                tree, shardings)
        with jax.set_mesh(self.mesh):
            return jax.device_put(tree, shardings)

    def _state_shardings(self, state):
        mesh = self.mesh
        axes = cache_axes(self.static)
        layers = jax.tree.map(lambda ax, x: NamedSharding(mesh, spec_for(ax, x.shape, mesh)),
                              axes, state.cache.layers, is_leaf=is_axes)
        bare = state.replace(cache=state.cache.replace(layers=None))
        rest = jax.tree.map(lambda x: NamedSharding(mesh, spec_for(
            ("batch",) + (None,) * (x.ndim - 1), x.shape, mesh)), bare)
        return rest.replace(cache=rest.cache.replace(layers=layers))

    def _call(self, fn, *args):
        if self.mesh is None:
            return fn(*args)
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(DEFAULT_RULES.as_flax_rules()):
            return fn(*args)

    # -- requests
    def check_request(self, request: Request) -> Request:
        """The request validated against this Decoder's plan (`Plan.check_request`)."""
        return self.plan.check_request(request)

    def prompt_bucket(self, prompt_len: int) -> int:
        return min(pow2_at_least(prompt_len, MIN_PROMPT_BUCKET), self.static.rows)

    # -- the JetStream-shaped API
    def _host_free(self) -> DecodeState:
        return free_rows(self.static, self.mask_id)

    def init_state(self, guided: bool = False, parsers: bool = True) -> DecodeState:
        """A state with every slot free (done); `guided`: with free constraint rows (the programs
        it runs are those every constrained request runs), and the host parsers' call in them
        unless `parsers` is False (device tables only)."""
        host = self._host_free()
        if guided:
            host = guides.with_guide(host, self.model_config.vocab_size, parsers)
        state = host.replace(cache=host.cache.replace(layers=self._empty_layers()))
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, state)
        return self._place(state, self._state_shardings(state))

    def _host_row(self, r: Request, guided: bool = False):
        prompt, n0, row = request_row(self.static, r, self.mask_id, self.capacity)
        try:
            row = guides.attach(row, r.automaton, r.stop_token_ids, self.model_config.vocab_size,
                                guided, r.automaton_state)
        except ValueError as e:
            raise DecodeConfigError(str(e), "constraint") from None
        return prompt, n0, row

    def prefill(self, request: Request) -> Prefix:
        """Validate and prefill one request (batch 1): its prompt K/V and first window."""
        prompt, n0, row = self._host_row(self.check_request(request))
        pb = self.prompt_bucket(len(prompt))
        tokens = np.zeros((1, pb), np.int32)
        tokens[0, :len(prompt)] = prompt
        kv = self._call(programs.prefill, self.static, self.params, tokens,
                        np.asarray([n0], np.int32), row.lora)
        return Prefix(kv=kv, row=jax.tree.map(jnp.asarray, row))

    def start(self, requests, prompt_bucket: int | None = None) -> DecodeState:
        """A fresh state holding requests[i] in slot i (None, or slots past the list: free), every
        prompt prefilled in ONE batched call: the static-batch path (`generate`), which would
        otherwise pay a prefill and an insert per request. The prompts are padded to the bucket of
        the longest, or of `prompt_bucket` when that is longer (one prefill program for batches
        of different prompt lengths)."""
        if len(requests) > self.slots:
            raise DecodeConfigError(f"{len(requests)} requests do not fit {self.slots} slots")
        host = jax.tree.map(np.array, self._host_free())
        guided = any(r is not None and r.automaton is not None for r in requests)
        if guided:                  # a constraint: every slot gets a Guide row
            host = guides.with_guide(host, self.model_config.vocab_size)
        longest = max([len(r.prompt) for r in requests if r is not None] + [prompt_bucket or 1])
        pb = self.prompt_bucket(longest)
        tokens = np.zeros((self.slots, pb), np.int32)
        plen = np.zeros((self.slots,), np.int32)
        for i, r in enumerate(requests):
            if r is None:
                continue
            prompt, plen[i], row = self._host_row(self.check_request(r), guided)
            tokens[i, :len(prompt)] = prompt
            for dst, src in zip(jax.tree.leaves(host), jax.tree.leaves(row)):
                dst[i] = src[0]
        layers = self._empty_layers()
        if self.paged:   # the static batch: fixed pages (decode.engine.runtime.pages.static_batch_table)
            st = self.static
            per_seq = st.pages_per_seq
            if st.pages_per_shard < st.slots // st.page_shards * per_seq:
                raise DecodeConfigError(f"a static batch needs slots x pages per sequence = "
                                        f"{self.slots * per_seq} pages; the pool has "
                                        f"{self.static.num_pages}")
            table = static_batch_table(st.slots, st.page_shards, st.pages_per_shard, per_seq)
            live = np.asarray([r is not None for r in requests] + [False] * (self.slots - len(requests)))
            layers["table"] = jnp.asarray(np.where(live[:, None], table, paged.UNMAPPED))
        state = host.replace(cache=host.cache.replace(layers=layers))
        state = (jax.tree.map(jnp.asarray, state) if self.mesh is None
                 else self._place(state, self._state_shardings(state)))
        return self._call(programs.prefill_into, self.static, self.params, state, tokens, plen)

    def insert(self, prefix: Prefix, state: DecodeState, slot: int) -> DecodeState:
        """Place a prefilled request in `slot` (the state is donated). Dense cache only: a paged
        cache takes `prefill_into_slot`."""
        self._check_slot(slot)
        if self.paged:
            raise DecodeConfigError("a paged cache admits requests with prefill_into_slot")
        state, row = guides.conform(state, prefix.row, self.model_config.vocab_size)
        return self._call(programs.insert, self.static, state, prefix.replace(row=row),
                          jnp.int32(slot))

    def prefill_into_slot(self, state: DecodeState, request: Request, slot: int, pages,
                          start: int = 0) -> DecodeState:
        """Paged cache: admit `request` into `slot` holding `pages` (its page ids in order, at
        least `pages_for_call` from its prompt; more are mapped as it grows, `set_page_rows`);
        its prompt rows from `start` on (a multiple of the page size: the rows before it are a
        prefix shared with earlier requests, already in its first pages) are computed straight
        into them. The state is donated."""
        self._check_slot(slot)
        if not self.paged:
            raise DecodeConfigError("prefill_into_slot is for a paged cache (page_size=...)")
        r = self.check_request(request)
        prompt, n0, row = self._host_row(r)
        per_seq, page = self.static.pages_per_seq, self.static.page_size
        need = self.pages_for_call(n0, self.end_of(r))
        if not need <= len(pages) <= per_seq:
            raise DecodeConfigError(f"the request needs {need} pages through its first generate "
                                    f"call (at most {per_seq}); got {len(pages)}")
        if not is_int(start) or start % page or not 0 <= start <= n0:
            raise DecodeConfigError(f"start must be a multiple of the page size {page} in [0, "
                                    f"{n0}], got {start!r}")
        suffix = list(prompt[start:n0]) or [0]
        tokens = np.zeros((1, self.prompt_bucket(len(suffix))), np.int32)
        tokens[0, :len(suffix)] = suffix
        table = np.full((per_seq,), paged.UNMAPPED, np.int32)
        table[:len(pages)] = pages
        state, row = guides.conform(state, jax.tree.map(jnp.asarray, row),
                                    self.model_config.vocab_size)
        return self._call(programs.prefill_slot, self.static, self.params, state,
                          row, jnp.int32(slot), jnp.asarray(table),
                          jnp.asarray(tokens), jnp.int32(start), jnp.int32(n0),
                          jnp.int32(self.mask_id))

    def free(self, state: DecodeState, slot: int) -> DecodeState:
        """Mark `slot` done (a cancelled request); a paged cache's page row is unmapped too.
        The state is donated."""
        self._check_slot(slot)
        if self.paged:
            return self.unmap(state, [slot])
        return self._call(programs.free, self.static, state, jnp.int32(slot))

    def unmap(self, state: DecodeState, slots) -> DecodeState:
        """Paged cache: `slots` done and their page rows unmapped (before their pages go to
        another request). The state is donated."""
        mask = np.zeros((self.slots,), bool)
        mask[list(slots)] = True
        return self._call(programs.unmap, self.static, state, jnp.asarray(mask))

    def set_page_rows(self, state: DecodeState, rows: dict) -> DecodeState:
        """Paged cache: slot -> its pages in order (mapped as a sequence grows; at most
        pages_per_seq); one device call for all. The state is donated."""
        per_seq = self.static.pages_per_seq
        which = np.zeros((self.slots,), bool)
        table = np.full((self.slots, per_seq), paged.UNMAPPED, np.int32)
        for slot, pages in rows.items():
            self._check_slot(slot)
            if len(pages) > per_seq:
                raise DecodeConfigError(f"slot {slot}: {len(pages)} pages, more than a sequence's "
                                        f"{per_seq}")
            which[slot], table[slot, :len(pages)] = True, pages
        return self._call(programs.set_rows, self.static, state, jnp.asarray(which), jnp.asarray(table))

    def copy_pages(self, state: DecodeState, src, dst) -> DecodeState:
        """Paged cache: pages `dst` (global ids) made copies of pages `src`, every layer; at most
        a sequence's pages at once (one compiled program). The state is donated."""
        per_seq = self.static.pages_per_seq
        if len(src) != len(dst) or len(src) > per_seq:
            raise DecodeConfigError(f"copy_pages takes as many destination pages as source pages, "
                                    f"at most {per_seq}; got {len(src)} and {len(dst)}")
        pad = lambda ids: np.asarray(list(ids) + [paged.UNMAPPED] * (per_seq - len(ids)), np.int32)
        return self._call(programs.copy_pages, self.static, state, jnp.asarray(pad(src)),
                          jnp.asarray(pad(dst)))

    def _check_slot(self, slot) -> None:
        if not is_int(slot) or not 0 <= slot < self.slots:
            raise DecodeConfigError(f"slot must be an int in [0, {self.slots}), got {slot!r}")

    def _empty_layers(self):
        st = self.static
        if st.paged:
            c = st.config
            return paged.init_paged_cache(c.num_layers, st.num_pages, st.page_size, c.num_kv_heads,
                                          c.head_dim, st.slots, st.pages_per_seq, st.cache_dtype)
        return model_lib.init_kv_cache(st.config, st.slots, st.rows, st.cache_dtype)

    def live_buckets(self) -> list[int]:
        """The live-slot buckets `generate(live=...)` steps alone (powers of two below `slots`):
        a paged cache with one slot shard and row-major weights; none otherwise (the dense
        cache's rows would be copied out and back; the compiler-layout program is compiled
        for all the slots)."""
        st = self.static
        if not st.paged or st.page_shards != 1 or self._generate_compiled is not None:
            return []
        return [b for b in (1 << i for i in range(st.slots.bit_length())) if b < st.slots]

    def rungs(self) -> list[int]:
        """The windows `generate(window=...)` steps with, largest first (the window ladder,
        decode/engine/runtime/window_policy.py); the plan's window alone with the compiler's
        weight layouts (that program is compiled for the plan's window only)."""
        if self._generate_compiled is not None:
            return [self.window]
        return window_policy.ladder(self.method, self.window)

    def generate(self, state: DecodeState, k: int | None = None, live=None, window=None):
        """Run up to k (default and at most steps_per_call; 0 compiles and runs nothing) steps of
        every live slot in one jitted call, fewer when slots that had emitted nothing (just
        inserted) all have their first tokens. Returns (state, ResultTokens).

        live: the slots holding requests, when the caller knows them (the Batcher does): with a
        paged cache the call then steps only the smallest `live_buckets` bucket holding them
        (padded with free slots), one compiled program per bucket; slots left out do not move.
        The tokens are the same as a call over every slot.

        window: a rung of `rungs()` to step with (default: the plan's window)."""
        k = self.steps_per_call if k is None else k
        if not is_int(k) or not 0 <= k <= self.steps_per_call:
            raise DecodeConfigError(f"k must be an int in [0, {self.steps_per_call}], got {k!r}")
        mask_id, run = jnp.int32(self.mask_id), jnp.int32(k)
        idx = self._bucket(live) if live is not None else None
        if window is not None and window not in self.rungs():
            raise DecodeConfigError(f"window {window!r} is not a rung of {self.rungs()}")
        static = self.static if window is None else programs.at_rung(self.static, window)
        if self._generate_compiled is not None and not static.rung:   # the compiler's layouts
            state, toks, lps, counts, steps = self._generate_compiled(self.params, state, mask_id, run)
        elif idx is not None:
            state, toks, lps, counts, steps = self._call(
                programs.generate_live, static, self.steps_per_call, self.params, state,
                jnp.asarray(idx), mask_id, run)
        else:
            state, toks, lps, counts, steps = self._call(programs.generate, static, self.steps_per_call,
                                                         self.params, state, mask_id, run)
        toks, lps, counts, steps, done = jax.device_get((toks, lps, counts, steps, state.done))
        return state, ResultTokens(tokens=toks, counts=counts, steps=int(steps), done=done,
                                   logprobs=lps)

    def step_programs(self, windows=(None,)) -> list[str]:
        """The names `compile_steps` reports its programs by, in its order."""
        at = lambda w: "" if w in (None, self.window) else f", window {w}"   # noqa: E731
        names = [f"generate, {size} live slot(s){at(w)}" for w in windows
                 for size in self.live_buckets() + [self.slots]]
        return names + (["page table updates"] if self.paged else [])

    def compile_steps(self, state: DecodeState, progress=None, windows=(None,)) -> DecodeState:
        """Compile, by running them as no-ops, the programs a serving loop calls after admission:
        `generate` for every live-slot bucket and for every slot, and with a paged cache the page
        table's updates (`set_page_rows`, `unmap`, `copy_pages` across slot shards). The state
        is donated and comes back unchanged. progress(name, seconds): after each (names as
        `step_programs`). `windows`: the rungs compiled (default: the plan's window)."""
        report = progress or (lambda name, seconds: None)
        names = iter(self.step_programs(windows))
        for w in windows:
            for size in self.live_buckets() + [self.slots]:
                t0 = time.perf_counter()
                state, _ = self.generate(state, 0, live=range(size), window=w)   # runs no step
                report(next(names), time.perf_counter() - t0)
        if self.paged:
            t0 = time.perf_counter()
            state = self.unmap(self.set_page_rows(state, {}), [])
            if self.static.page_shards > 1:
                state = self.copy_pages(state, [], [])
            report("page table updates", time.perf_counter() - t0)
        return state

    def _bucket(self, live) -> np.ndarray | None:
        """The slots a `generate(live=...)` call steps: the live ones, then free ones up to the
        smallest bucket holding them; None for every slot (no bucket small enough)."""
        live = sorted(set(live))
        for slot in live:
            self._check_slot(slot)
        size = next((b for b in self.live_buckets() if b >= len(live)), None)
        if size is None:
            return None
        pad = sorted(set(range(self.slots)) - set(live))[:size - len(live)]
        return np.asarray(live + pad, np.int32)

    def step_with_aux(self, state: DecodeState):
        """One step (not donated) with its aux dict: for traces and checks."""
        return self._call(programs.one_step, self.static, self.params, state, jnp.int32(self.mask_id))

    # -- ahead of time: the programs from abstract shapes (decode/compile/aot.py, decode/engine/planning/layouts.py)
    def abstract_args(self, program: str = "generate", *, prompt_len: int | None = None):
        """The arguments of one of PROGRAMS as ShapeDtypeStructs, laid out as this Decoder lays
        them out (on its mesh, or on its device): "generate" (params, state, mask_id, run),
        "prefill" (params, tokens [1, prompt_len], prefill_len [1]), "admit" (the paged
        admission: params, state, row, slot, pages, tokens [1, prompt_len], start, prefill_len,
        mask_id)."""
        if program not in PROGRAMS:
            raise DecodeConfigError(f"program must be one of {', '.join(PROGRAMS)}, got {program!r}")
        st, dev = self.static, self.plan.device
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        host = self._host_free()
        bare = layouts.shapes_of(host.replace(cache=host.cache.replace(layers=None)))
        if self.mesh is None:
            params = layouts.abstract_weights(self.model_config, st, dev)
            put = lambda tree: layouts.on_device(dev, tree)
        else:
            rep = NamedSharding(self.mesh, P())
            params = self.params
            put = lambda tree: jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=rep), tree)
        if program == "prefill":
            return (params, *put((jax.ShapeDtypeStruct((1, prompt_len), jnp.int32),
                                  jax.ShapeDtypeStruct((1,), jnp.int32))))
        state = bare.replace(cache=bare.cache.replace(layers=jax.eval_shape(self._empty_layers)))
        state = layouts.on_device(dev, state) if self.mesh is None else self._place(state, self._state_shardings(state))
        if program == "generate":
            return (params, state, *put((scalar, scalar)))
        row = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1,) + x.shape[1:], x.dtype), bare)
        row, pages, tokens = put((row, jax.ShapeDtypeStruct((st.pages_per_seq,), jnp.int32),
                                  jax.ShapeDtypeStruct((1, prompt_len), jnp.int32)))
        s = put(scalar)
        return params, state, row, s, pages, tokens, s, s, s

    def lower(self, program: str = "generate", *, prompt_len: int | None = None, params=None,
              auto_weight_layouts: bool = False):
        """One of PROGRAMS lowered for this Decoder's target from `abstract_args` (`params`: the
        weights' abstract shapes in place of those, e.g. in given formats). "generate" runs k =
        steps_per_call steps; with `auto_weight_layouts` its weights' layouts are left to the
        compiler (decode/engine/planning/layouts.py)."""
        if program == "admit" and not self.paged:
            raise DecodeConfigError("the admit program is the paged cache's (a plan with a page size)")
        args = list(self.abstract_args(program, prompt_len=prompt_len))
        if params is not None:
            args[0] = params
        fn = dict(generate=programs.generate, prefill=programs.prefill, admit=programs.prefill_slot)[program]
        statics = (self.static, self.steps_per_call) if program == "generate" else (self.static,)
        if auto_weight_layouts:
            if program != "generate":
                raise DecodeConfigError("auto_weight_layouts is for the generate program")
            shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
            fn = jax.jit(programs.generate_loop, static_argnums=(0, 1), donate_argnums=(3,),
                         in_shardings=(jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding),
                                                    args[0]), *map(shardings, args[1:])))
        with jax.default_device(self.plan.device):   # a Mosaic kernel's lowering reads the
            return self._call(fn.lower, *statics, *args)    # TPU generation from it

    def compile(self, program: str = "generate", compiler_options: dict | None = None, **kw):
        """`lower(program, **kw)` compiled with `compiler_options`."""
        with jax.default_device(self.plan.device):
            return self.lower(program, **kw).compile(compiler_options)


__all__ = ["Decoder", "Request", "ResultTokens", "PROGRAMS", "pow2_at_least"]
