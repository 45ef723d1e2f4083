"""One decoding step for every slot, per method, built from pieces each defined once here
(docs/algorithm.md §3, the paper's Algorithm 1):

  reorder          physical order = filled slots ascending, then masks ascending, then idle slots;
  leading_run      c = the window's leading filled run (the slots the step commits);
  window_span      the slots this forward holds: the window, plus with refill 'before' (the
                   official engine's order) c more [MASK] slots appended before the forward;
  emit_until_stop  how many of the committed tokens a row emits (first stop token inclusive);
  fill_select      the fill rule: H_i + lam * (i - first mask) < tau, else the single lowest;
  slide            drop the committed slots, masks behind;
  advance          the state update shared by every method (done rows stop changing).

`streaming` and `block` use `window_step`, `ar` uses `ar_step`; `verified` (drafts whose commits
the AR reading of the same forward verifies, output equal to `ar`) is `decode.engine.step.verified` on the
same pieces.

Each step returns (new state, emitted [B, E] tokens, their TokenLogProbs [B, E, ..], k_emit [B]
counts, aux) where aux holds the forward's inputs and logits in physical order for the trace and the
cache-consistency checks. An emitted token's log-probability is that of the forward that chose it
(streaming and block: the step that filled its slot, carried in the window; AR and verified: the AR
reading of this step's forward; docs/algorithm.md §6).

Refill orders. 'after' (docs/algorithm.md §3, steps 1-5): the forward holds the window of W slots; tokens per
forward top out at W/2 (every token spends one forward as a mask, one as a filled slot). 'before'
(Tencent/WeDLM `_refill_window_masks`): the c slots about to be committed stay in the forward and
c masks are appended behind the window, so the forward holds W + c <= 2W slots and tokens per
forward reach W. Both never place a slot past the row's budget.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from decode.engine.step import guide as guides
from decode.engine.step.sampling import (choose_tokens, logit_stats, row_keys, seen_counts,
                                    token_logprobs)
from decode.engine.step.state import DecodeState, TokenLogProbs, keep_if_done


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The static shape of a step. `sampling`: whether any request may sample (temperature > 0);
    a greedy-only program holds no sampling code (a `lax.cond` branch still costs its bytes in
    the compiler's accounting, and compile time). `top_logprobs`: how many alternatives each
    emitted token carries with its log-probability (0: the token's own only)."""
    method: str
    window: int
    refill: str
    sampling: bool = True
    top_logprobs: int = 0

    @property
    def span(self) -> int:
        """Slots per forward (S)."""
        if self.method == "ar":
            return 1
        return 2 * self.window if self.refill == "before" else self.window

    @property
    def emit_width(self) -> int:
        """Most tokens one step emits per row (E)."""
        return 1 if self.method == "ar" else self.window


# ----------------------------------------------------------------------------- shared pieces

def reorder(filled, active):
    """(order, inv): order[b, j] = logical slot at physical index j; inv its inverse. Filled slots
    ascending, then [MASK] slots ascending, then idle (inactive) slots; ranks by cumsum, no sort."""
    s = filled.shape[1]
    idx = jnp.arange(s, dtype=jnp.int32)[None, :]
    is_mask = active & ~filled
    idle = ~active
    n_filled = jnp.sum(filled, axis=1, keepdims=True, dtype=jnp.int32)
    n_active = jnp.sum(active, axis=1, keepdims=True, dtype=jnp.int32)
    rank = lambda m: jnp.cumsum(m, axis=1, dtype=jnp.int32) - 1
    inv = jnp.where(filled, rank(filled),
                    jnp.where(is_mask, n_filled + rank(is_mask), n_active + rank(idle)))
    rows = jnp.arange(filled.shape[0])[:, None]
    order = jnp.zeros_like(inv).at[rows, inv].set(jnp.broadcast_to(idx, inv.shape))
    return order, inv


def leading_run(filled) -> jnp.ndarray:
    """[B] the number of leading filled slots."""
    return jnp.sum(jnp.cumprod(filled.astype(jnp.int32), axis=1), axis=1)


def window_span(st: DecodeState, spec: StepSpec, always_filled0: bool = False):
    """(idx, filled, c, wlen) for this step: the window is the slots below min(W, budget left);
    filled flags past it are dropped; c = its leading filled run (block: the whole block or 0);
    wlen = the slots the forward holds (the window plus, with refill 'before', c masks)."""
    idx = jnp.arange(spec.span, dtype=jnp.int32)[None, :]
    left = jnp.maximum(st.end - st.n, 0)
    base = jnp.minimum(left, spec.window)
    filled = st.filled | (idx == 0) if always_filled0 else st.filled
    filled = filled & (idx < base[:, None])
    c = leading_run(filled)
    if spec.method == "block":
        c = jnp.where(c == base, c, 0)
    wlen = jnp.minimum(base + c, left) if spec.refill == "before" else base
    return idx, filled, c, wlen


def emit_until_stop(tokens, k, stop_ids):
    """tokens [B, E] to emit, k [B] of them: (k_emit [B], stopped [B]) cut after the first stop."""
    idx = jnp.arange(tokens.shape[1])[None, :]
    is_stop = jnp.any(tokens[:, :, None] == stop_ids[:, None, :], axis=-1) & (idx < k[:, None])
    stopped = jnp.any(is_stop, axis=1)
    return jnp.where(stopped, jnp.argmax(is_stop, axis=1) + 1, k).astype(jnp.int32), stopped


def fill_select(ent, remaining, idx, tau, lam):
    """The fill rule (docs/algorithm.md §3, step 4) over the `remaining` mask slots [B, S]: adjusted entropy
    H_i + lam * (i - first remaining); every slot below tau, else the single lowest. tau, lam: [B]."""
    any_rem = jnp.any(remaining, axis=1, keepdims=True)
    first = jnp.argmax(remaining, axis=1)[:, None]
    adj = jnp.where(remaining, ent + lam[:, None] * (idx - first).astype(jnp.float32), jnp.inf)
    sel = remaining & (adj < tau[:, None])
    best = idx == jnp.argmin(adj, axis=1)[:, None]
    return sel | (~jnp.any(sel, axis=1, keepdims=True) & any_rem & best)


def slide_source(s: int, shift):
    """(src, inside) [B, S]: slot i takes slot i + shift[b] when that is inside the window."""
    src = jnp.arange(s, dtype=jnp.int32)[None, :] + shift[:, None]
    return jnp.minimum(src, s - 1), src < s


def slide(tok, filled, shift, mask_id):
    """Drop the first `shift[b]` window slots of each row, [MASK] slots behind (docs/algorithm.md §3, step 5)."""
    src, inside = slide_source(tok.shape[1], shift)
    return (jnp.where(inside, jnp.take_along_axis(tok, src, axis=1), mask_id),
            inside & jnp.take_along_axis(filled, src, axis=1))


def advance(st: DecodeState, *, layers, tok, filled, n_new, finished, k_emit, wlen, **extra):
    """The state after one step; rows that were already done keep every value."""
    live = ~st.done
    kept = {k: jax.tree.map(lambda new, old: keep_if_done(st.done, new, old), v, getattr(st, k))
            for k, v in extra.items()}
    return st.replace(
        cache=st.cache.replace(layers=layers, length=jnp.where(live, n_new, st.n)),
        tok=keep_if_done(st.done, tok, st.tok),
        filled=keep_if_done(st.done, filled, st.filled),
        done=st.done | finished,
        steps=st.steps + live,
        n_fwd=st.n_fwd + jnp.where(live, wlen, 0),
        count=st.count + jnp.where(live, k_emit, 0),
        **kept)


def add_seen(seen, tokens, k):
    """The generated-token counts `seen` [B, V] plus the first k[b] of each row's `tokens` [B, E]
    (the tokens a step emits)."""
    vocab = jnp.arange(seen.shape[1], dtype=jnp.int32)[None, :]
    for e in range(tokens.shape[1]):           # E comparisons fused into one pass (no scatter)
        seen = seen + ((vocab == tokens[:, e, None]) & (e < k[:, None])).astype(jnp.int32)
    return seen


def reads_before(filled, phys_pos, n, first: int = 0, inclusive: bool = False):
    """[B, S, S] bool: physical slot p of a forward reads window token i (logical) as generated
    before it: filled, from `first` on, and before p's own logical slot (through it with
    `inclusive`: the AR reading at slot j predicts slot j + 1)."""
    order = (phys_pos - n[:, None])[:, :, None]                 # p's logical slot
    i = jnp.arange(filled.shape[1])[None, None, :]
    upto = (i <= order) if inclusive else (i < order)
    return filled[:, None, :] & (i >= first) & upto


def forward_window(forward: Callable, params, st: DecodeState, filled, active, mask_id):
    """Reorder and run the forward on the cache at rows n.. . Returns (logits [B, S, V] in
    physical order, new cache layers, inv, fed tokens, positions)."""
    order, inv = reorder(filled, active)
    fed = jnp.where(filled, st.tok, mask_id)
    phys_tok = jnp.take_along_axis(fed, order, axis=1)
    phys_pos = st.n[:, None] + order
    logits, layers = forward(params, phys_tok, phys_pos, st.cache.layers, st.n)
    return logits, layers, inv, phys_tok, phys_pos


# ----------------------------------------------------------------------------- the methods

def window_step(forward, params, st: DecodeState, spec: StepSpec, mask_id):
    """Streaming (Algorithm 1) or block decoding: reorder, forward, commit the leading filled
    run, fill, slide."""
    s = st.settings
    st, states = guides.recheck(st)                 # a constraint: commit its accepted run only
    idx, filled, c, wlen = window_span(st, spec)
    active = idx < wlen[:, None]
    logits, layers, inv, phys_tok, phys_pos = forward_window(forward, params, st, filled, active,
                                                             mask_id)
    logits = guides.mask_head(logits, st, states, filled, inv)
    stats = logit_stats(logits)
    ent = jnp.take_along_axis(stats.entropy, inv, axis=1)
    seen = lambda: seen_counts(st.seen, st.tok, reads_before(filled, phys_pos, st.n))
    chosen = choose_tokens(logits, row_keys(s.seed, st.steps), s, spec.sampling, stats.greedy,
                           seen)
    cand = jnp.take_along_axis(chosen, inv, axis=1)
    cand_lps = TokenLogProbs(*token_logprobs(logits, chosen, spec.top_logprobs, s.want_top,
                                             stats.lse)).take(inv)
    emitted, emitted_lps = st.tok[:, :spec.window], st.lps.head(spec.window)
    k_emit, stopped = emit_until_stop(emitted, c, s.stop_ids)
    remaining = active & ~filled & (idx >= c[:, None])
    sel = guides.fill_head(fill_select(ent, remaining, idx, s.tau, s.lam), st, remaining, idx, c)
    tok, filled2 = slide(jnp.where(sel, cand, st.tok), filled | sel, c, mask_id)
    lps = cand_lps.where(sel, st.lps).take(slide_source(spec.span, c)[0])
    n_new = st.n + k_emit
    new = advance(st, layers=layers, tok=tok, filled=filled2, n_new=n_new,
                  finished=stopped | (n_new >= st.end), k_emit=k_emit, wlen=wlen, lps=lps,
                  seen=add_seen(st.seen, emitted, k_emit))
    new = guides.committed(new, st, states, c)
    aux = dict(tokens=phys_tok, positions=phys_pos, logits=logits, n=st.n, live=~st.done,
               wlen=wlen, commit=k_emit, filled_after=filled | sel)
    return new, emitted, emitted_lps, jnp.where(st.done, 0, k_emit), aux


def ar_step(forward, params, st: DecodeState, spec: StepSpec, mask_id):
    """Cached next-token decoding: feed the pending token (slot 0, position n), choose the next."""
    s = st.settings
    logits, layers = forward(params, st.tok[:, :1], st.n[:, None], st.cache.layers, st.n)
    logits = guides.mask_rows(logits, st)
    stats = logit_stats(logits)
    nxt = choose_tokens(logits, row_keys(s.seed, st.steps), s, spec.sampling, stats.greedy,
                        lambda: st.seen[:, None, :])
    lps = TokenLogProbs(*token_logprobs(logits, nxt, spec.top_logprobs, s.want_top, stats.lse))
    one = jnp.ones_like(st.n)
    k_emit, stopped = emit_until_stop(nxt, one, s.stop_ids)
    n_new = st.n + 1
    new = advance(st, layers=layers, tok=nxt, filled=st.filled, n_new=n_new,
                  finished=stopped | (n_new + 1 >= st.end), k_emit=k_emit, wlen=one,
                  seen=add_seen(st.seen, nxt, k_emit))
    new = guides.advanced(new, st, None, None, nxt[:, 0])
    aux = dict(tokens=st.tok[:, :1], positions=st.n[:, None], logits=logits, n=st.n,
               live=~st.done, wlen=one, commit=one)
    return new, nxt, lps, jnp.where(st.done, 0, k_emit), aux
