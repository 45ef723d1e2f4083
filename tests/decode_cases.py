"""What the decoding tests share: a tiny random Qwen3-shaped model (hidden 32, 2 layers, vocab 64)
with its capacity, cache tile and four prompts (tests/test_decode.py, tests/test_logprobs.py,
tests/test_verified.py, tests/test_paged_decode.py, tests/test_kv_int8.py), and the paged tests'
requests over shared prefixes with their random arrival at a Batcher."""

from __future__ import annotations

import random

from decode.engine.step.state import Request
from decode.engine.runtime.batcher import Batcher
from wedlm_jax.config import ModelConfig

CONFIG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     mask_token_id=63)
CAP = 40
TILE = 16  # several cache tiles per forward: exercises the tiled (read-what-is-live) attention
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13], [14, 15, 16, 17, 18]]


def paged_requests(n, seed=0, shared=3):
    """Prompts over a few shared prefixes (longer than a page, so prefixes are reused)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 60) for _ in range(rng.randrange(9, 30))] for _ in range(shared)]
    return [Request(prompt=tuple(rng.choice(prefixes) + [rng.randrange(1, 60)
                                                        for _ in range(rng.randrange(1, 6))]),
                    max_new_tokens=rng.randrange(4, 20), tau=rng.choice([0.0, 0.4, 1.0]))
            for _ in range(n)]


def run_requests(decoder, requests, seed=1, prefix_reuse=True, cancel=()):
    """Random arrival: a few requests submitted between steps. {index: Finished}."""
    rng = random.Random(seed)
    b = Batcher(decoder, prefix_reuse=prefix_reuse)
    out, todo = {}, list(enumerate(requests))
    while todo or b.num_active or b.num_waiting:
        for _ in range(rng.randrange(0, 4)):
            if todo:
                i, r = todo.pop(0)
                rid = b.submit(r, on_finish=lambda f, i=i: out.__setitem__(i, f))
                if i in cancel:
                    b.cancel(rid)
        b.step()
        if b.pool is not None:
            b.pool.check()
    return out, b
