"""What the serving tests share (tests/test_serve.py, tests/test_serve_scoring.py; the server
itself is tests/conftest.py's `server`): the server's settings, the Gate its tests hold the engine's
steps with, and a request decoded alone by the static batch (the reference its answers equal)."""

from __future__ import annotations

import threading
import time

from decode.config import DecodeConfig
from decode.static.static_batch import generate

WINDOW, SLOTS, CAPACITY, TAU = 8, 8, 512, 0.4


class Gate:
    """Wraps a Batcher: `step()` runs freely while open; closed, each step waits for `release()`."""

    def __init__(self, inner):
        self.inner = inner
        self.is_open = True
        self.sem = threading.Semaphore(0)
        self.steps = 0
        self.delay = 0.0     # seconds each step takes on top of its own (a slower, busy device)

    def close(self):
        self.sem = threading.Semaphore(0)
        self.is_open = False

    def open(self):
        self.is_open = True
        self.sem.release()   # wakes a waiting step

    def step(self):
        while not self.is_open and not self.sem.acquire(timeout=0.05):
            pass
        out = self.inner.step()
        self.steps += 1
        time.sleep(self.delay)
        return out

    def submit(self, *a, **k):
        return self.inner.submit(*a, **k)

    def cancel(self, rid):
        return self.inner.cancel(rid)

    @property
    def num_active(self):
        return self.inner.num_active

    @property
    def num_waiting(self):
        return self.inner.num_waiting


def decoded_alone(s, ids, max_tokens, stop_ids=(), with_logprobs=False, **kw):
    """The request decoded alone by the static batch (its tokens; with their log-probabilities
    when `with_logprobs`)."""
    dc = DecodeConfig(method="streaming", window=WINDOW, max_new_tokens=max_tokens, stop_token_ids=tuple(stop_ids),
                      **{"tau": TAU, **kw})
    res = generate(s["params"], s["config"], [ids], dc, capacity=CAPACITY)
    return (res.tokens[0], res.logprobs[0]) if with_logprobs else res.tokens[0]
