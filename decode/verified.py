"""Verified streaming decoding (issue 7): streaming drafts, AR-verified commits.

    generate(params, config, prompts, DecodeConfig(method="verified", window=16, tau=0.4, lam=0.02))

The output equals AR decoding of the same weights: token for token at temperature 0, in
distribution when sampling. The streaming forward already holds a verifier: the leading filled slots
of the reordered window stand in natural order on top of the committed cache, so the AR reading of
the slot at logical (= physical) index j is the AR model's next-token prediction for slot j + 1
given exactly those drafts as context.

State per row (the engine's, with the AR engine's prefill convention): cache rows 0..n-1 are final;
the window holds up to W slots at logical positions n, n+1, ...; slot 0 is always filled with the
*pending* token, the one token already known to be the AR model's (emitted, K/V not yet in the
cache): after the prefill of rows 0..P-2 it is the last prompt token (not emitted), afterwards the
AR model's prediction for position n. Slots 1..W-1 hold drafts or [MASK]. One step:

  1. reorder and forward exactly as streaming (filled slots ascending, then masks; rows n..);
  2. verify the leading filled run c (>= 1: slot 0): slot j in 1..c-1 is accepted when its draft
     equals the AR greedy prediction read at slot j - 1 (temperature > 0: with probability
     min(1, p(x) / q(x)), see below); let a = the first slot not accepted (a = c when all are);
  3. commit slots 0..a-1: their K/V rows n..n+a-1 were computed after exactly the accepted tokens,
     so they are final; n += a;
  4. resolve slot a from the AR reading at slot a - 1 (greedy: argmax; sampled: a draw from p, or
     from norm(max(0, p - q)) when slot a's draft was rejected); it becomes the new pending token;
  5. emit the accepted drafts and the pending token (positions n+1..n+a before the update), stopping
     at the first stop token (inclusive) or at the budget;
  6. next window: the pending token in slot 0. After a rejection every later slot returns to [MASK]
     (this step's new drafts too). Otherwise the masks that remain after slot c are drafted by the
     streaming fill rule (entropy of the mask reading plus lam * distance from slot c below tau,
     else the lowest; slot c itself is the pending one, so its draft is replaced by the AR token),
     and at temperature 0 the older drafts past slot c stay (at temperature > 0 they are dropped:
     see the sampling note); the window slides by a.

Every live step emits at least the pending token, so a row never takes more steps than AR
decoding; W = 1 is AR decoding. The forward holds W slots, one of them the pending token, so the
drafts are at most W - 1 per step.

Sampling (temperature > 0): p is the AR reading's distribution after the engine's temperature /
top-k / top-p filter, q the same filter of the mask reading that the draft was drawn from (carried,
`q` in the state, [B, W, V]). Accept with probability min(1, p(x)/q(x)), else draw from
norm(max(0, p - q)): the standard speculative-sampling rule, whose output is distributed as p
provided that, given everything that decided the earlier slots, the draft is distributed as q. That
holds when every verified draft was drawn in the previous forward: those drafts are independent
given that forward's state, the slots drafted there were chosen from entropies, before any draw, and
the AR readings and decisions for slots < j never see the draft at j. A draft that survives longer
would break it: later forwards attend to it, so later fill choices and later drafts' q (which decide
earlier slots) would depend on its value. Hence at temperature > 0 the drafts not verified at the
next step are dropped; at temperature 0 verification is deterministic and keeping them is exact.

Statistics: the streaming ones (steps, n_gen, n_fwd = live window slots), plus per row `accepted`
(drafts accepted and emitted) and `rejected` (drafts that failed verification: at most one a step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from decode import engine as eng


def initial_state(static, toks: np.ndarray, plen: np.ndarray, end: np.ndarray, real: np.ndarray,
                  mask_id: int, vocab: int):
    """Host-side initial state for method 'verified' (the AR prefill convention): prefill rows
    0..P-2, n = P - 1, slot 0 = the last prompt token (pending, not emitted), other slots [MASK].
    Returns (state without cache, prefill_len)."""
    b, w = static.batch, static.window
    n0 = (plen - 1).astype(np.int32)
    tok0 = np.full((b, w), mask_id, np.int32)
    tok0[:, 0] = toks[np.arange(b), n0]
    filled0 = np.zeros((b, w), bool)
    filled0[:, 0] = True
    zeros = np.zeros((b,), np.int32)
    state = dict(n=n0, end=end, tok=tok0, filled=filled0, done=(n0 + 1 >= end) | ~real,
                 out=np.zeros((b, static.out_len), np.int32), count=zeros, steps=zeros.copy(),
                 nfwd=zeros.copy(), it=np.zeros((), np.int32), acc=zeros.copy(), rej=zeros.copy())
    if not static.greedy:
        state["q"] = np.zeros((b, w, vocab), np.float32)
    return state, np.where(real, n0, 0).astype(np.int32)


def _reorder(filled, active, idx):
    """inv[b, i] = physical index of logical slot i (filled ascending, masks ascending, inactive
    last); order = its inverse (physical j -> logical slot)."""
    is_mask = active & ~filled
    n_filled = jnp.sum(filled, axis=1, keepdims=True, dtype=jnp.int32)
    inv = jnp.where(filled, jnp.cumsum(filled, axis=1, dtype=jnp.int32) - 1,
                    jnp.where(is_mask, n_filled + jnp.cumsum(is_mask, axis=1, dtype=jnp.int32) - 1,
                              idx))
    rows = jnp.arange(inv.shape[0])[:, None]
    order = jnp.zeros_like(inv).at[rows, inv].set(jnp.broadcast_to(idx, inv.shape))
    return order, inv


def _split3(keys):
    k = jax.vmap(lambda key: jax.random.split(key, 3))(keys)
    return k[:, 0], k[:, 1], k[:, 2]


def _take_slot(x, j):
    """x[b, j[b]] for x [B, S, ...] and j [B]."""
    return jax.vmap(lambda xb, jb: jax.lax.dynamic_index_in_dim(xb, jb, 0, keepdims=False))(x, j)


def _verify_greedy(logits, tok, c, idx):
    """Greedy verification. Returns (a, pending token)."""
    ar = jnp.argmax(logits, axis=-1).astype(jnp.int32)           # physical j: prediction for j + 1
    target = jnp.concatenate([tok[:, :1], ar[:, :-1]], axis=1)    # target[j] = prediction for slot j
    ok = (idx < c[:, None]) & (tok == target)
    a = 1 + jnp.sum(jnp.cumprod(ok[:, 1:].astype(jnp.int32), axis=1), axis=1)
    return a.astype(jnp.int32), _take_slot(ar, a - 1)


def _verify_sampled(probs, tok, q, c, idx, k_acc, k_res):
    """Speculative-sampling verification. probs: filtered softmax of the forward, physical order
    ([B, W, V]); q: the drafts' filtered mask-reading distributions, logical order. Returns
    (a, pending token)."""
    w = tok.shape[1]
    # the AR distribution for slot j is probs at physical j - 1 (= logical j - 1 inside the run)
    p_x = jnp.take_along_axis(probs[:, :-1], tok[:, 1:, None], axis=-1)[..., 0]
    p_x = jnp.concatenate([jnp.ones_like(p_x[:, :1]), p_x], axis=1)
    q_x = jnp.take_along_axis(q, tok[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda k: jax.random.uniform(k, (w,)))(k_acc)
    ok = (idx < c[:, None]) & (u * q_x < p_x)
    a = (1 + jnp.sum(jnp.cumprod(ok[:, 1:].astype(jnp.int32), axis=1), axis=1)).astype(jnp.int32)
    p_a = _take_slot(probs, a - 1)
    q_a = _take_slot(q, jnp.minimum(a, w - 1))
    resid = jnp.maximum(p_a - q_a, 0.0)
    rejected = (a < c)[:, None] & (jnp.sum(resid, axis=-1, keepdims=True) > 0)
    dist = jnp.where(rejected, resid, p_a)
    pend = jax.vmap(lambda k, d: jax.random.categorical(k, jnp.log(d)))(k_res, dist)
    return a, pend.astype(jnp.int32)


def verified_step(model, params, state: dict, knobs: dict, static):
    """One verified-streaming step for every row. Returns (new_state, aux) like the engine's
    steps (aux: the forward's inputs and logits in physical order, plus the verification)."""
    w = static.window
    tok, n, end, done = state["tok"], state["n"], state["end"], state["done"]
    idx = jnp.arange(w, dtype=jnp.int32)[None, :]
    wlen = jnp.clip(end - n, 0, w)[:, None]
    active = idx < wlen
    filled = (state["filled"] | (idx == 0)) & active          # slot 0: the pending token
    # 1-2. reorder (filled first) and forward on the cache at rows n..n+W-1.
    order, inv = _reorder(filled, active, idx)
    fed = jnp.where(filled, tok, knobs["mask_id"])
    phys_tok = jnp.take_along_axis(fed, order, axis=1)
    phys_pos = n[:, None] + order
    logits, cache = eng._forward(model, params, phys_tok, phys_pos, state["cache"], n)
    c = jnp.sum(jnp.cumprod(filled.astype(jnp.int32), axis=1), axis=1)   # leading run, >= 1
    k_draft, k_acc, k_res = _split3(eng._row_keys(knobs["seed"], state["steps"]))
    # 3-4. verify the leading run; resolve slot a from the AR reading at slot a - 1.
    if static.greedy:
        a, pend = _verify_greedy(logits, tok, c, idx)
        drafts = jnp.take_along_axis(jnp.argmax(logits, axis=-1).astype(jnp.int32), inv, axis=1)
    else:
        filt = eng.filter_logits(logits, knobs["temperature"], knobs["top_k"], knobs["top_p"])
        probs = jax.nn.softmax(filt, axis=-1)
        a, pend = _verify_sampled(probs, tok, state["q"], c, idx, k_acc, k_res)
        drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l, axis=-1))(k_draft, filt)
        drafts = jnp.take_along_axis(drawn.astype(jnp.int32), inv, axis=1)
    reject = a < c
    # 5. emit positions n+1..n+a: accepted drafts, then the pending token; budget; stop tokens.
    ext = jnp.concatenate([tok, jnp.zeros_like(tok[:, :1])], axis=1)
    ext = jnp.where(jnp.arange(w + 1)[None, :] == a[:, None], pend[:, None], ext)
    emit = ext[:, 1:]
    k = jnp.minimum(a, end - 1 - n)
    is_stop = jnp.any(emit[:, :, None] == knobs["stop_ids"][None, None, :], axis=-1) & (idx < k[:, None])
    has_stop = jnp.any(is_stop, axis=1)
    k_emit = jnp.where(has_stop, jnp.argmax(is_stop, axis=1) + 1, k).astype(jnp.int32)
    live = ~done
    out = eng._write_out(state["out"], state["count"], emit, jnp.where(live, k_emit, 0))
    # 6. next window (logical indices before the slide): drafts by the streaming fill rule.
    ent = jnp.take_along_axis(eng.entropy(logits), inv, axis=1)
    remaining = active & ~filled & (idx >= c[:, None])
    sel = eng.fill_select(ent, remaining, idx, knobs) & (idx > c[:, None]) & ~reject[:, None]
    keep = filled & (idx > c[:, None]) & ~reject[:, None]
    if not static.greedy:
        keep = jnp.zeros_like(keep)           # drafts live one step when sampling (see docstring)
    tok2 = jnp.where(sel, drafts, tok)
    filled2 = sel | keep
    tok3, filled3 = eng.slide(tok2, filled2, a, knobs["mask_id"])
    tok3 = jnp.where(idx == 0, pend[:, None], tok3)
    filled3 = filled3 | (idx == 0)
    n2 = n + a
    acc = jnp.minimum(a - 1, k_emit)
    new = dict(state)
    new.update(
        cache=cache,
        tok=eng._keep(done, tok3, tok),
        filled=eng._keep(done, filled3, state["filled"]),
        n=jnp.where(live, n2, n),
        done=done | has_stop | (n2 + 1 >= end),
        out=out,
        count=jnp.where(live, state["count"] + k_emit, state["count"]),
        steps=state["steps"] + live,
        nfwd=state["nfwd"] + jnp.where(live, wlen[:, 0], 0),
        it=state["it"] + 1,
        acc=state["acc"] + jnp.where(live, acc, 0),
        rej=state["rej"] + (live & reject),
    )
    if not static.greedy:
        q_new = jnp.take_along_axis(probs, inv[..., None], axis=1)     # logical order
        src = jnp.minimum(idx + a[:, None], w - 1)                      # the slide of `slide`
        q3 = jnp.take_along_axis(q_new, src[..., None], axis=1)
        new["q"] = eng._keep(done, jnp.where(filled3[..., None], q3, 0.0), state["q"])
    aux = dict(tokens=phys_tok, positions=phys_pos, logits=logits, n=n, live=live, wlen=wlen[:, 0],
               commit=a, emitted=k_emit, lead=c, reject=reject, pending=pend, filled_after=filled3,
               tok_after=tok3)
    return new, aux
