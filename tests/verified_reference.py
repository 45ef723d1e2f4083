"""A plain, step-by-step version of verified streaming decoding (method 'verified') with NO
KV cache: every step runs one full causal forward of [committed tokens ; reordered window] and all
bookkeeping is ordinary Python on one sequence at a time. It exists to check `decode.engine.step.verified`
against; greedy only (the jitted engine's random streams cannot be replayed here).

Per sequence: `seq` = the committed tokens (positions 0..n-1), `win` = the window, a list of
[token or None] at positions n, n+1, ...; win[0] is the pending token (known to be the AR model's:
the last prompt token at the start, which is not emitted). A step:
  - forward seq + the window reordered (filled ascending, then masks ascending), positions kept;
  - c = leading filled run; drafts win[1..c-1] are checked left to right against the AR reading
    (the argmax of the logits of the slot before them, which stands at the same physical index as
    its logical one); the first mismatch (or slot c) gets that AR prediction instead;
  - win[0..a-1] join `seq`; the accepted drafts and the new pending token are emitted (budget, stop);
  - after a mismatch the window holds only the pending token; otherwise the masks after slot c are
    drafted by the streaming fill rule (origin slot c) and older drafts after c stay;
  - the window slides, refilled with masks up to W or the budget.
"""

from __future__ import annotations

import numpy as np

from decode.config import DecodeConfig, DecodeConfigError, check_prompts
from decode.config import mask_id_for
from tests.decode_reference import entropy, FullForward
from wedlm_jax.config import ModelConfig


def reference_verified(params, model_config: ModelConfig, prompts, decode_config: DecodeConfig, *,
                       capacity: int | None = None, mask_token_id: int | None = None,
                       record=None) -> list[dict]:
    """Greedy verified decoding of each prompt on its own. Returns one dict per prompt: tokens,
    steps, n_fwd, accepted, rejected. `record`, when a list, receives per step a dict (row, n, fed
    tokens, positions, logits, a)."""
    dc = decode_config
    if not dc.greedy:
        raise DecodeConfigError(f"the reference is greedy only (temperature 0), got {dc.temperature}")
    mask_id = mask_id_for(model_config, mask_token_id, "verified")
    prompts = check_prompts(prompts, model_config.vocab_size, capacity)
    if capacity is None:
        capacity = max(len(p) for p in prompts) + dc.max_new_tokens
    forward = FullForward(params, model_config, capacity + 2 * dc.window)
    out = []
    for row, prompt in enumerate(prompts):
        end = min(len(prompt) + dc.max_new_tokens, capacity)
        out.append(_one(forward, prompt, end, dc, mask_id, row, record))
    return out


def _fill(logits_of, masks, first, dc):
    adj = {i: float(entropy(logits_of[i])) + dc.lam * (i - first) for i in masks}
    chosen = [i for i in masks if adj[i] < dc.tau]
    return chosen or [min(masks, key=lambda i: (adj[i], i))]


def _one(forward, prompt, end, dc: DecodeConfig, mask_id, row, record):
    stops = set(dc.stop_token_ids)
    seq = list(prompt[:-1])
    emitted, steps, n_fwd, accepted, rejected = [], 0, 0, 0, 0
    if len(prompt) >= end:
        return dict(tokens=emitted, steps=0, n_fwd=0, accepted=0, rejected=0)
    win = [prompt[-1]] + [None] * (min(dc.window, end - len(seq)) - 1)
    while True:
        n = len(seq)
        if dc.refill == "before":   # the official order: masks for the leading run join the forward
            lead = 0
            while lead < len(win) and win[lead] is not None:
                lead += 1
            win = win + [None] * min(lead, end - n - len(win))
        order = [i for i, t in enumerate(win) if t is not None] + [i for i, t in enumerate(win) if t is None]
        fed = [win[i] if win[i] is not None else mask_id for i in order]
        pos = [n + i for i in order]
        phys = forward(seq + fed, list(range(n)) + pos)[n:]
        steps += 1
        n_fwd += len(win)
        logits_of = {order[j]: phys[j] for j in range(len(order))}   # logical slot -> logits
        c = 0
        while c < len(win) and win[c] is not None:
            c += 1
        # verification: the AR prediction for slot j is the argmax at physical (= logical) j - 1
        a = 1
        while a < c and win[a] == int(np.argmax(phys[a - 1])):
            a += 1
        pending = int(np.argmax(phys[a - 1]))
        if record is not None:
            record.append(dict(row=row, n=n, fed=list(fed), pos=list(pos), logits=phys, a=a))
        new = win[1:a] + [pending]                 # tokens at positions n+1 .. n+a
        new = new[:max(0, end - 1 - n)]            # budget: positions <= end - 1
        stop_at = next((j for j, t in enumerate(new) if t in stops), None)
        if stop_at is not None:
            new = new[:stop_at + 1]
        accepted += min(a - 1, len(new))
        rejected += int(a < c)
        emitted += new
        if stop_at is not None or n + a + 1 >= end:
            break
        # next window
        rest = [None] * len(win)
        if a == c:
            masks = [i for i in range(c, len(win)) if win[i] is None]
            if masks:
                for i in _fill(logits_of, masks, masks[0], dc):
                    if i > c:
                        rest[i] = int(np.argmax(logits_of[i]))
            for i in range(c + 1, len(win)):
                if win[i] is not None:
                    rest[i] = win[i]
        seq += win[:a]
        win = [pending] + rest[a + 1:]
        room = min(dc.window, end - len(seq))
        win = (win + [None] * max(0, room - len(win)))[:room]
    return dict(tokens=emitted, steps=steps, n_fwd=n_fwd, accepted=accepted, rejected=rejected)
