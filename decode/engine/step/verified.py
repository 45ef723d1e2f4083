"""Verified streaming decoding: streaming drafts, AR-verified commits.

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
decoding; W = 1 is AR decoding. With refill 'after' the forward holds W slots, one of them the
pending token, so the drafts are at most W - 1 per step; with refill 'before' the leading run's
length in masks is appended behind the window, as in streaming.

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

Statistics: the streaming ones (steps, n_gen, token_slots = live window slots), plus per row
`accepted` (drafts accepted and emitted) and `rejected` (drafts that failed verification: at most
one a step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from decode.engine.step import guide as guides
from decode.engine.step.sampling import (adjust_logits, adjusted_greedy, filter_logits, logit_stats,
                                    row_keys, seen_counts, token_logprobs)
from decode.engine.step.state import DecodeState, TokenLogProbs
from decode.engine.step.steps import (StepSpec, add_seen, advance, emit_until_stop, fill_select,
                                 forward_window, reads_before, slide, window_span)


def _take_slot(x, j):
    """x[b, j[b]] for x [B, S, ...] and j [B]."""
    return jax.vmap(lambda xb, jb: jax.lax.dynamic_index_in_dim(xb, jb, 0, keepdims=False))(x, j)


def _verify_greedy(ar, tok, c, idx):
    """Greedy verification: (a, pending). Slot j in 1..c-1 is accepted when its draft equals the
    AR prediction `ar` (the argmax of each physical slot's logits) read at physical (= logical,
    inside the leading run) slot j - 1."""
    target = jnp.concatenate([tok[:, :1], ar[:, :-1]], axis=1)
    ok = (idx < c[:, None]) & (tok == target)
    a = 1 + jnp.sum(jnp.cumprod(ok[:, 1:].astype(jnp.int32), axis=1), axis=1)
    return a.astype(jnp.int32), _take_slot(ar, a - 1)


def _verify_sampled(probs, tok, q, c, idx, k_acc, k_res):
    """Speculative-sampling verification: accept draft x at slot j with probability
    min(1, p(x) / q(x)) (p: the AR reading at slot j - 1; q: the draft's own distribution); the
    first rejected slot draws from norm(max(0, p - q)). Returns (a, pending)."""
    s = tok.shape[1]
    p_x = jnp.take_along_axis(probs[:, :-1], tok[:, 1:, None], axis=-1)[..., 0]
    p_x = jnp.concatenate([jnp.ones_like(p_x[:, :1]), p_x], axis=1)
    q_x = jnp.take_along_axis(q, tok[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda k: jax.random.uniform(k, (s,)))(k_acc)
    ok = (idx < c[:, None]) & (u * q_x < p_x)
    a = (1 + jnp.sum(jnp.cumprod(ok[:, 1:].astype(jnp.int32), axis=1), axis=1)).astype(jnp.int32)
    p_a = _take_slot(probs, a - 1)
    q_a = _take_slot(q, jnp.minimum(a, s - 1))
    resid = jnp.maximum(p_a - q_a, 0.0)
    rejected = (a < c)[:, None] & (jnp.sum(resid, axis=-1, keepdims=True) > 0)
    dist = jnp.where(rejected, resid, p_a)
    pend = jax.vmap(lambda k, d: jax.random.categorical(k, jnp.log(d)))(k_res, dist)
    return a, pend.astype(jnp.int32)


def verified_step(forward, params, st: DecodeState, spec: StepSpec, mask_id):
    """Streaming drafts with AR-verified commits (decode/engine/step/verified.py documents the rule): the
    output equals AR decoding of the same weights (token for token greedy, in distribution when
    sampling). Slot 0 always holds the pending token."""
    s = st.settings
    w = spec.span
    idx, filled, c, wlen = window_span(st, spec, always_filled0=True)
    active = idx < wlen[:, None]
    logits, layers, inv, phys_tok, phys_pos = forward_window(forward, params, st, filled, active,
                                                             mask_id)
    logits, states = guides.mask_run(logits, st, c)   # a constraint: the constrained AR reading
    keys = jax.vmap(lambda k: jax.random.split(k, 3))(row_keys(s.seed, st.steps))
    k_draft, k_acc, k_res = keys[:, 0], keys[:, 1], keys[:, 2]
    sampled_rows = s.temperature > 0
    stats = logit_stats(logits)
    # the AR reading at slot j has read the drafts 1..j beyond what the row generated before
    seen = lambda: seen_counts(st.seen, st.tok, reads_before(filled, phys_pos, st.n, 1, True))
    greedy = adjusted_greedy(logits, s, seen, stats.greedy)
    a, pend = _verify_greedy(greedy, st.tok, c, idx)
    drafts = jnp.take_along_axis(greedy, inv, axis=1)
    if st.q is not None:
        def sampled(_):
            filt = filter_logits(adjust_logits(logits, s, seen()), s)
            probs = jax.nn.softmax(filt, axis=-1)
            a_s, pend_s = _verify_sampled(probs, st.tok, st.q, c, idx, k_acc, k_res)
            drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l, axis=-1))(k_draft, filt)
            return (a_s, pend_s, jnp.take_along_axis(drawn.astype(jnp.int32), inv, axis=1),
                    jnp.take_along_axis(probs, inv[..., None], axis=1))
        a_s, pend_s, drafts_s, q_logical = jax.lax.cond(
            jnp.any(sampled_rows & ~st.done), sampled,
            lambda _: (a, pend, drafts, jnp.zeros_like(st.q)), None)
        a = jnp.where(sampled_rows, a_s, a)
        pend = jnp.where(sampled_rows, pend_s, pend)
        drafts = jnp.where(sampled_rows[:, None], drafts_s, drafts)
    reject = a < c
    # emit positions n+1..n+a: the accepted drafts, then the pending token
    ext = jnp.concatenate([st.tok, jnp.zeros_like(st.tok[:, :1])], axis=1)
    ext = jnp.where(jnp.arange(w + 1)[None, :] == a[:, None], pend[:, None], ext)
    emitted = ext[:, 1:spec.window + 1]
    # emitted token j is the AR reading's at slot j (inside the leading run: physical = logical)
    emitted_lps = TokenLogProbs(*token_logprobs(logits[:, :spec.window], emitted, spec.top_logprobs,
                                                s.want_top, stats.lse[:, :spec.window]))
    k_emit, stopped = emit_until_stop(emitted, jnp.minimum(a, st.end - 1 - st.n), s.stop_ids)
    # next window (logical indices before the slide): drafts by the streaming fill rule
    ent = jnp.take_along_axis(stats.entropy, inv, axis=1)
    remaining = active & ~filled & (idx >= c[:, None])
    sel = (fill_select(ent, remaining, idx, s.tau, s.lam) & (idx > c[:, None])
           & ~reject[:, None])
    keep = filled & (idx > c[:, None]) & ~reject[:, None] & ~sampled_rows[:, None]
    tok, filled2 = slide(jnp.where(sel, drafts, st.tok), sel | keep, a, mask_id)
    tok = jnp.where(idx == 0, pend[:, None], tok)
    filled2 = filled2 | (idx == 0)
    n_new = st.n + a
    extra = dict(accepted=st.accepted + jnp.minimum(a - 1, k_emit),
                 rejected=st.rejected + reject.astype(jnp.int32),
                 seen=add_seen(st.seen, emitted, k_emit))
    if st.q is not None:
        src = jnp.minimum(idx + a[:, None], w - 1)                   # the slide of `slide`
        q3 = jnp.take_along_axis(q_logical, src[..., None], axis=1)
        extra["q"] = jnp.where(filled2[..., None], q3, 0.0)
    new = advance(st, layers=layers, tok=tok, filled=filled2, n_new=n_new,
                  finished=stopped | (n_new + 1 >= st.end), k_emit=k_emit, wlen=wlen, **extra)
    new = guides.advanced(new, st, states, a - 1, pend)
    aux = dict(tokens=phys_tok, positions=phys_pos, logits=logits, n=st.n, live=~st.done,
               wlen=wlen, commit=a, emitted=k_emit, lead=c, reject=reject, pending=pend,
               filled_after=filled2, tok_after=tok)
    return new, emitted, emitted_lps, jnp.where(st.done, 0, k_emit), aux
