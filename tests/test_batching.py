"""Continuous batching: the Decoder over slots and the host Batcher.

A request's greedy output is the same token for token whether it ran alone (`generate` on one
prompt), in a static batch, or among others arriving and leaving slots at random times; sampled
output depends only on the request's own seed; cancelled requests free their slot; no slot leaks
over 1000 requests; two Decoders in two threads do not interfere.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from tests import plans
from decode.engine.runtime.batcher import Batcher
from decode.config import DecodeConfig, DecodeConfigError, Placement
from decode.engine.step.state import Request
from decode.static.static_batch import generate
from tests.synthetic import random_params
from wedlm_jax.config import ModelConfig

CONFIG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     mask_token_id=63)
CAP = 64
TILE = 16


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 0, head_scale=30.0)


def _requests(n, seed=0, sampled=False):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = rng.randint(1, 20)
        out.append(Request(prompt=tuple(rng.randrange(0, 63) for _ in range(plen)),
                           max_new_tokens=rng.randint(1, 30), tau=rng.choice([0.3, 1.0, 2.5]),
                           lam=rng.choice([0.0, 0.05]),
                           temperature=rng.choice([0.0, 0.9]) if sampled else 0.0,
                           top_k=rng.choice([0, 5]), seed=rng.randrange(1000),
                           stop_token_ids=(rng.randrange(0, 63),) if rng.random() < 0.5 else ()))
    return out


def _alone(params, r: Request, method, window, refill):
    dc = DecodeConfig(method=method, window=window, refill=refill, tau=r.tau, lam=r.lam,
                      max_new_tokens=r.max_new_tokens, stop_token_ids=r.stop_token_ids,
                      temperature=r.temperature, top_k=r.top_k, seed=r.seed)
    return generate(params, CONFIG, [list(r.prompt)], dc, capacity=CAP,
                    placement=Placement(kv_tile=TILE)).tokens[0]


def _run_batcher(batcher, requests, rng=None):
    """Submit in random bursts between steps; returns {index: Finished}."""
    done, ids = {}, {}
    pending = list(enumerate(requests))
    while pending or batcher.num_active or batcher.num_waiting:
        burst = rng.randint(0, 4) if rng else len(pending)
        for i, r in pending[:burst]:
            ids[batcher.submit(r, on_finish=lambda f: done.__setitem__(f.request_id, f))] = i
        pending = pending[burst:]
        batcher.step()
    return {ids[k]: v for k, v in done.items()}


@pytest.mark.parametrize("method, refill", [("streaming", "before"), ("streaming", "after"),
                                            ("verified", "before"), ("ar", "after")])
def test_greedy_equals_alone_under_random_arrivals(params, method, refill):
    requests = _requests(14, seed=1)
    dec = plans.decoder(params, CONFIG, method=method, window=4, refill=refill, slots=4, capacity=CAP,
                  steps_per_call=3, kv_tile=TILE, sampling=False)
    got = _run_batcher(Batcher(dec), requests, random.Random(2))
    for i, r in enumerate(requests):
        want = _alone(params, r, method, 4, refill)
        assert got[i].tokens == want, (i, r, got[i].tokens, want)
        assert got[i].finish == ("stop" if want and want[-1] in r.stop_token_ids else "length")
    # the same requests as one static batch on the same Decoder settings
    batch = _run_batcher(Batcher(dec), requests)
    assert [batch[i].tokens for i in range(len(requests))] == [got[i].tokens for i in range(len(requests))]


def test_a_decoder_holding_one_weight_tree_per_layer_gives_the_same_tokens(params, monkeypatch):
    """What a Decoder on GPU does (decode/engine/planning/layouts.py: one buffer per layer's weight, layers
    unrolled), forced here on CPU: the same tokens under random arrivals, dense and paged, and
    the server's scorer reads its weights as they are."""
    import jax
    from decode.engine.planning import layouts
    from decode.serving.scoring import score
    monkeypatch.setattr(layouts, "layers_stacked", lambda platform, grouped_kernel=False: False)
    requests = _requests(5, seed=3)
    for page_size in (0, 8):
        dec = plans.decoder(params, CONFIG, window=4, slots=3, capacity=CAP, steps_per_call=3,
                      kv_tile=TILE, sampling=False, page_size=page_size)
        assert not dec.static.stacked_layers and "layer_1" in dec.params and "layers" not in dec.params
        got = _run_batcher(Batcher(dec), requests, random.Random(4))
        for i, r in enumerate(requests):
            assert got[i].tokens == _alone(params, r, "streaming", 4, "before"), (page_size, i)
    seqs = [list(r.prompt) + [5, 7] for r in requests[:3]]
    for a, b in zip(score(dec.params, CONFIG, seqs, top_n=2), score(params, CONFIG, seqs, top_n=2)):
        np.testing.assert_allclose(a["token_logprobs"][1:], b["token_logprobs"][1:], atol=1e-5)
    assert jax.tree.structure(dec.params) != jax.tree.structure(params)


def test_a_checkpoint_opened_for_gpu_is_loaded_one_tree_per_layer(tmp_path, monkeypatch):
    """`OpenCheckpoint.load` loads the layers as the platform's decode programs take them (one
    tree each on GPU, forced here), and a Decoder keeps such weights as they are (no stacked copy
    ever made); on CPU both trees decode to the same tokens."""
    import jax
    from decode.engine.planning import layouts
    from decode.checkpoint import OpenCheckpoint
    from tests.tiny_checkpoint import make_checkpoint
    folder, config, _ = make_checkpoint(tmp_path)
    stacked = OpenCheckpoint.open(folder).load()[1]
    monkeypatch.setattr(layouts, "layers_stacked", lambda platform, grouped_kernel=False: False)
    _, per_layer, _ = OpenCheckpoint.open(folder).load()
    assert "layers" in stacked and "layer_1" in per_layer and "layers" not in per_layer
    dec = plans.decoder(per_layer, config, window=4, slots=2, capacity=CAP, kv_tile=TILE, sampling=False)
    assert not dec.static.stacked_layers
    assert all(a is b for a, b in zip(jax.tree.leaves(dec.params), jax.tree.leaves(per_layer)))
    monkeypatch.undo()
    ref = plans.decoder(stacked, config, window=4, slots=2, capacity=CAP, kv_tile=TILE, sampling=False)
    assert ref.static.stacked_layers
    reqs = [Request(prompt=(5, 6, 7), max_new_tokens=12, tau=0.3),
            Request(prompt=(9, 3), max_new_tokens=9, tau=0.3)]
    got, want = _run_batcher(Batcher(dec), reqs), _run_batcher(Batcher(ref), reqs)
    assert [got[i].tokens for i in range(2)] == [want[i].tokens for i in range(2)]
    assert all(len(got[i].tokens) > 0 for i in range(2))


def test_a_call_ends_when_a_new_request_has_its_first_tokens(params):
    """`generate` runs its k steps while every live slot has emitted before; with a request just
    inserted it ends at the step of that request's first commit (the step before emitted nothing
    for it), so the first tokens reach the host then; the running slot's tokens are unchanged."""
    dec = plans.decoder(params, CONFIG, method="streaming", window=4, slots=2, capacity=CAP,
                  steps_per_call=8, kv_tile=TILE, sampling=False)
    long = Request(prompt=(5, 6, 7), max_new_tokens=50, tau=0.3)
    state = dec.start([long, None])
    state, first = dec.generate(state)                  # slot 0 is new: ends at its first commit
    assert 1 <= first.steps < 8 and first.counts[0, first.steps - 1] > 0
    assert not first.counts[0, :first.steps - 1].any()
    state, full = dec.generate(state)                   # nothing new: all k steps
    assert full.steps == 8 and not full.done[0]
    new = Request(prompt=(9, 10), max_new_tokens=20, tau=0.3)
    state = dec.insert(dec.prefill(new), state, 1)
    state, cut = dec.generate(state)
    s = cut.steps
    assert 1 <= s < 8 and cut.counts[1, s - 1] > 0 and not cut.counts[1, :s - 1].any()
    ids = first.new_ids(0) + full.new_ids(0) + cut.new_ids(0)
    while not (cut.done[0] and cut.done[1]):
        state, cut = dec.generate(state)
        ids += cut.new_ids(0)
    assert ids == _alone(params, long, "streaming", 4, "before")


def test_sampled_depends_only_on_own_seed(params):
    requests = _requests(10, seed=3, sampled=True)
    dec = plans.decoder(params, CONFIG, window=4, slots=4, capacity=CAP, steps_per_call=2, kv_tile=TILE)
    a = _run_batcher(Batcher(dec), requests, random.Random(4))
    b = _run_batcher(Batcher(dec), requests[::-1], random.Random(5))
    n = len(requests)
    assert [a[i].tokens for i in range(n)] == [b[n - 1 - i].tokens for i in range(n)]
    reseeded = [Request(**{**r.__dict__, "seed": r.seed + 1}) for r in requests]
    c = _run_batcher(Batcher(dec), reseeded)
    hot = [i for i, r in enumerate(requests) if r.temperature > 0 and r.max_new_tokens > 3]
    assert any(c[i].tokens != a[i].tokens for i in hot)


def test_cancel_frees_the_slot_and_no_slot_leaks(params):
    dec = plans.decoder(params, CONFIG, window=4, slots=4, capacity=CAP, steps_per_call=2, kv_tile=TILE,
                  sampling=False)
    batcher = Batcher(dec)
    finished = []
    long = Request(prompt=(1, 2, 3), max_new_tokens=60, tau=0.0)      # one token a step
    emitted = []
    rid = batcher.submit(long, on_tokens=lambda _, ids: emitted.extend(ids),
                         on_finish=finished.append)
    for _ in range(20):                  # until the request has committed something
        batcher.step()
        if emitted:
            break
    assert batcher.num_active == 1 and emitted
    batcher.cancel(rid)
    batcher.step()
    assert batcher.num_active == 0 and finished[0].finish == "cancelled"
    assert 0 < len(finished[0].tokens) < 60
    assert finished[0].tokens == emitted
    assert finished[0].steps > len(finished[0].tokens) and finished[0].n_fwd >= finished[0].steps
    # 1000 short requests through 4 slots: every one finishes once, nothing stays behind
    rng = random.Random(9)
    count = {}
    for i in range(1000):
        r = Request(prompt=tuple(rng.randrange(0, 63) for _ in range(rng.randint(1, 6))),
                    max_new_tokens=rng.randint(1, 3), tau=2.5)
        batcher.submit(r, on_finish=lambda f: count.__setitem__(f.request_id,
                                                                 count.get(f.request_id, 0) + 1))
    batcher.run_until_idle()
    assert len(count) == 1000 and set(count.values()) == {1}
    assert batcher.num_active == 0 and batcher.num_waiting == 0
    assert bool(np.all(np.asarray(batcher.state.done)))


def test_two_decoders_in_two_threads(params):
    requests = _requests(6, seed=6)
    results = {}

    def work(name, method):
        dec = plans.decoder(params, CONFIG, method=method, window=4, slots=2, capacity=CAP,
                      steps_per_call=2, kv_tile=TILE, sampling=False)
        results[name] = _run_batcher(Batcher(dec), requests)

    threads = [threading.Thread(target=work, args=(m, m)) for m in ("streaming", "ar")]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for method in ("streaming", "ar"):
        for i, r in enumerate(requests):
            assert results[method][i].tokens == _alone(params, r, method, 4, "before")


def test_bad_requests_and_settings_named(params):
    dec = plans.decoder(params, CONFIG, window=4, slots=2, capacity=CAP, kv_tile=TILE, sampling=False)
    # a Request's own settings are checked when it is made, the rest against the Decoder at submit
    cases = [(dict(prompt=()), "prompt"), (dict(prompt=(1, 99)), "token id 99"),
             (dict(prompt=(1,) * 65), "longer than the capacity 64"),
             (dict(prompt=(1,), max_new_tokens=0), "max_new_tokens"),
             (dict(prompt=(1,), tau=-1.0), "tau"), (dict(prompt=(1,), top_p=0.0), "top_p"),
             (dict(prompt=(1,), stop_token_ids=tuple(range(17))), "at most 16"),
             (dict(prompt=(1,), sampling_order="random"), "sampling_order"),
             (dict(prompt=(1,), temperature=1.0), "sampling=True")]
    batcher = Batcher(dec)
    for kw, words in cases:
        with pytest.raises(DecodeConfigError, match=words.replace("(", r"\(")):
            batcher.submit(Request(**kw))
    assert batcher.num_waiting == 0
    for kw, words in [(dict(refill="middle"), "refill 'middle' is unknown; allowed: before, after"),
                      (dict(window=100), "window 100 is larger than the capacity"),
                      (dict(capacity=4096), "max_position_embeddings"),
                      (dict(method="beam"), "method 'beam' is unknown")]:
        with pytest.raises(DecodeConfigError, match=words):
            plans.decoder(params, CONFIG.replace(max_position_embeddings=2048), **{"capacity": CAP, **kw})
