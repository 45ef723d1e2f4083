"""A plain, step-by-step implementation of Algorithm 1 (and the block and AR baselines) with NO
KV cache: every step runs one full causal forward of [committed tokens ; reordered window] with
explicit logical positions, and all the bookkeeping (reorder, commit, entropy, fill, slide) is
ordinary Python/NumPy on one sequence at a time. It exists to check the jitted engine against.

Greedy only (temperature 0): sampled decoding cannot be compared token for token across
implementations with different random streams.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from decode.config import DecodeConfig, DecodeConfigError, check_prompts
from decode.config import mask_id_for
from wedlm_jax.config import ModelConfig
from wedlm_jax.model import Transformer


def entropy(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return -(np.exp(logp) * logp).sum(axis=-1)


class FullForward:
    """Logits of one sequence (tokens, positions) without a cache. Inputs are right-padded to a
    fixed length so one compiled program serves every step; under the causal mask the padding
    after the real slots changes nothing before it."""

    _jitted: dict = {}

    def __init__(self, params, config: ModelConfig, length: int):
        self.length = length
        if config not in self._jitted:
            model = Transformer(config)
            self._jitted[config] = jax.jit(lambda p, t, q: model.apply({"params": p}, t, q))
        self.fn = self._jitted[config]
        self.params = params

    def __call__(self, tokens, positions) -> np.ndarray:
        s = len(tokens)
        if s > self.length:
            raise ValueError(f"sequence of {s} slots exceeds the reference length {self.length}")
        t = np.zeros((1, self.length), np.int32)
        q = np.zeros((1, self.length), np.int32)
        t[0, :s], q[0, :s] = tokens, positions
        return np.asarray(self.fn(self.params, jnp.asarray(t), jnp.asarray(q)))[0, :s]


def reference_generate(params, model_config: ModelConfig, prompts, decode_config: DecodeConfig, *,
                       capacity: int | None = None, mask_token_id: int | None = None,
                       record=None) -> list[dict]:
    """Greedy decode each prompt on its own. Returns one dict per prompt: tokens, steps, n_fwd.
    `record`, when a list, receives per step (row, tokens fed, positions fed, logits)."""
    dc = decode_config
    if not dc.greedy:
        raise DecodeConfigError("the reference implementation is greedy only (temperature 0), "
                                f"got temperature {dc.temperature}")
    mask_id = mask_id_for(model_config, mask_token_id, dc.method)
    prompts = check_prompts(prompts, model_config.vocab_size, capacity)
    if capacity is None:
        capacity = max(len(p) for p in prompts) + dc.max_new_tokens
    forward = FullForward(params, model_config, capacity + (0 if dc.method == "ar" else 2 * dc.window))
    step = _ar if dc.method == "ar" else _window
    out = []
    for r, prompt in enumerate(prompts):
        end = min(len(prompt) + dc.max_new_tokens, capacity)
        out.append(step(forward, prompt, end, dc, mask_id, r, record))
    return out


def _window(forward, prompt, end, dc: DecodeConfig, mask_id, row, record):
    """Streaming (Algorithm 1) or block decoding of one sequence."""
    stops = set(dc.stop_token_ids)
    seq = list(prompt)                       # committed tokens; n = len(seq)
    win = []                                 # window slots in logical order: [token or None]
    emitted, steps, n_fwd = [], 0, 0
    win = [None] * min(dc.window, end - len(seq))
    while win:
        n = len(seq)
        base = len(win)                      # the window before any refill
        if dc.refill == "before":
            # the official order: as many masks as the leading filled run (the slots this step
            # commits) join the forward, never past the budget
            lead = 0
            while lead < len(win) and win[lead] is not None:
                lead += 1
            if dc.method == "block" and lead < len(win):
                lead = 0
            win = win + [None] * min(lead, end - n - len(win))
        # 1. reorder: filled first (ascending), then masks (ascending)
        order = [i for i, t in enumerate(win) if t is not None] + [i for i, t in enumerate(win) if t is None]
        fed = [win[i] if win[i] is not None else mask_id for i in order]
        pos = [n + i for i in order]
        # 2. full forward of [committed ; reordered window], no cache
        logits_all = forward(seq + fed, list(range(n)) + pos)
        window_logits = logits_all[n:]
        if record is not None:
            record.append((row, list(fed), list(pos), window_logits))
        logits = {order[j]: window_logits[j] for j in range(len(order))}
        steps += 1
        n_fwd += len(win)
        # 3. commit the leading filled run
        c = 0
        while c < len(win) and win[c] is not None:
            c += 1
        if dc.method == "block" and c < base:
            c = 0
        committed = win[:c]
        stop_at = next((j for j, t in enumerate(committed) if t in stops), None)
        if stop_at is not None:
            emitted += committed[:stop_at + 1]
            break
        emitted += committed
        seq += committed
        # 4. fill
        rest = list(range(c, len(win)))
        masks = [i for i in rest if win[i] is None]
        if masks:
            first = masks[0]
            adj = {i: entropy(logits[i]) + dc.lam * (i - first) for i in masks}
            chosen = [i for i in masks if adj[i] < dc.tau]
            if not chosen:
                chosen = [min(masks, key=lambda i: (adj[i], i))]
            for i in chosen:
                win[i] = int(np.argmax(logits[i]))
        # 5. slide (refill 'after': masks appended now, up to W and the budget)
        win = win[c:]
        if dc.refill == "after":
            room = min(dc.window, end - len(seq))
            win = win + [None] * max(0, room - len(win))
    return dict(tokens=emitted, steps=steps, n_fwd=n_fwd)


def _ar(forward, prompt, end, dc: DecodeConfig, mask_id, row, record):
    stops = set(dc.stop_token_ids)
    seq = list(prompt)
    emitted, steps = [], 0
    while len(seq) < end:
        logits = forward(seq, list(range(len(seq))))
        if record is not None:
            record.append((row, list(seq), list(range(len(seq))), logits[-1:]))
        steps += 1
        nxt = int(np.argmax(logits[-1]))
        emitted.append(nxt)
        seq.append(nxt)
        if nxt in stops:
            break
    return dict(tokens=emitted, steps=steps, n_fwd=steps)
