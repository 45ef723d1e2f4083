"""The Decoder's compiled programs (decode/engine/runtime/decoder.py drives them): each a jitted pure function
of the static settings (`Static`, hashable: Decoders with equal settings share the programs) and
of donated state.

    prefill        one prompt's K/V (batch 1, dense) for `insert`
    prefill_into   every slot's prompt straight into the state's cache (the static batch)
    insert         a prefilled request into a slot
    prefill_slot   paged cache: a prompt's rows from `start` on written straight into the pool
                    through the slot's page row, and the slot's fields set (no dense copy; the
                    rows before `start` are a reused prefix)
    free / unmap  a slot done (and, paged, its page row unmapped: its pages may go to another)
    set_rows       paged cache: slots' page rows replaced (pages mapped as a sequence grows)
    copy_pages     paged cache: pages made copies of others (a prefix cached in another shard)
    generate       up to k steps of every slot in one `lax.while_loop`
    generate_live  paged cache: the same over a live-slot bucket (the live slots gathered,
                    stepped, scattered back; one program per power-of-two bucket)
    one_step       one step with its aux (traces, checks)

Dense cache: layers {'k', 'v'} [L, B, R, KVH, D]. Paged cache: layers {'pool': [L * P, page,
2 KVH, D], 'table': [B, pages_per_seq]} (wedlm_jax.attention.paged); the model's cache mode
takes either, so the decoding steps are the same code for both.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from decode.engine.step.state import DecodeState, Prefix, TokenLogProbs
from decode.engine.step.steps import StepSpec, ar_step, window_step
from decode.engine.step.verified import verified_step
from wedlm_jax import model as model_lib
from wedlm_jax.attention import kv_quant, paged
from wedlm_jax.attention.table import TILED
from wedlm_jax.config import ModelConfig
from wedlm_jax.sharding import is_axes


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything that shapes the compiled programs."""
    config: ModelConfig        # token ids stripped (runtime values)
    dtype: str
    spec: StepSpec
    slots: int
    capacity: int
    rows: int                  # cache rows R >= capacity + span
    kv_tile: int
    prefill_chunk: int
    keep_q: bool               # verified with sampling carries the drafts' distributions
    attention: str = TILED     # the cache-attention backend (wedlm_jax.attention.table)
    mesh: Any = None           # a hashable key of the mesh (or None)
    scan_unroll: int = 1       # layers per iteration of the layer scan (decode.compile.aot's cost counts)
    platform: str | None = None  # the mesh's platform the attention is resolved for (None: jax's)
    page_size: int = 0         # the paged cache's rows per page (0: the dense cache)
    num_pages: int = 0         # paged: pages per layer in the pool
    page_shards: int = 1       # paged: slot shards (data x fsdp), each with its own num_pages / page_shards
    stacked_layers: bool = True  # the weights' layers stacked (a layer scan) or one tree per layer
    quantize: str = "none"     # the weights' quantization (wedlm_jax.quantize) and its group size
    quantize_group: int = 0
    kv_dtype: str = "auto"     # the KV cache's: auto (dtype) | int8 (wedlm_jax.attention.kv_quant)
    grouped_matmul: str = "xla"  # a grouped kernel's matmul: xla | pallas (wedlm_jax.grouped_matmul)
    max_loras: int = 0         # LoRA adapter table rows besides the base (0: no table, no code)
    max_lora_rank: int = 0     # the table's rank (wedlm_jax.lora.table)
    rung: int = 0              # generate at a smaller window over the same state (0: the plan's)

    @property
    def cache_dtype(self):
        """The cache buffers' dtype (int8: rows with their scales, `kv_quant`)."""
        return kv_quant.storage_dtype(self.kv_dtype, self.dtype)

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def pages_per_seq(self) -> int:
        return -(-self.rows // self.page_size) if self.page_size else 0

    @property
    def pages_per_shard(self) -> int:
        return self.num_pages // self.page_shards

    def shard_of(self, slot: int) -> int:
        """The slot shard holding `slot` (slots split evenly over data x fsdp, in order)."""
        return slot // (self.slots // self.page_shards)

    @property
    def span(self) -> int:
        return self.spec.span


STEPS = {"streaming": window_step, "block": window_step, "ar": ar_step, "verified": verified_step}


def network(static: Static, adapter=None):
    """The network in cache mode: (params, tokens, positions, cache layers, n) -> (logits, layers).
    Cache attention reads only the cache tiles holding live keys (`kv_tile` rows each).
    `adapter` [B]: each row's LoRA table row (the state's `lora`; None: no adapter code)."""
    model = model_lib.Transformer(static.config, dtype=jnp.dtype(static.dtype),
                                  attention=static.attention, kv_tile=static.kv_tile,
                                  scan_unroll=static.scan_unroll, platform=static.platform,
                                  stacked_layers=static.stacked_layers,
                                  grouped_matmul=static.grouped_matmul)

    def forward(params, tokens, positions, layers, n):
        extra = {} if adapter is None else {"lora_index": adapter}
        return model.apply({"params": params}, tokens, positions, kv_cache=layers, cache_len=n,
                           **extra)
    return forward


def cache_axes(static: Static):
    """The logical axes of the state's cache layers: dense or paged."""
    return (paged.paged_cache_logical_axes() if static.paged
            else model_lib.kv_cache_logical_axes(static.config))


def _constrain_state(static: Static, st):
    """Pin the state's layout (slots over data/fsdp; a no-op without a mesh)."""
    if static.mesh is None:
        return st
    axes = cache_axes(static)
    layers = jax.tree.map(lambda ax, x: nn.with_logical_constraint(x, ax), axes, st.cache.layers,
                          is_leaf=is_axes)
    rest = jax.tree.map(lambda x: nn.with_logical_constraint(x, ("batch",) + (None,) * (x.ndim - 1)),
                        st.replace(cache=st.cache.replace(layers=None)))
    return rest.replace(cache=rest.cache.replace(layers=layers))


@functools.partial(jax.jit, static_argnums=(0,))
def prefill(static: Static, params, tokens, prefill_len, adapter=None):
    """K/V of rows 0..prefill_len-1 of one prompt ([1, Pb] tokens) in chunks; the trip count
    ceil(prefill_len / chunk) is a runtime value; the last chunk's start is pulled back inside the
    buffer (recomputing final rows gives the same values). `adapter` [1]: its LoRA row."""
    pb = tokens.shape[1]
    chunk = min(static.prefill_chunk, pb)
    forward = network(static, adapter)
    kv = model_lib.init_kv_cache(static.config, 1, pb, static.cache_dtype)

    def body(k, kv):
        start = jnp.minimum(k * chunk, pb - chunk)
        toks = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        pos = start + jnp.arange(chunk, dtype=jnp.int32)[None, :]
        _, kv = forward(params, toks, pos, kv, jnp.full((1,), start, jnp.int32))
        return kv

    return jax.lax.fori_loop(0, (prefill_len[0] + chunk - 1) // chunk, body, kv)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def prefill_into(static: Static, params, state: DecodeState, tokens, prefill_len):
    """Every slot's prompt K/V (rows 0..prefill_len[b]-1, tokens [B, Pb]) written straight into
    the state's cache in chunks: the static-batch prefill (`Decoder.start`)."""
    pb = tokens.shape[1]
    chunk = min(static.prefill_chunk, pb)
    forward = network(static, state.lora)
    b = tokens.shape[0]

    def body(k, layers):
        start = jnp.minimum(k * chunk, pb - chunk)
        toks = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        pos = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
        _, layers = forward(params, toks, pos, layers, jnp.full((b,), start, jnp.int32))
        return layers

    n = (jnp.max(prefill_len) + chunk - 1) // chunk
    layers = jax.lax.fori_loop(0, n, body, state.cache.layers)
    return _constrain_state(static, state.replace(cache=state.cache.replace(layers=layers)))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def insert(static: Static, state: DecodeState, prefix: Prefix, slot):
    """Write a prefilled request into `slot`: its K/V rows 0..Pb-1 and its row of every field."""
    axes = model_lib.kv_cache_logical_axes(static.config)

    def put_kv(ax, full, part):
        starts = [slot if a == "batch" else 0 for a in ax]
        return jax.lax.dynamic_update_slice(full, part.astype(full.dtype), starts)

    layers = jax.tree.map(put_kv, axes, state.cache.layers, prefix.kv, is_leaf=is_axes)
    put = lambda full, part: jax.lax.dynamic_update_index_in_dim(full, part[0].astype(full.dtype),
                                                                  slot, 0)
    bare = lambda st: st.replace(cache=st.cache.replace(layers=None))
    rest = jax.tree.map(put, bare(state), bare(prefix.row))
    return _constrain_state(static, rest.replace(cache=rest.cache.replace(layers=layers)))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def free(static: Static, state: DecodeState, slot):
    return state.replace(done=state.done.at[slot].set(True))


def at_rung(static: Static, window: int) -> Static:
    """The programs that step `static`'s state with a window of `window` slots (a rung of the
    window ladder, decode/engine/runtime/window_policy.py); the plan's own window: `static`."""
    return dataclasses.replace(static, rung=0 if window == static.spec.window else window)


def narrow(state: DecodeState, span: int) -> DecodeState:
    """The state's window cut to its first `span` slots (a smaller rung). The slots cut hold only
    guesses nothing has committed (streaming's filled masks, verified's drafts): they go, and
    each method's next step fills again what it needs. The Guide's `recent` keeps its width: the
    tokens committed in the call before may be more than the rung's span."""
    cut = lambda a: None if a is None else a[:, :span]
    return state.replace(tok=state.tok[:, :span], filled=state.filled[:, :span],
                         lps=state.lps.head(span), q=cut(state.q))


def widen(state: DecodeState, span: int, mask_id) -> DecodeState:
    """A rung's state back at the plan's window of `span` slots: the slots added are [MASK]s."""
    pad = lambda a, value: jnp.concatenate(
        [a, jnp.full((a.shape[0], span - a.shape[1]) + a.shape[2:], value, a.dtype)], axis=1)
    lps = jax.tree.map(lambda a: pad(a, 0), state.lps)
    return state.replace(tok=pad(state.tok, mask_id), filled=pad(state.filled, False), lps=lps,
                         q=None if state.q is None else pad(state.q, 0))


def _rung_loop(static: Static, k: int, params, state: DecodeState, mask_id, run):
    """`generate_loop` at `static.rung`: the state narrowed to the rung's span, stepped by the
    rung's programs, widened back. Outputs [B, k, E] with E the rung's emit width. Verified's
    rung of one slot is AR's step itself (the same state: the pending token in slot 0, no
    drafts), not verified's with nothing to verify."""
    ar = static.rung == 1 and static.spec.method == "verified"
    spec = dataclasses.replace(static.spec, window=static.rung, method="ar" if ar else
                               static.spec.method)
    inner = dataclasses.replace(static, spec=spec, rung=0)
    sub, toks, lps, counts, i = generate_loop(inner, k, params, narrow(state, spec.span), mask_id,
                                              run)
    return widen(sub, static.spec.span, mask_id), toks, lps, counts, i


def generate_loop(static: Static, k: int, params, state: DecodeState, mask_id, run):
    """Up to `run` (a runtime value <= k) steps of every slot. Returns (state, tokens [B, k, E],
    their TokenLogProbs [B, k, E, ..], counts [B, k], steps run).

    The loop also ends once every slot that came in live with nothing emitted yet (a request
    just admitted) has emitted its first tokens or finished: those tokens go back to the host
    then, not after the rest of the k steps (a request's time to first token is its prefill
    plus the steps that make its first commit)."""
    if static.rung:
        return _rung_loop(static, k, params, state, mask_id, run)
    step = STEPS[static.spec.method]
    forward = network(static, state.lora)     # a slot's adapter stays through the call
    b, e = static.slots, static.spec.emit_width
    fresh = ~state.done & (state.count == 0)

    def cond(carry):
        i, st, _, _, _ = carry
        first_out = jnp.any(fresh) & ~jnp.any(fresh & ~st.done & (st.count == 0))
        return (i < jnp.minimum(run, k)) & ~jnp.all(st.done) & ~first_out

    def body(carry):
        i, st, toks, lps, counts = carry
        st, emitted, emitted_lps, k_emit, _ = step(forward, params, st, static.spec, mask_id)
        lps = jax.tree.map(lambda buf, x: buf.at[:, i].set(x), lps, emitted_lps)
        return (i + 1, _constrain_state(static, st), toks.at[:, i].set(emitted), lps,
                counts.at[:, i].set(k_emit))

    top = static.spec.top_logprobs
    lps = TokenLogProbs(lp=jnp.zeros((b, k, e), jnp.float32),
                        top_ids=jnp.zeros((b, k, e, top), jnp.int32),
                        top_lp=jnp.zeros((b, k, e, top), jnp.float32))
    init = (jnp.zeros((), jnp.int32), state, jnp.zeros((b, k, e), jnp.int32), lps,
            jnp.zeros((b, k), jnp.int32))
    i, state, toks, lps, counts = jax.lax.while_loop(cond, body, init)
    return state, toks, lps, counts, i


generate = functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))(generate_loop)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def generate_live(static: Static, k: int, params, state: DecodeState, idx, mask_id, run):
    """Paged cache: `generate` over the slots `idx` [b] alone (b < slots, a live-slot bucket:
    the live slots padded with free ones, no slot twice): their rows gathered, stepped with the
    shared pool, and scattered back; the other slots are left as they are. Outputs as
    `generate`'s, [B, ..] (zeros in the slots not stepped). A step depends only on its own row
    (its tokens, its cache rows through its page row, its seed and step count), so the gathered
    slots emit what the full batch would; a step computes b rows instead of B (a lone
    request after a reused prefix no longer pays for the idle slots)."""
    layers = state.cache.layers
    bare = lambda st: st.replace(cache=st.cache.replace(layers=None))
    sub = jax.tree.map(lambda x: x[idx], bare(state))
    sub = sub.replace(cache=sub.cache.replace(
        layers={"pool": layers["pool"], "table": layers["table"][idx]}))
    sub_static = dataclasses.replace(static, slots=idx.shape[0])
    sub, toks, lps, counts, i = generate_loop(sub_static, k, params, sub, mask_id, run)
    rest = jax.tree.map(lambda full, part: full.at[idx].set(part), bare(state), bare(sub))
    table = layers["table"].at[idx].set(sub.cache.layers["table"])
    state = rest.replace(cache=rest.cache.replace(
        layers={"pool": sub.cache.layers["pool"], "table": table}))
    widen = lambda x: jnp.zeros((static.slots,) + x.shape[1:], x.dtype).at[idx].set(x)
    return (_constrain_state(static, state), widen(toks), jax.tree.map(widen, lps), widen(counts),
            i)


@functools.partial(jax.jit, static_argnums=(0,))
def one_step(static: Static, params, state: DecodeState, mask_id):
    """One step with its aux (the trace and the cache-consistency checks)."""
    new, emitted, emitted_lps, k_emit, aux = STEPS[static.spec.method](
        network(static, state.lora), params, state, static.spec, mask_id)
    return new, dict(aux, emitted_tokens=emitted, emitted_lps=emitted_lps, emitted_count=k_emit)


def fills_at_prefill(static: Static) -> bool:
    """Whether a paged admission runs the request's first step in its prefill call: streaming and
    block, whose first step only fills (nothing is filled before it, so it commits nothing)."""
    return static.paged and static.spec.method in ("streaming", "block")


def _behind_suffix(forward, tokens, start, suffix_len):
    """A forward for a window step at rows n = start + suffix_len .. that also computes a chunk of
    the prompt (tokens [1, C] at rows start.., its first `suffix_len` real, the prompt's last)
    in the same pass: those tokens, then the window's right behind them (rows n.. in physical
    order, as the step alone writes them), then the chunk's padding. Causal attention in
    physical order gives the window what the step alone sees (the prompt's rows, then the
    window), and the chunk what it sees alone (nothing behind it); the padding's rows are past
    the window, written over before they are read (or dropped past the pages). Returns the
    window's logits only."""
    c = tokens.shape[1]

    def step_forward(params, win_tok, win_pos, layers, n):
        span = win_tok.shape[1]
        toks = jnp.concatenate([tokens, jnp.zeros((1, span), tokens.dtype)], axis=1)
        toks = jax.lax.dynamic_update_slice_in_dim(toks, win_tok.astype(toks.dtype), suffix_len, 1)
        pos = start + jnp.arange(c + span, dtype=jnp.int32)[None, :]
        pos = jax.lax.dynamic_update_slice_in_dim(pos, win_pos.astype(jnp.int32), suffix_len, 1)
        logits, layers = forward(params, toks, pos, layers, jnp.reshape(start, (1,)))
        return jax.lax.dynamic_slice_in_dim(logits, suffix_len, span, axis=1), layers
    return step_forward


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def prefill_slot(static: Static, params, state: DecodeState, row: DecodeState, slot, pages,
                  tokens, start, prefill_len, mask_id):
    """Paged cache: set `slot`'s page row to `pages` [pages_per_seq], compute rows start ..
    prefill_len-1 of its prompt in chunks straight into the pool (tokens [1, Pb]: the prompt from
    row `start` on; rows before `start` are a reused prefix, read, never written), and put the
    request's first `row` (a batch-1 DecodeState without layers) into the slot. Streaming and
    block (`fills_at_prefill`) then run the request's first step here, on its row alone: the
    window's first fill, which emits nothing, so the first generate step can already commit
    (one forward less to the first tokens; a step depends only on its own row, so the tokens
    are those of the step run in `generate`). That step's forward also computes the prompt's
    last chunk (`_behind_suffix`): one pass over the weights less per admission."""
    pb = tokens.shape[1]
    chunk = min(static.prefill_chunk, pb)
    forward = network(static, row.lora)
    table = state.cache.layers["table"].at[slot].set(pages)

    def body(k, pool):
        local = jnp.minimum(k * chunk, pb - chunk)       # pulled back inside the suffix only
        toks = jax.lax.dynamic_slice_in_dim(tokens, local, chunk, axis=1)
        pos = start + local + jnp.arange(chunk, dtype=jnp.int32)[None, :]
        _, layers = forward(params, toks, pos, {"pool": pool, "table": pages[None]},
                            jnp.reshape(start + local, (1,)))
        return layers["pool"]

    n = (prefill_len - start + chunk - 1) // chunk
    if not fills_at_prefill(static):
        pool = jax.lax.fori_loop(0, n, body, state.cache.layers["pool"])
    else:   # every chunk but the last, then the last with the first fill's window behind it
        pool = jax.lax.fori_loop(0, jnp.maximum(n - 1, 0), body, state.cache.layers["pool"])
        local = jnp.minimum(jnp.maximum(n - 1, 0) * chunk, pb - chunk)
        last = jax.lax.dynamic_slice_in_dim(tokens, local, chunk, axis=1)
        step_forward = _behind_suffix(forward, last, start + local, prefill_len - start - local)
        one = row.replace(cache=row.cache.replace(layers={"pool": pool, "table": pages[None]}))
        one = STEPS[static.spec.method](step_forward, params, one, static.spec, mask_id)[0]
        pool, row = one.cache.layers["pool"], one.replace(cache=one.cache.replace(layers=None))
    put = lambda full, part: jax.lax.dynamic_update_index_in_dim(full, part[0].astype(full.dtype),
                                                                  slot, 0)
    bare = lambda st: st.replace(cache=st.cache.replace(layers=None))
    rest = jax.tree.map(put, bare(state), bare(row))
    return rest.replace(cache=rest.cache.replace(layers={"pool": pool, "table": table}))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def copy_pages(static: Static, state: DecodeState, src, dst):
    """Paged cache: pages `dst` [pages_per_seq] (global ids, -1 padding) made copies of pages `src`
    in every layer (a prefix cached in another slot shard's pool)."""
    c = static.config
    pool = paged.copy_pages(state.cache.layers["pool"], src, dst, c.num_layers, c.num_heads,
                            c.num_kv_heads)
    return state.replace(cache=state.cache.replace(layers=dict(state.cache.layers, pool=pool)))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def unmap(static: Static, state: DecodeState, slots):
    """Paged cache: the slots where `slots` [B] is True are done and their page rows unmapped, so
    the forwards that still run over them write nothing into pages handed to others."""
    table = jnp.where(slots[:, None], paged.UNMAPPED, state.cache.layers["table"])
    return state.replace(done=state.done | slots,
                         cache=state.cache.replace(layers=dict(state.cache.layers, table=table)))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def set_rows(static: Static, state: DecodeState, which, table):
    """Paged cache: the page rows of the slots where `which` [B] is True set to `table`'s rows
    ([B, pages_per_seq]): pages mapped as sequences grow (decode.engine.runtime.batcher)."""
    old = state.cache.layers["table"]
    new = jnp.where(which[:, None], table, old)
    return state.replace(cache=state.cache.replace(layers=dict(state.cache.layers, table=new)))


def compiled_count() -> int:
    """How many programs the decoder's jitted functions hold (jax's cache; a compile-once check)."""
    return sum(f._cache_size() for f in (prefill, prefill_into, insert, free, generate,
                                         generate_live, one_step, prefill_slot, unmap,
                                         set_rows, copy_pages))
