"""The Decoder: compiled decoding over a fixed set of slots (continuous batching, JetStream's shape).

    decoder = Decoder(params, model_config, method="streaming", window=16, slots=8, capacity=1024)
    state = decoder.init_state()                        # every slot free
    prefix = decoder.prefill(Request(prompt=(1, 2, 3), max_new_tokens=64, tau=0.4))
    state = decoder.insert(prefix, state, slot=0)
    state, result = decoder.generate(state)             # k steps in one jitted call
    result.tokens[slot, i, :result.counts[slot, i]]     # the ids slot emitted at step i

`generate` runs up to `steps_per_call` steps of every slot as one `lax.while_loop` over the donated
state (no host round trip inside; it stops early when every slot is done). Between calls the host
hands out the new ids, frees finished slots and inserts waiting requests (`decode.batching`).
prefill + insert are the dense cache's admission; a paged cache (`page_size`, the default on
TPU) admits with `prefill_into_slot` into pages the host hands out (`decode.batching` does
both), and for streaming / block runs the request's first step there too (its window's first
fill, which commits nothing: `decode.programs.fills_at_prefill`).

Compiled programs: one prefill and one insert per prompt bucket (powers of two), one generate,
one free; all keyed by the Decoder's static settings (`Static`), so Decoders with equal settings
share them (jax's own cache) and nothing compiled reads module state. Per-request settings (tau,
lambda, temperature, top-k, top-p, sampling order, max_new_tokens, stop ids, seed) are runtime
values in the state (`decode.state.Settings`). A request's random draws depend only on its seed
and its own step count, so its output does not depend on its slot or its neighbours.

Prefill conventions: streaming / block write the prompt's rows 0..P-1 and start with a window of
masks at position P; ar / verified write rows 0..P-2 and hold the last prompt token as the pending
token (slot 0) at position P-1.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from decode import layouts
from decode.config import (MAX_LOGPROBS, DecodeConfigError, EngineOptions, Sampling,
                           _is_int, check_int)
from decode.memory import _gib, available_memory, estimate_memory
from decode.pages import pool_size, static_batch_table
from decode.programs import (STEPS, Static, _copy_pages, _forward, _free, _generate,  # noqa: F401
                             _generate_live, _insert, _one_step, _prefill, _prefill_into,
                             _prefill_slot, _set_rows, _unmap, cache_axes, compiled_count)
from decode.state import DecodeState, Prefix, ResultTokens, free_rows, request_row  # noqa: F401
from decode.steps import StepSpec
from wedlm_jax import attention_backends as attn_backends
from wedlm_jax import cache_attention as ca
from wedlm_jax import model as model_lib
from wedlm_jax import paged_attention as paged
from wedlm_jax.config import ConfigError, ModelConfig, released_mask_token_id
from wedlm_jax.sharding import DEFAULT_RULES, is_axes, spec_for, tree_shardings

ROW_ALIGN = 64
DEFAULT_KV_TILE = 256
MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request(Sampling):
    """One request: its prompt (token ids, at least one) and its Sampling settings (checked on
    construction; `Decoder.check_request` checks them against the Decoder: vocabulary, capacity)."""
    prompt: tuple
    top_logprobs: int = 0           # alternatives wanted per generated token (<= the Decoder's)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pow2_at_least(x: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, int(x) - 1).bit_length())


# ----------------------------------------------------------------------------- the Decoder

_D = EngineOptions()     # the Decoder's defaults are the doors'


class Decoder:
    """Compiled WeDLM decoding over `slots` rows of a preallocated, donated KV cache.

    method: streaming | block | ar | verified; window: W; refill: before (the official engine's
    order, up to 2W slots per forward) | after (W slots); capacity: the most positions (prompt +
    generated) a slot holds; steps_per_call: k of `generate`; sampling: whether sampled requests
    (temperature > 0) are accepted (method verified then carries [slots, S, V] draft
    distributions); mesh: a ('data', 'fsdp', 'tensor') mesh, slots over data/fsdp, heads over
    tensor; attention: the cache-attention backend (tiled, dense, pallas, cudnn, auto; see
    wedlm_jax.attention_backends); allow_long: capacity past the model's max_position_embeddings;
    memory_limit_bytes: the budget the cache and logits estimate is checked against (default:
    what the device reports, or the host's available memory on CPU).

    page_size: a paged KV cache (issue 25) of pages of that many rows, `num_pages` per layer
    (default slots x pages per sequence: the dense cache's memory), shared by the slots: a
    request holds the pages `decode.batching` gives it (`prefill_into_slot`), from a prefix it
    shares with earlier requests on. On a mesh: heads over tensor (the pool split by its K/V
    heads) and slots over data x fsdp, each slot shard with a pool of its own (num_pages / shards
    pages; a slot holds pages of its shard only). None (default): the platform's choice
    (`paged_attention.auto_page_size`: pages of 64 on TPU, where the paged step moves fewer
    bytes; the dense cache on CPU, and on GPU, where its Triton kernel steps faster than the
    paged gather path, measured on an H100); 0: the dense cache.

    top_logprobs: how many likeliest alternatives every emitted token carries beside its own
    log-probability (`ResultTokens.new_logprobs`; 0 to MAX_LOGPROBS, a compile-time width).

    weight_layout: "compiler" puts the weights in the layouts the compiled `generate` picks
    (decode/layouts.py: no relayout copy of the weights inside each TPU step), "default" keeps
    them row-major, "auto" (default) is "compiler" on TPU and "default" elsewhere."""

    def __init__(self, params, model_config: ModelConfig, *, method: str = _D.method,
                 window: int = _D.window, refill: str = _D.refill, slots: int = _D.slots,
                 capacity: int = 1024, steps_per_call: int = _D.steps_per_call,
                 dtype=jnp.float32, mesh=None, mask_token_id: int | None = None,
                 kv_tile: int = DEFAULT_KV_TILE, prefill_chunk: int = _D.prefill_chunk,
                 sampling: bool = True, allow_long: bool = _D.allow_long,
                 memory_limit_bytes: int | None = None, attention: str = "tiled",
                 page_size: int | None = None, num_pages: int | None = None,
                 top_logprobs: int = 0, weight_layout: str = "auto"):
        EngineOptions(method=method, window=window, refill=refill, slots=slots, capacity=capacity,
                      steps_per_call=steps_per_call, prefill_chunk=prefill_chunk,
                      allow_long=allow_long)                  # the doors' checks, the same code
        check_int("capacity", capacity, 1)
        check_int("kv_tile", kv_tile, 1)
        if method != "ar" and window > capacity:
            raise DecodeConfigError(f"window {window} is larger than the capacity {capacity}: "
                                    f"a slot never holds more than {capacity} positions")
        max_pos = model_config.max_position_embeddings
        if max_pos and capacity > max_pos and not allow_long:
            raise DecodeConfigError(
                f"capacity {capacity} exceeds the model's max_position_embeddings {max_pos}; "
                "positions past it were never trained (pass allow_long=True / --allow-long to "
                "decode there anyway)")
        self.method, self.window, self.refill = method, (1 if method == "ar" else window), refill
        self.slots, self.capacity, self.steps_per_call = slots, capacity, steps_per_call
        self.sampling, self.mesh, self.model_config = sampling, mesh, model_config
        self.mask_id = self._mask_id(model_config, mask_token_id, method)
        check_int("top_logprobs", top_logprobs, 0, MAX_LOGPROBS)
        spec = StepSpec(method=method, window=self.window, refill=refill, sampling=sampling,
                        top_logprobs=int(top_logprobs))
        multiple = 1 if mesh is None else int(mesh.shape.get("data", 1)) * int(mesh.shape.get("fsdp", 1))
        if slots % multiple:
            raise DecodeConfigError(f"slots {slots} must be a multiple of the mesh's data x fsdp "
                                    f"size {multiple}")
        rows = _round_up(capacity + spec.span, ROW_ALIGN)
        device = mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]
        if page_size is None and num_pages is None:      # the platform's choice (0: dense)
            page_size = paged.auto_page_size(
                device.platform, model_config.num_heads, model_config.num_kv_heads, dtype,
                1 if mesh is None else int(mesh.shape.get("tensor", 1)))
        page_size, num_pages = pool_size(page_size or None, num_pages, rows, slots, multiple)
        if page_size:
            try:
                attention = paged.choose_attention(
                    attention, device.platform, page_size, model_config.head_dim,
                    jnp.dtype(dtype).itemsize, ca.smem_limit(device))
            except ValueError as e:
                raise DecodeConfigError(str(e)) from None
            kv_tile = paged.gather_tile(device.platform, kv_tile, page_size)   # the gather path's
        elif attention == "pallas" or (attention == "auto" and attn_backends.resolve(
                "auto", "cache", backend=device.platform, dtype=dtype) == "pallas"):
            # the Triton kernel's tile must fit the device's shared memory
            q_rows = max(spec.span, prefill_chunk) * (model_config.num_heads // model_config.num_kv_heads)
            try:
                kv_tile = ca.pallas_tile(min(kv_tile, rows), q_rows, model_config.head_dim,
                                         jnp.dtype(dtype).itemsize, ca.smem_limit(device))
            except ValueError as e:
                raise DecodeConfigError(str(e)) from None
        if page_size and paged.implementation_for(device.platform) == "ragged":
            try:
                paged.check_ragged(model_config.num_heads, model_config.num_kv_heads, dtype,
                                   1 if mesh is None else int(mesh.shape.get("tensor", 1)))
            except ValueError as e:
                raise DecodeConfigError(f"--page-size on {device.platform}: {e}") from None
        shape_config = model_config.replace(mask_token_id=None, bos_token_id=None,
                                            eos_token_id=None, pad_token_id=None)
        self.static = Static(
            config=shape_config, dtype=jnp.dtype(dtype).name, spec=spec, slots=slots,
            capacity=capacity, rows=rows, kv_tile=min(kv_tile, rows),
            prefill_chunk=min(prefill_chunk, rows), keep_q=(method == "verified" and sampling),
            attention=attention,
            mesh=None if mesh is None else (tuple(mesh.axis_names), tuple(mesh.devices.shape),
                                             tuple(d.id for d in mesh.devices.flat)),
            platform=None if mesh is None else mesh.devices.flat[0].platform,
            page_size=page_size, num_pages=num_pages, page_shards=multiple if page_size else 1,
            stacked_layers=(layouts.layers_stacked(device.platform)
                            and model_lib.layers_stacked(params)))
        self.memory_estimate = estimate_memory(self.static)
        limit = memory_limit_bytes if memory_limit_bytes is not None else available_memory(mesh)
        if limit is not None and self.memory_estimate["total"] > limit:
            raise DecodeConfigError(
                f"decoding needs ~{_gib(self.memory_estimate['total'])} (KV cache "
                f"{_gib(self.memory_estimate['cache'])}, logits {_gib(self.memory_estimate['logits'])}"
                f", draft distributions {_gib(self.memory_estimate['q'])}) per device for "
                f"{slots} slots x {rows} cache rows, more than the {_gib(limit)} available; lower "
                "the capacity (--capacity / --max-new-tokens), the slots or the window")
        if not self.static.stacked_layers and model_lib.layers_stacked(params):
            # one tree per layer (decode/layouts.py); a checkpoint opened for this platform is
            # loaded so already (decode.checkpoint), with no stacked copy beside it
            params = model_lib.unstack_layers(params, model_config.num_layers)
        self._shardings = self._make_shardings(params) if mesh is not None else None
        self.params = self._place(params, self._shardings["params"]) if mesh is not None else params
        try:
            self.weight_layout = layouts.resolve(weight_layout, device.platform)
        except ValueError as e:
            raise DecodeConfigError(str(e), "weight_layout") from None
        self._generate_compiled = None
        self.compiler_options = None          # the step's, when compiled here (layouts.step_options)
        if self.weight_layout == "compiler":
            self.use_compiler_layouts()

    def use_compiler_layouts(self, compiler_options: dict | None = None) -> None:
        """Compile `generate` with the weights' layouts left to the compiler, keep that program for
        `generate` calls and put the weights into the layouts it chose (decode/layouts.py)."""
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

    @staticmethod
    def _mask_id(config: ModelConfig, given, method: str) -> int:
        mask_id = given if given is not None else config.mask_token_id
        if mask_id is None and method != "ar":   # a released `wedlm` config: its null means 151665
            try:
                mask_id = released_mask_token_id(config, "the model config", "mask_token_id=ID")
            except ConfigError as e:
                raise DecodeConfigError(str(e)) from None
        if mask_id is None:
            if method == "ar":
                return 0
            raise DecodeConfigError(
                f"method {method!r} needs a mask token id: the checkpoint's config has no "
                "mask_token_id and none was given (pass mask_token_id=... / --mask-token-id)")
        if not _is_int(mask_id) or not 0 <= int(mask_id) < config.vocab_size:
            raise DecodeConfigError(f"mask_token_id {mask_id!r} is outside the vocabulary "
                                    f"[0, {config.vocab_size})")
        return int(mask_id)

    def _make_shardings(self, params):
        mesh, config = self.mesh, self.model_config
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        axes = model_lib.param_logical_axes(config)
        if not self.static.stacked_layers:
            axes = model_lib.unstack_layers(axes, config.num_layers)
        return dict(params=tree_shardings(axes, shapes, mesh, DEFAULT_RULES))

    def _place(self, tree, shardings):
        if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree)):
            # shapes only (decode.aot compiles ahead of time for devices that may not be here)
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
        """Validate a request before any device work; raises DecodeConfigError naming the field.
        (Its own settings were checked when it was made: Sampling.) Returns it with the prompt
        as a tuple of ints."""
        if not isinstance(request, Request):
            raise DecodeConfigError(f"expected a Request, got {type(request).__name__}")
        r, vocab = request, self.model_config.vocab_size
        prompt = r.prompt
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__") or len(prompt) == 0:
            raise DecodeConfigError("prompt must be a non-empty sequence of token ids", "prompt")
        if not all(_is_int(t) and 0 <= t < vocab for t in prompt):
            bad = next(t for t in prompt if not (_is_int(t) and 0 <= t < vocab))
            raise DecodeConfigError(f"prompt: token id {bad!r} is outside the vocabulary [0, {vocab})",
                                    "prompt")
        if len(prompt) > self.capacity:
            raise DecodeConfigError(f"prompt: {len(prompt)} tokens, longer than the capacity "
                                    f"{self.capacity}", "prompt")
        if not (_is_int(r.top_logprobs) and 0 <= r.top_logprobs <= self.static.spec.top_logprobs):
            raise DecodeConfigError(f"top_logprobs must be an int in [0, {self.static.spec.top_logprobs}] "
                                    f"(the Decoder's top_logprobs), got {r.top_logprobs!r}", "top_logprobs")
        if r.temperature > 0 and not self.sampling:
            raise DecodeConfigError("temperature > 0 needs a Decoder built with sampling=True")
        if not all(s < vocab for s in r.stop_token_ids):     # ids, normalised by Sampling
            bad = next(s for s in r.stop_token_ids if s >= vocab)
            raise DecodeConfigError(f"stop_token_ids: {bad!r} is outside the vocabulary [0, {vocab})",
                                    "stop_token_ids")
        return dataclasses.replace(r, prompt=tuple(int(t) for t in prompt))

    def prompt_bucket(self, prompt_len: int) -> int:
        return min(pow2_at_least(prompt_len, MIN_PROMPT_BUCKET), self.static.rows)

    # -- the JetStream-shaped API
    def _host_free(self) -> DecodeState:
        return free_rows(self.static, self.mask_id)

    def init_state(self) -> DecodeState:
        """A state with every slot free (done)."""
        st = self.static
        host = self._host_free()
        state = host.replace(cache=host.cache.replace(layers=self._empty_layers()))
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, state)
        return self._place(state, self._state_shardings(state))

    def _host_row(self, r: Request):
        return request_row(self.static, r, self.mask_id, self.capacity)

    def prefill(self, request: Request) -> Prefix:
        """Validate and prefill one request (batch 1): its prompt K/V and first window."""
        prompt, n0, row = self._host_row(self.check_request(request))
        pb = self.prompt_bucket(len(prompt))
        tokens = np.zeros((1, pb), np.int32)
        tokens[0, :len(prompt)] = prompt
        kv = self._call(_prefill, self.static, self.params, tokens, np.asarray([n0], np.int32))
        return Prefix(kv=kv, row=jax.tree.map(jnp.asarray, row))

    def start(self, requests) -> DecodeState:
        """A fresh state holding requests[i] in slot i (None, or slots past the list: free), every
        prompt prefilled in ONE batched call: the static-batch path (`generate`), which would
        otherwise pay a prefill and an insert per request."""
        if len(requests) > self.slots:
            raise DecodeConfigError(f"{len(requests)} requests do not fit {self.slots} slots")
        host = jax.tree.map(np.array, self._host_free())
        longest = max([len(r.prompt) for r in requests if r is not None], default=1)
        pb = self.prompt_bucket(longest)
        tokens = np.zeros((self.slots, pb), np.int32)
        plen = np.zeros((self.slots,), np.int32)
        for i, r in enumerate(requests):
            if r is None:
                continue
            prompt, plen[i], row = self._host_row(self.check_request(r))
            tokens[i, :len(prompt)] = prompt
            for dst, src in zip(jax.tree.leaves(host), jax.tree.leaves(row)):
                dst[i] = src[0]
        layers = self._empty_layers()
        if self.paged:   # the static batch: fixed pages (decode.pages.static_batch_table)
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
        return self._call(_prefill_into, self.static, self.params, state, tokens, plen)

    def insert(self, prefix: Prefix, state: DecodeState, slot: int) -> DecodeState:
        """Place a prefilled request in `slot` (the state is donated). Dense cache only: a paged
        cache takes `prefill_into_slot`."""
        self._check_slot(slot)
        if self.paged:
            raise DecodeConfigError("a paged cache admits requests with prefill_into_slot")
        return self._call(_insert, self.static, state, prefix, jnp.int32(slot))

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
        if not _is_int(start) or start % page or not 0 <= start <= n0:
            raise DecodeConfigError(f"start must be a multiple of the page size {page} in [0, "
                                    f"{n0}], got {start!r}")
        suffix = list(prompt[start:n0]) or [0]
        tokens = np.zeros((1, self.prompt_bucket(len(suffix))), np.int32)
        tokens[0, :len(suffix)] = suffix
        table = np.full((per_seq,), paged.UNMAPPED, np.int32)
        table[:len(pages)] = pages
        return self._call(_prefill_slot, self.static, self.params, state,
                          jax.tree.map(jnp.asarray, row), jnp.int32(slot), jnp.asarray(table),
                          jnp.asarray(tokens), jnp.int32(start), jnp.int32(n0),
                          jnp.int32(self.mask_id))

    def free(self, state: DecodeState, slot: int) -> DecodeState:
        """Mark `slot` done (a cancelled request); a paged cache's page row is unmapped too.
        The state is donated."""
        self._check_slot(slot)
        if self.paged:
            return self.unmap(state, [slot])
        return self._call(_free, self.static, state, jnp.int32(slot))

    def unmap(self, state: DecodeState, slots) -> DecodeState:
        """Paged cache: `slots` done and their page rows unmapped (before their pages go to
        another request). The state is donated."""
        mask = np.zeros((self.slots,), bool)
        mask[list(slots)] = True
        return self._call(_unmap, self.static, state, jnp.asarray(mask))

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
        return self._call(_set_rows, self.static, state, jnp.asarray(which), jnp.asarray(table))

    def copy_pages(self, state: DecodeState, src, dst) -> DecodeState:
        """Paged cache: pages `dst` (global ids) made copies of pages `src`, every layer; at most
        a sequence's pages at once (one compiled program). The state is donated."""
        per_seq = self.static.pages_per_seq
        if len(src) != len(dst) or len(src) > per_seq:
            raise DecodeConfigError(f"copy_pages takes as many destination pages as source pages, "
                                    f"at most {per_seq}; got {len(src)} and {len(dst)}")
        pad = lambda ids: np.asarray(list(ids) + [paged.UNMAPPED] * (per_seq - len(ids)), np.int32)
        return self._call(_copy_pages, self.static, state, jnp.asarray(pad(src)),
                          jnp.asarray(pad(dst)))

    def _check_slot(self, slot) -> None:
        if not _is_int(slot) or not 0 <= slot < self.slots:
            raise DecodeConfigError(f"slot must be an int in [0, {self.slots}), got {slot!r}")

    def _empty_layers(self):
        st = self.static
        if st.paged:
            c = st.config
            return paged.init_paged_cache(c.num_layers, st.num_pages, st.page_size, c.num_kv_heads,
                                          c.head_dim, st.slots, st.pages_per_seq, jnp.dtype(st.dtype))
        return model_lib.init_kv_cache(st.config, st.slots, st.rows, jnp.dtype(st.dtype))

    def live_buckets(self) -> list[int]:
        """The live-slot buckets `generate(live=...)` steps alone (powers of two below `slots`):
        a paged cache with one slot shard and row-major weights; none otherwise (the dense
        cache's rows would be copied out and back; the compiler-layout program is compiled
        for all the slots)."""
        st = self.static
        if not st.paged or st.page_shards != 1 or self._generate_compiled is not None:
            return []
        return [b for b in (1 << i for i in range(st.slots.bit_length())) if b < st.slots]

    def generate(self, state: DecodeState, k: int | None = None, live=None):
        """Run up to k (default and at most steps_per_call; 0 compiles and runs nothing) steps of
        every live slot in one jitted call, fewer when slots that had emitted nothing (just
        inserted) all have their first tokens. Returns (state, ResultTokens).

        live: the slots holding requests, when the caller knows them (the Batcher does): with a
        paged cache the call then steps only the smallest `live_buckets` bucket holding them
        (padded with free slots), one compiled program per bucket; slots left out do not move.
        The tokens are the same as a call over every slot."""
        k = self.steps_per_call if k is None else k
        if not _is_int(k) or not 0 <= k <= self.steps_per_call:
            raise DecodeConfigError(f"k must be an int in [0, {self.steps_per_call}], got {k!r}")
        mask_id, run = jnp.int32(self.mask_id), jnp.int32(k)
        idx = self._bucket(live) if live is not None else None
        if self._generate_compiled is not None:     # the weights in the compiler's layouts
            state, toks, lps, counts, steps = self._generate_compiled(self.params, state, mask_id, run)
        elif idx is not None:
            state, toks, lps, counts, steps = self._call(
                _generate_live, self.static, self.steps_per_call, self.params, state,
                jnp.asarray(idx), mask_id, run)
        else:
            state, toks, lps, counts, steps = self._call(_generate, self.static, self.steps_per_call,
                                                         self.params, state, mask_id, run)
        toks, lps, counts, steps, done = jax.device_get((toks, lps, counts, steps, state.done))
        return state, ResultTokens(tokens=toks, counts=counts, steps=int(steps), done=done,
                                   logprobs=lps)

    def compile_steps(self, state: DecodeState) -> DecodeState:
        """Compile, by running them as no-ops, the programs a serving loop calls after admission:
        `generate` for every live-slot bucket and for every slot, and with a paged cache the page
        table's updates (`set_page_rows`, `unmap`, `copy_pages` across slot shards). The state
        is donated and comes back unchanged."""
        for size in self.live_buckets() + [self.slots]:
            state, _ = self.generate(state, 0, live=range(size))     # runs no step
        if self.paged:
            state = self.unmap(self.set_page_rows(state, {}), [])
            if self.static.page_shards > 1:
                state = self.copy_pages(state, [], [])
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
        taken = set(live)
        pad = [s for s in range(self.slots) if s not in taken][:size - len(live)]
        return np.asarray(live + pad, np.int32)

    def step_with_aux(self, state: DecodeState):
        """One step (not donated) with its aux dict: for traces and checks."""
        return self._call(_one_step, self.static, self.params, state, jnp.int32(self.mask_id))


__all__ = ["Decoder", "Request", "ResultTokens", "Static", "estimate_memory", "available_memory",
           "DEFAULT_KV_TILE", "pow2_at_least"]
