"""The decoding engine: chunked prefill, then ONE jitted `lax.while_loop` over a preallocated KV cache.

    result = generate(params, model_config, [[1, 2, 3], [4, 5]], DecodeConfig(method="streaming"))

Methods (SPEC.md section 3, the paper's Algorithm 1):

streaming  Each step, per row, with committed length `n` (cache rows 0..n-1 final) and a window of
           up to W slots at logical positions n, n+1, ... (each *filled* or [MASK]):
             1. reorder: physical order = filled slots ascending, then masks ascending (positions kept);
             2. forward the W slots on the cache at rows n.. (kv rows n + physical index);
             3. commit the leading filled run c (flags from BEFORE this step's fill: those slots were
                fed as filled tokens, so rows n..n+c-1 are final); emit them, stopping at the first
                stop token (inclusive); n += c;
             4. fill: entropy H_i of each remaining mask slot, d_i = i - (index of the first
                remaining mask), fill all with H_i + lam * d_i < tau, else the argmin; tokens are
                sampled from the mask slot's own logits (mask reading; greedy at temperature 0);
             5. slide: drop the c committed slots, append masks up to W, never past the row's budget
                min(prompt_len + max_new_tokens, capacity).
           The engine fills AFTER the forward (SPEC order), so every forward holds at most W slots.
block      The same step with commit restricted to "all slots of the block filled": a block of W
           masks is resolved by the fill rule while nothing is committed; the forward that sees it
           all filled (natural order) writes its final K/V and commits it whole; then a new block.
ar         Cached next-token decoding (AR reading): prefill rows 0..P-2; each step feeds the pending
           token at position n, whose logits give the token at n + 1 (greedy or sampled).
verified   Streaming drafts with AR-verified commits (`decode.verified`, issue 7): output equal to
           `ar` (token for token when greedy, in distribution when sampling); AR's prefill
           convention, the pending token in window slot 0; counts accepted/rejected drafts.

Rows of different prompt lengths batch together; a finished row stops changing; the loop ends when
every row is finished. Compiles once per (batch bucket, capacity bucket, W, method, greedy/sampled,
prefill chunk, kv tile): prompt lengths, max_new_tokens, tau, lambda, temperature, top-k, top-p,
stop ids and the seed are runtime values.

Cache layout: [B, R, kv_heads, head_dim] per layer with R = round_up(capacity_bucket + W, 64): the
forward always writes W rows at n <= capacity, so the W rows of headroom keep the write in bounds.
Attention reads only the tiles up to max(n) + W (model `kv_tile`), not R.

Metrics: per row, `steps` = forwards while the row was live, `n_gen` = tokens emitted, `n_fwd` =
token slots those forwards processed for the row (its live window slots; AR: 1 per step),
`tokens_per_forward = n_gen / steps`, `p_cache = n_gen / n_fwd`. Totals sum the rows;
`loop_iterations` counts batched forwards.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from decode.config import (MAX_STOP_IDS, DecodeConfig, DecodeConfigError, check_prompts,
                           resolve_mask_token)
from wedlm_jax import model as model_lib
from wedlm_jax.config import ModelConfig
from wedlm_jax.sharding import DEFAULT_RULES, spec_for, tree_shardings

ROW_ALIGN = 64
DEFAULT_KV_TILE = 256
MIN_CAPACITY_BUCKET = 64


# ----------------------------------------------------------------------------------- static setup

@dataclasses.dataclass(frozen=True)
class Static:
    """Everything that shapes the compiled program (the compile key, with the model config)."""
    method: str
    window: int
    greedy: bool
    batch: int
    capacity_bucket: int
    rows: int           # cache rows R
    prefill_chunk: int
    kv_tile: int
    stream: bool = False

    @property
    def slots(self) -> int:  # slots per forward
        return 1 if self.method == "ar" else self.window

    @property
    def out_len(self) -> int:
        return self.capacity_bucket + self.slots


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pow2_at_least(x: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, int(x) - 1).bit_length())


def capacity_bucket(capacity: int) -> int:
    return _pow2_at_least(capacity, MIN_CAPACITY_BUCKET)


def batch_bucket(batch: int, multiple: int = 1) -> int:
    return _round_up(_pow2_at_least(batch), multiple)


def make_static(dc: DecodeConfig, batch: int, capacity: int, kv_tile: int = DEFAULT_KV_TILE,
                batch_multiple: int = 1, stream: bool = False) -> Static:
    cap_b = capacity_bucket(capacity)
    slots = 1 if dc.method == "ar" else dc.window
    rows = _round_up(cap_b + slots, ROW_ALIGN)
    return Static(method=dc.method, window=slots, greedy=dc.greedy,  # AR: W plays no part
                  batch=batch_bucket(batch, batch_multiple), capacity_bucket=cap_b, rows=rows,
                  prefill_chunk=min(dc.prefill_chunk, rows), kv_tile=min(kv_tile, rows), stream=stream)


# ----------------------------------------------------------------------------------- sampling

def entropy(logits: jnp.ndarray) -> jnp.ndarray:
    """Entropy (nats) of softmax(logits) over the last axis, float32, with one exp pass:
    H = log Z - sum(e * x') / Z where x' = x - max(x), e = exp(x'), Z = sum(e)."""
    x = logits.astype(jnp.float32)
    x = x - jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x)
    z = jnp.sum(e, axis=-1)
    return jnp.log(z) - jnp.sum(e * x, axis=-1) / z


def filter_logits(logits: jnp.ndarray, temperature, top_k, top_p) -> jnp.ndarray:
    """Temperature, then top-k (k = 0: off), then top-p (nucleus; 1: off) over the last axis. Tokens
    removed get -inf. All three are runtime values."""
    v = logits.shape[-1]
    x = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    desc = -jnp.sort(-x, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1] + (1,)), axis=-1)
    x = jnp.where(x < kth, -jnp.inf, x)
    desc = jnp.where(jnp.arange(v) < k, desc, -jnp.inf)
    p = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(p, axis=-1) - p           # mass strictly before each sorted token
    keep = (before < top_p) & (jnp.arange(v) < k)
    thresh = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x < thresh, -jnp.inf, x)


def sample_tokens(logits: jnp.ndarray, keys: jnp.ndarray, knobs: dict, greedy: bool) -> jnp.ndarray:
    """logits [B, S, V] -> token ids [B, S]; one PRNG key per row."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = filter_logits(logits, knobs["temperature"], knobs["top_k"], knobs["top_p"])
    return jax.vmap(lambda k, l: jax.random.categorical(k, l, axis=-1))(keys, x).astype(jnp.int32)


def _row_keys(seed, step_count):
    """One key per row from (seed, row index, the row's own step count): a row's draws do not depend
    on the batch it shares."""
    base = jax.random.key(seed)
    rows = jnp.arange(step_count.shape[0])
    return jax.vmap(lambda r, s: jax.random.fold_in(jax.random.fold_in(base, r), s))(rows, step_count)


# ----------------------------------------------------------------------------------- the network

def _forward(model, params, tokens, positions, cache, cache_len, kv_tile):
    return model.apply({"params": params}, tokens, positions, kv_cache=cache, cache_len=cache_len,
                       kv_tile=kv_tile)


def prefill(model, params, cache, prompt_tokens, prefill_len, static: Static):
    """Write K/V of prompt rows 0..prefill_len[b]-1 in chunks of `prefill_chunk`. The trip count
    ceil(max(prefill_len) / chunk) is a runtime value; the last chunk's start is pulled back so it
    stays inside the buffer (it recomputes rows that are already final: same values). Rows past a
    row's own prompt get K/V of padding, which the window overwrites before anything reads them."""
    b = prompt_tokens.shape[0]
    chunk, rows = static.prefill_chunk, static.rows
    n_chunks = (jnp.max(prefill_len) + chunk - 1) // chunk

    def body(k, cache):
        start = jnp.minimum(k * chunk, rows - chunk)
        toks = jax.lax.dynamic_slice_in_dim(prompt_tokens, start, chunk, axis=1)
        pos = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
        _, cache = _forward(model, params, toks, pos, cache, jnp.full((b,), start, jnp.int32),
                            static.kv_tile)
        return cache

    return jax.lax.fori_loop(0, n_chunks, body, cache)


# ----------------------------------------------------------------------------------- one step

def _write_out(out, count, tokens, num):
    """out[b, count[b] + j] = tokens[b, j] for j < num[b]."""
    s = tokens.shape[1]

    def one(o, c, t, k):
        old = jax.lax.dynamic_slice_in_dim(o, c, s)
        return jax.lax.dynamic_update_slice_in_dim(o, jnp.where(jnp.arange(s) < k, t, old), c, 0)
    return jax.vmap(one)(out, count, tokens, num)


def _keep(done, new, old):
    d = done.reshape(done.shape + (1,) * (new.ndim - done.ndim))
    return jnp.where(d, old, new)


def fill_select(ent, remaining, idx, knobs):
    """The fill rule (SPEC 3, step 4) over the `remaining` mask slots [B, W]: adjusted entropy
    H_i + lam * (i - first remaining); every slot below tau, else the single lowest."""
    any_rem = jnp.any(remaining, axis=1, keepdims=True)
    first = jnp.argmax(remaining, axis=1)[:, None]
    adj = jnp.where(remaining, ent + knobs["lam"] * (idx - first).astype(jnp.float32), jnp.inf)
    sel = remaining & (adj < knobs["tau"])
    best = idx == jnp.argmin(adj, axis=1)[:, None]
    return sel | (~jnp.any(sel, axis=1, keepdims=True) & any_rem & best)


def slide(tok, filled, shift, mask_id):
    """Drop the first `shift[b]` window slots of each row and append [MASK] slots (SPEC 3, step 5)."""
    w = tok.shape[1]
    src = jnp.arange(w, dtype=jnp.int32)[None, :] + shift[:, None]
    inside = src < w
    src = jnp.minimum(src, w - 1)
    return (jnp.where(inside, jnp.take_along_axis(tok, src, axis=1), mask_id),
            inside & jnp.take_along_axis(filled, src, axis=1))


def window_step(model, params, state: dict, knobs: dict, static: Static):
    """One streaming (or block) step for every row. Returns (new_state, aux) where aux holds the
    forward's inputs and logits (physical order) for the cache-consistency checks."""
    w = static.window
    tok, filled, n, end, done = state["tok"], state["filled"], state["n"], state["end"], state["done"]
    idx = jnp.arange(w, dtype=jnp.int32)[None, :]
    wlen = jnp.clip(end - n, 0, w)[:, None]
    active = idx < wlen
    filled = filled & active
    # 1. reorder: filled (ascending), then masks (ascending), then inactive padding slots.
    #    inv[i] = physical index of logical slot i (ranks by cumsum, no sort); order = its inverse.
    is_mask = active & ~filled
    n_filled = jnp.sum(filled, axis=1, keepdims=True, dtype=jnp.int32)
    n_active = wlen.astype(jnp.int32)
    inv = jnp.where(filled, jnp.cumsum(filled, axis=1, dtype=jnp.int32) - 1,
                    jnp.where(is_mask, n_filled + jnp.cumsum(is_mask, axis=1, dtype=jnp.int32) - 1,
                              n_active + idx - wlen))
    order = jnp.zeros_like(inv).at[jnp.arange(inv.shape[0])[:, None], inv].set(
        jnp.broadcast_to(idx, inv.shape))                             # physical j -> logical slot
    fed = jnp.where(filled, tok, knobs["mask_id"])
    phys_tok = jnp.take_along_axis(fed, order, axis=1)
    phys_pos = n[:, None] + order
    # 2. forward on the cache at rows n..n+W-1.
    logits, cache = _forward(model, params, phys_tok, phys_pos, state["cache"], n, static.kv_tile)
    # per-slot entropy and candidate token in physical order, then back to logical order ([B, W])
    keys = _row_keys(knobs["seed"], state["steps"])
    ent = jnp.take_along_axis(entropy(logits), inv, axis=1)
    sampled = jnp.take_along_axis(sample_tokens(logits, keys, knobs, static.greedy), inv, axis=1)
    # 3. commit the leading filled run (flags before this step's fill).
    c = jnp.sum(jnp.cumprod(filled.astype(jnp.int32), axis=1), axis=1)
    if static.method == "block":
        c = jnp.where(c == wlen[:, 0], c, 0)
    is_stop = jnp.any(tok[:, :, None] == knobs["stop_ids"][None, None, :], axis=-1) & (idx < c[:, None])
    has_stop = jnp.any(is_stop, axis=1)
    c_emit = jnp.where(has_stop, jnp.argmax(is_stop, axis=1) + 1, c).astype(jnp.int32)
    out = _write_out(state["out"], state["count"], tok, jnp.where(done, 0, c_emit))
    # 4. fill the remaining masks by distance-adjusted entropy.
    remaining = active & ~filled & (idx >= c[:, None])
    sel = fill_select(ent, remaining, idx, knobs)
    tok2 = jnp.where(sel, sampled, tok)
    filled2 = filled | sel
    # 5. slide by c; new slots are masks (inactive ones stay masks until the budget admits them).
    tok3, filled3 = slide(tok2, filled2, c, knobs["mask_id"])
    n2 = n + c_emit
    live = ~done
    new = dict(state)
    new.update(
        cache=cache,
        tok=_keep(done, tok3, state["tok"]),
        filled=_keep(done, filled3, state["filled"]),
        n=jnp.where(live, n2, n),
        done=done | has_stop | (n2 >= end),
        out=out,
        count=jnp.where(live, state["count"] + c_emit, state["count"]),
        steps=state["steps"] + live,
        nfwd=state["nfwd"] + jnp.where(live, wlen[:, 0], 0),
        it=state["it"] + 1,
    )
    aux = dict(tokens=phys_tok, positions=phys_pos, logits=logits, n=n, live=live, wlen=wlen[:, 0],
               commit=c_emit, filled_after=filled2)
    return new, aux


def ar_step(model, params, state: dict, knobs: dict, static: Static):
    """One AR step: feed the pending token (tok[:, 0], logical position n), sample the next one."""
    tok, n, end, done = state["tok"], state["n"], state["end"], state["done"]
    logits, cache = _forward(model, params, tok[:, :1], n[:, None], state["cache"], n, static.kv_tile)
    keys = _row_keys(knobs["seed"], state["steps"])
    nxt = sample_tokens(logits, keys, knobs, static.greedy)[:, 0]
    live = ~done
    one = jnp.ones_like(n)
    out = _write_out(state["out"], state["count"], nxt[:, None], live.astype(jnp.int32))
    is_stop = jnp.any(nxt[:, None] == knobs["stop_ids"][None, :], axis=1)
    n2 = n + 1
    new = dict(state)
    new.update(
        cache=cache,
        tok=_keep(done, nxt[:, None], tok),
        n=jnp.where(live, n2, n),
        done=done | is_stop | (n2 + 1 >= end),
        out=out,
        count=state["count"] + live,
        steps=state["steps"] + live,
        nfwd=state["nfwd"] + live,
        it=state["it"] + 1,
    )
    aux = dict(tokens=tok[:, :1], positions=n[:, None], logits=logits, n=n, live=live,
               wlen=jnp.ones_like(n), commit=one)
    return new, aux


def step_fn(static: Static) -> Callable:
    if static.method == "verified":
        from decode.verified import verified_step
        return verified_step
    return ar_step if static.method == "ar" else window_step


# ----------------------------------------------------------------------------------- the loop

_TRACES = {"count": 0}


def trace_count() -> int:
    """How many times the decode program has been traced (a compile-per-key check for tests)."""
    return _TRACES["count"]


def _decode_program(model, static: Static, on_commit: Callable | None = None):
    step = step_fn(static)

    def run(params, cache, prompt_tokens, prefill_len, state0, knobs):
        _TRACES["count"] += 1
        cache = prefill(model, params, cache, prompt_tokens, prefill_len, static)
        state = dict(state0, cache=cache)

        def cond(st):
            return jnp.logical_not(jnp.all(st["done"])) & (st["it"] < knobs["max_iters"])

        def body(st):
            new, _ = step(model, params, st, knobs, static)
            if on_commit is not None:
                jax.debug.callback(on_commit, st["count"], new["count"], new["out"], new["done"])
            return new

        state = jax.lax.while_loop(cond, body, state)
        keys = ("out", "count", "steps", "nfwd", "it", "done", "n", "acc", "rej")
        return {k: state[k] for k in keys if k in state}, state["cache"]

    return run


def init_state(static: Static, prompts: list[list[int]], max_new_tokens: int, capacity: int,
               mask_id: int, pad_id: int = 0, vocab: int = 0):
    """Host-side initial arrays: (prompt_tokens [B, R], prefill_len [B], state dict without cache).
    Batch rows past len(prompts) are padding, finished from the start."""
    b, rows, w = static.batch, static.rows, static.slots
    toks = np.full((b, rows), pad_id, np.int32)
    plen = np.ones((b,), np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
        plen[i] = len(p)
    real = np.arange(b) < len(prompts)
    end = np.minimum(plen + max_new_tokens, capacity).astype(np.int32)
    if static.method == "verified":
        from decode.verified import initial_state
        state, prefill_len = initial_state(static, toks, plen, end, real, mask_id, vocab)
        return toks, prefill_len, state
    if static.method == "ar":
        n0 = plen - 1
        tok0 = toks[np.arange(b), n0][:, None].astype(np.int32)
        done = (n0 + 1 >= end) | ~real
        prefill_len = np.where(real, n0, 0).astype(np.int32)
    else:
        n0 = plen.copy()
        tok0 = np.full((b, w), mask_id, np.int32)
        done = (n0 >= end) | ~real
        prefill_len = np.where(real, n0, 0).astype(np.int32)
    state = dict(n=n0.astype(np.int32), end=end, tok=tok0, filled=np.zeros((b, w), bool), done=done,
                 out=np.zeros((b, static.out_len), np.int32), count=np.zeros((b,), np.int32),
                 steps=np.zeros((b,), np.int32), nfwd=np.zeros((b,), np.int32),
                 it=np.zeros((), np.int32))
    return toks, prefill_len, state


def make_knobs(dc: DecodeConfig, mask_id: int, stop_ids: Sequence[int], max_iters: int) -> dict:
    stops = np.full((MAX_STOP_IDS,), -1, np.int32)
    stops[:len(stop_ids)] = list(stop_ids)
    return dict(tau=np.float32(dc.tau), lam=np.float32(dc.lam),
                temperature=np.float32(dc.temperature), top_k=np.int32(dc.top_k),
                top_p=np.float32(dc.top_p), stop_ids=stops, mask_id=np.int32(mask_id),
                seed=np.uint32(dc.seed % (1 << 32)), max_iters=np.int32(max_iters))


# ----------------------------------------------------------------------------------- results

@dataclasses.dataclass
class RowStats:
    steps: int
    n_gen: int
    n_fwd: int
    tokens_per_forward: float
    p_cache: float
    finish: str  # 'stop' | 'length' (budget or capacity)
    accepted: int = 0   # method 'verified': drafts accepted (and emitted)
    rejected: int = 0   # method 'verified': drafts that failed verification


@dataclasses.dataclass
class DecodeResult:
    tokens: list
    rows: list
    steps: int
    n_gen: int
    n_fwd: int
    tokens_per_forward: float
    p_cache: float
    loop_iterations: int
    wall_s: float
    tokens_per_s: float
    compile_s: float
    method: str
    text: list | None = None
    accepted: int = 0
    rejected: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _ratio(a, b):
    return float(a) / float(b) if b else 0.0


# ----------------------------------------------------------------------------------- generate

_COMPILED: dict = {}
_STREAM: dict = {"fn": None, "rows": 0}


def _stream_callback(before, after, out, done):
    """Host side of `on_commit`: the compiled program calls this once per step (the target is read
    from `_STREAM` at call time, so one compiled program serves every callback)."""
    fn = _STREAM["fn"]
    if fn is None:
        return
    before, after, out = np.asarray(before), np.asarray(after), np.asarray(out)
    for r in range(min(_STREAM["rows"], len(before))):
        if after[r] > before[r]:
            fn(r, out[r, before[r]:after[r]].tolist())


def _mesh_key(mesh):
    return None if mesh is None else (tuple(mesh.axis_names), tuple(mesh.devices.shape),
                                      tuple(d.id for d in mesh.devices.flat))


def _shardings(mesh, static: Static, config: ModelConfig, params, rules=DEFAULT_RULES):
    if mesh is None:
        return None
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    p_sh = tree_shardings(model_lib.param_logical_axes(config), shapes, mesh, rules)
    cache_shapes = jax.eval_shape(lambda: model_lib.init_kv_cache(config, static.batch, static.rows))
    c_spec = tree_shardings(model_lib.kv_cache_logical_axes(config), cache_shapes, mesh, rules)
    row2 = NamedSharding(mesh, spec_for(("batch", None), (static.batch, 2), mesh, rules))
    row1 = NamedSharding(mesh, spec_for(("batch",), (static.batch,), mesh, rules))
    rep = NamedSharding(mesh, P())
    return dict(params=p_sh, cache=c_spec, row2=row2, row1=row1, rep=rep)


def _setup(params, model_config, prompts, dc, capacity, mesh, mask_token_id, kv_tile, dtype,
           stream=False):
    """Validate everything (before any compile) and build the static key and initial arrays."""
    if not isinstance(dc, DecodeConfig):
        raise DecodeConfigError(f"decode_config must be a DecodeConfig, got {type(dc).__name__}")
    mask_id = resolve_mask_token(model_config.mask_token_id, mask_token_id, dc.method)
    if dc.method != "ar" and not 0 <= mask_id < model_config.vocab_size:
        raise DecodeConfigError(f"mask_token_id {mask_id} is outside the vocabulary [0, {model_config.vocab_size})")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise DecodeConfigError(f"capacity must be an int >= 1, got {capacity!r}")
    if isinstance(kv_tile, bool) or not isinstance(kv_tile, int) or kv_tile < 1:
        raise DecodeConfigError(f"kv_tile must be an int >= 1, got {kv_tile!r}")
    prompts = check_prompts(prompts, model_config.vocab_size, capacity)
    bad_stop = [s for s in dc.stop_token_ids if s >= model_config.vocab_size]
    if bad_stop:
        raise DecodeConfigError(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {model_config.vocab_size})")
    longest = max(len(p) for p in prompts)
    if capacity is None:
        capacity = longest + dc.max_new_tokens
    multiple = 1
    if mesh is not None:
        multiple = int(mesh.shape.get("data", 1)) * int(mesh.shape.get("fsdp", 1))
    static = make_static(dc, len(prompts), capacity, kv_tile, multiple, stream=stream)
    budget = min(dc.max_new_tokens, capacity)
    max_iters = 2 * (budget + static.slots) + 8
    toks, prefill_len, state0 = init_state(static, prompts, dc.max_new_tokens, capacity, max(mask_id, 0),
                                           vocab=model_config.vocab_size)
    knobs = make_knobs(dc, max(mask_id, 0), dc.stop_token_ids, max_iters)
    cache = model_lib.init_kv_cache(model_config, static.batch, static.rows, dtype)
    model = model_lib.Transformer(model_config.replace(mask_token_id=None, bos_token_id=None,
                                                       eos_token_id=None, pad_token_id=None), dtype=dtype)
    return model, static, (toks, prefill_len, state0, knobs, cache), prompts


def generate(params, model_config: ModelConfig, prompts: Sequence[Sequence[int]],
             decode_config: DecodeConfig, *, capacity: int | None = None, mesh=None,
             mask_token_id: int | None = None, kv_tile: int = DEFAULT_KV_TILE,
             dtype=jnp.float32, tokenizer=None, on_commit: Callable | None = None) -> DecodeResult:
    """Decode every prompt (token-id lists) with `decode_config`; see the module docstring.

    capacity: the most tokens (prompt + generated) a row may hold; default max(prompt) +
    max_new_tokens. mesh: a ('data', 'fsdp', 'tensor') mesh: batch over data/fsdp, heads over
    tensor. tokenizer: anything with `decode(ids) -> str` to fill `text`. on_commit(row, ids):
    called from the loop (host callback) with each row's newly committed ids, for streaming text.
    """
    dc = decode_config
    model, static, (toks, prefill_len, state0, knobs, cache), prompts = _setup(
        params, model_config, prompts, dc, capacity, mesh, mask_token_id, kv_tile, dtype,
        stream=on_commit is not None)

    _STREAM["fn"], _STREAM["rows"] = on_commit, len(prompts)
    callback = _stream_callback if on_commit is not None else None
    sh = _shardings(mesh, static, model_config, params)
    shape_config = model_config.replace(mask_token_id=None, bos_token_id=None, eos_token_id=None,
                                        pad_token_id=None)  # ids are runtime values
    key = (static, shape_config, jnp.dtype(dtype).name, _mesh_key(mesh),
           jax.tree.structure(params), tuple((x.shape, x.dtype.name) for x in jax.tree.leaves(params)))
    args = (params, cache, toks, prefill_len, state0, knobs)
    if sh is not None:
        args = _place(args, sh, static)
    compile_s = 0.0
    compiled = _COMPILED.get(key)
    if compiled is None:
        t0 = time.perf_counter()
        fn = _decode_program(model, static, callback)
        if mesh is not None:
            rules = DEFAULT_RULES.as_flax_rules()
            inner = fn

            def fn(*a):
                with nn.logical_axis_rules(rules):
                    return inner(*a)
            with jax.set_mesh(mesh):
                compiled = jax.jit(fn, donate_argnums=(1,)).lower(*args).compile()
        else:
            compiled = jax.jit(fn, donate_argnums=(1,)).lower(*args).compile()
        compile_s = time.perf_counter() - t0
        _COMPILED[key] = compiled
    t0 = time.perf_counter()
    if mesh is not None:
        with jax.set_mesh(mesh):
            outs, cache = compiled(*args)
    else:
        outs, cache = compiled(*args)
    outs = jax.device_get(outs)
    wall = time.perf_counter() - t0
    del cache
    return _collect(outs, prompts, dc, wall, compile_s, tokenizer)


def _place(args, sh, static):
    params, cache, toks, prefill_len, state0, knobs = args
    params = jax.device_put(params, sh["params"])
    cache = jax.device_put(cache, sh["cache"])

    def row(x):
        x = np.asarray(x)
        if x.ndim == 0:
            return jax.device_put(x, sh["rep"])
        s = sh["row1"] if x.ndim == 1 else NamedSharding(sh["row2"].mesh, P(sh["row2"].spec[0], *([None] * (x.ndim - 1))))
        return jax.device_put(x, s)
    toks, prefill_len = row(toks), row(prefill_len)
    state0 = {k: row(v) for k, v in state0.items()}
    knobs = {k: jax.device_put(np.asarray(v), sh["rep"]) for k, v in knobs.items()}
    return params, cache, toks, prefill_len, state0, knobs


def _collect(outs, prompts, dc: DecodeConfig, wall, compile_s, tokenizer) -> DecodeResult:
    tokens, rows = [], []
    stops = set(dc.stop_token_ids)
    unfinished = [r for r in range(len(prompts)) if not bool(outs["done"][r])]
    if unfinished:  # cannot happen (every step commits or fills); guards the iteration cap
        raise RuntimeError(f"decode loop stopped at its iteration cap ({int(outs['it'])}) with rows "
                           f"{unfinished} unfinished")
    for r in range(len(prompts)):
        cnt = int(outs["count"][r])
        ids = outs["out"][r, :cnt].astype(int).tolist()
        steps, nfwd = int(outs["steps"][r]), int(outs["nfwd"][r])
        tokens.append(ids)
        finish = "stop" if ids and ids[-1] in stops else "length"
        rows.append(RowStats(steps=steps, n_gen=cnt, n_fwd=nfwd, tokens_per_forward=_ratio(cnt, steps),
                             p_cache=_ratio(cnt, nfwd), finish=finish,
                             accepted=int(outs["acc"][r]) if "acc" in outs else 0,
                             rejected=int(outs["rej"][r]) if "rej" in outs else 0))
    n_gen = sum(r.n_gen for r in rows)
    steps = sum(r.steps for r in rows)
    n_fwd = sum(r.n_fwd for r in rows)
    text = None
    if tokenizer is not None:
        text = [tokenizer.decode(ids) for ids in tokens]
    return DecodeResult(tokens=tokens, rows=rows, steps=steps, n_gen=n_gen, n_fwd=n_fwd,
                        tokens_per_forward=_ratio(n_gen, steps), p_cache=_ratio(n_gen, n_fwd),
                        loop_iterations=int(outs["it"]), wall_s=wall, tokens_per_s=_ratio(n_gen, wall),
                        compile_s=compile_s, method=dc.method, text=text,
                        accepted=sum(r.accepted for r in rows), rejected=sum(r.rejected for r in rows))


_STEPPERS: dict = {}


def trace_steps(params, model_config: ModelConfig, prompts, decode_config: DecodeConfig, *,
                capacity: int | None = None, mask_token_id: int | None = None,
                kv_tile: int = DEFAULT_KV_TILE, dtype=jnp.float32, max_steps: int = 10_000):
    """Debug hook: the same prefill and step functions, one jitted step at a time from a host loop.
    Returns (steps, final) where steps is a list of host dicts (the step's aux: fed tokens,
    positions, logits in physical order, n, live, wlen, commit) and final holds the state arrays."""
    model, static, (toks, prefill_len, state, knobs, cache), prompts = _setup(
        params, model_config, prompts, decode_config, capacity, None, mask_token_id, kv_tile, dtype)
    key = (static, model.config, jnp.dtype(dtype).name)
    if key not in _STEPPERS:
        step = step_fn(static)
        _STEPPERS[key] = (jax.jit(lambda p, c, t, l: prefill(model, p, c, t, l, static)),
                          jax.jit(lambda p, st, k: step(model, p, st, k, static)))
    pre, one = _STEPPERS[key]
    state = dict(state, cache=pre(params, cache, toks, prefill_len))
    trace = []
    while not bool(np.all(np.asarray(state["done"]))) and len(trace) < max_steps:
        state, aux = one(params, state, knobs)
        trace.append(jax.device_get(aux))
    final = jax.device_get({k: v for k, v in state.items() if k != "cache"})
    final["num_prompts"] = len(prompts)
    return trace, final
