"""The paged KV cache in the Decoder and the Batcher: every method gives the tokens of the
dense cache, token for token, under random arrival, in a static batch, with prefix hits and
without; a pool smaller than the slots' worst case queues instead of corrupting; no page leaks
after 1000 requests with cancellations; a request larger than the pool is refused with the sizes."""

from __future__ import annotations

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import plans
from decode.engine.runtime.batcher import Batcher
from decode.config import DecodeConfigError
from decode.engine.step.state import Request
from tests.synthetic import random_params
from tests.decode_cases import CONFIG, paged_requests, run_requests

CAPACITY, SLOTS, PAGE = 96, 4, 8
# the small pool of every test that wants pressure on it: one pool size, so its programs (which
# the pool's shape shapes) compile once per method for all of them
SMALL_POOL = 14
METHODS = [("streaming", "before"), ("streaming", "after"), ("block", "before"), ("ar", "before"),
           ("verified", "before")]


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, seed=2, head_scale=20.0)


def _decoder(params, method, refill, **kw):
    return plans.decoder(params, CONFIG, method=method, window=4, refill=refill, slots=SLOTS,
                   capacity=CAPACITY, steps_per_call=3, kv_tile=16, **kw)


@pytest.mark.parametrize("method, refill", METHODS)
def test_paged_equals_dense_under_random_arrival(params, method, refill):
    reqs = paged_requests(14, seed=METHODS.index((method, refill)))
    dense, _ = run_requests(_decoder(params, method, refill), reqs)
    paged, b = run_requests(_decoder(params, method, refill, page_size=PAGE), reqs)
    assert [paged[i].tokens for i in range(len(reqs))] == [dense[i].tokens for i in range(len(reqs))]
    assert [paged[i].finish for i in range(len(reqs))] == [dense[i].finish for i in range(len(reqs))]
    assert sum(f.cached_tokens for f in paged.values()) > 0          # prefixes were reused
    assert b.pool.num_held == 0
    b.pool.check()


@pytest.mark.parametrize("method, refill", [("streaming", "before"), ("block", "after")])
def test_paged_equals_dense_with_suffixes_of_one_chunk_and_of_several(params, method, refill):
    """Prefill chunks of 16 rows: a suffix of one chunk (most reused prefixes' rests) is computed
    in the first fill's forward alone, a longer one in chunks before it and its last chunk in
    that forward (pulled back inside the suffix); both give the tokens of the dense cache (its
    prompts prefilled whole: the Decoder the tests above compiled)."""
    reqs = paged_requests(12, seed=7)
    dense, _ = run_requests(_decoder(params, method, refill), reqs)
    paged, _ = run_requests(_decoder(params, method, refill, page_size=PAGE, prefill_chunk=16), reqs)
    assert [paged[i].tokens for i in range(12)] == [dense[i].tokens for i in range(12)]
    suffixes = [len(r.prompt) - paged[i].cached_tokens for i, r in enumerate(reqs)]
    assert min(suffixes) <= 16 < max(suffixes), suffixes            # both paths taken


def test_prefix_hits_give_the_tokens_of_misses_and_skip_the_rows(params):
    reqs = paged_requests(10, seed=5)
    dec = _decoder(params, "streaming", "before", page_size=PAGE)
    hits, _ = run_requests(dec, reqs, prefix_reuse=True)
    misses, _ = run_requests(dec, reqs, prefix_reuse=False)
    assert [hits[i].tokens for i in range(10)] == [misses[i].tokens for i in range(10)]
    assert all(f.cached_tokens == 0 for f in misses.values())
    assert all(f.cached_tokens % PAGE == 0 and f.cached_tokens < len(r.prompt)
               for f, r in zip((hits[i] for i in range(10)), reqs))
    assert sum(f.cached_tokens for f in hits.values()) >= 3 * PAGE


def test_static_batch_paged_equals_dense(params):
    reqs = paged_requests(SLOTS, seed=9)
    outs = []
    for kw in ({}, {"page_size": PAGE}):
        dec = _decoder(params, "streaming", "before", **kw)
        state = dec.start(reqs)
        tokens = [[] for _ in reqs]
        while True:
            state, res = dec.generate(state)
            for i in range(len(reqs)):
                tokens[i] += res.new_ids(i)
            if res.done.all():
                break
        outs.append(tokens)
    assert outs[0] == outs[1]


def test_a_small_pool_queues_and_gives_the_same_tokens(params):
    """A pool of 14 pages for four slots (a request's worst case is 13: capacity and a window;
    the preemption tests' pool, so the programs compiled for it are shared): requests wait for
    pages (or are preempted and continue: AR continues exactly), none is corrupted."""
    reqs = paged_requests(8, seed=3)
    dense, _ = run_requests(_decoder(params, "ar", "before"), reqs)
    dec = _decoder(params, "ar", "before", page_size=PAGE, num_pages=SMALL_POOL)
    small, b = run_requests(dec, reqs)
    assert [small[i].tokens for i in range(8)] == [dense[i].tokens for i in range(8)]
    assert b.pool.num_held == 0


def test_no_page_leak_after_1000_requests_with_cancellations(params):
    rng = random.Random(7)
    reqs = [Request(prompt=tuple(rng.randrange(1, 60) for _ in range(rng.randrange(1, 20))),
                    max_new_tokens=rng.randrange(1, 4)) for _ in range(1000)]
    dec = _decoder(params, "streaming", "before", page_size=PAGE, num_pages=SMALL_POOL)
    out, b = run_requests(dec, reqs, cancel=set(range(0, 1000, 7)))
    assert len(out) == 1000
    assert sum(f.finish == "cancelled" for f in out.values()) > 50
    assert b.pool.num_held == 0 and b.pool.num_free == b.pool.num_pages
    b.pool.check()


def test_a_request_larger_than_the_pool_is_refused_with_the_sizes(params):
    dec = _decoder(params, "streaming", "before", page_size=PAGE, num_pages=10)
    b = Batcher(dec)
    with pytest.raises(DecodeConfigError, match=r"needs 13 pages of 8 rows .* the whole pool holds 10"):
        b.submit(Request(prompt=(1,) * 60, max_new_tokens=36))  # 96 + a window's 8 rows: 13 pages
    b.submit(Request(prompt=(1,) * 30, max_new_tokens=20))      # 58 rows: 8 pages, fits
    with pytest.raises(DecodeConfigError, match=r"num_pages must be an int in \[1, "):
        _decoder(params, "streaming", "before", page_size=PAGE, num_pages=0)
    with pytest.raises(DecodeConfigError, match="a static batch needs"):
        dec.start(paged_requests(2))
    with pytest.raises(DecodeConfigError, match=r"page_size must be an int in \[0, "):
        _decoder(params, "streaming", "before", page_size=-8)
    assert not _decoder(params, "streaming", "before", page_size=0).paged   # 0: the dense cache
    assert np.all(np.asarray(b.state.cache.layers["table"]) == -1)


def test_server_with_pages_reports_cached_tokens(tmp_path):
    """wedlm-serve --page-size: a request sharing a prompt with an earlier one reports the reused
    rows as usage.prompt_tokens_details.cached_tokens (OpenAI's and vLLM's field) and answers the
    same text."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from decode.serving import serve
    from tests.live_server import serve_in_thread
    from tests.tiny_checkpoint import make_checkpoint
    path, _, _ = make_checkpoint(tmp_path)
    args = serve._parser().parse_args(["--checkpoint", path, "--slots", "2", "--window", "4",
                                       "--capacity", "128", "--page-size", "8", "--model-name", "tiny",
                                       "--no-default-stops", "--lazy-compile"])
    engine, app, _ = serve.build_server(args)
    url, srv, thread, sock = serve_in_thread(app)
    try:
        body = {"model": "tiny", "prompt": "one two three four five six seven eight nine ten " * 2,
                "max_tokens": 6}
        a = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        b = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert "prompt_tokens_details" not in a["usage"]
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] % 8 == 0
    finally:
        srv.should_exit = True
        thread.join(15)
        engine.shutdown(timeout=15)
        sock.close()


def test_pages_are_mapped_as_a_sequence_grows(params):
    """A request holds the pages its prompt and its next generate call can write, not its whole
    budget: fewer at admission, more as it decodes, never past the budget; the tokens are the
    dense cache's."""
    req = Request(prompt=tuple(range(3, 13)), max_new_tokens=80)
    dec = _decoder(params, "streaming", "before", page_size=PAGE)
    b, out, held = Batcher(dec), {}, []
    b.submit(req, on_finish=lambda f: out.__setitem__(0, f))
    while b.step():
        if b._slots[0] is not None:
            held.append(len(b._slots[0].pages))
    dense, _ = run_requests(_decoder(params, "streaming", "before"), [req])
    assert out[0].tokens == dense[0].tokens and len(out[0].tokens) == 80
    budget = dec.pages_needed(req)
    assert held[0] == dec.pages_for_call(10, 90) < budget
    assert held == sorted(held) and held[-1] <= budget and held[-1] > held[0]
    assert b.pool.num_held == 0 and b.preemptions == 0


def _growing(seed):
    """Short prompts with outputs that grow well past their first pages."""
    rng = random.Random(seed)
    return [Request(prompt=tuple(rng.randrange(1, 60) for _ in range(rng.randrange(3, 20))),
                    max_new_tokens=rng.randrange(30, 60)) for _ in range(8)]


@pytest.mark.parametrize("method", ["ar", "verified"])
def test_preempted_requests_continue_exactly_where_they_were(params, method):
    """A pool too small for every live request's growth preempts the newest: its pages go back,
    it is prefilled again from its prompt and emitted tokens, and greedy AR / verified give the
    dense cache's tokens for every request, preempted or not; nothing leaks."""
    reqs = _growing(13)
    dense, _ = run_requests(_decoder(params, method, "before"), reqs)
    small, b = run_requests(_decoder(params, method, "before", page_size=PAGE, num_pages=SMALL_POOL), reqs)
    assert b.preemptions > 0 and sum(f.preempted for f in small.values()) == b.preemptions
    assert [small[i].tokens for i in range(8)] == [dense[i].tokens for i in range(8)]
    assert [small[i].finish for i in range(8)] == [dense[i].finish for i in range(8)]
    assert b.pool.num_held == 0
    b.pool.check()


def test_streaming_under_preemption_keeps_every_other_request_intact(params):
    """Streaming restarts a preempted request's window (its emitted tokens stand, its budget is
    kept); the requests never preempted give the dense cache's tokens."""
    reqs = _growing(14)
    dense, _ = run_requests(_decoder(params, "streaming", "before"), reqs)
    small, b = run_requests(_decoder(params, "streaming", "before", page_size=PAGE, num_pages=SMALL_POOL),
                    reqs)
    assert b.preemptions > 0
    kept = [i for i in range(8) if small[i].preempted == 0]
    assert kept and all(small[i].tokens == dense[i].tokens for i in kept)
    for i, r in enumerate(reqs):
        assert 0 < len(small[i].tokens) <= r.max_new_tokens
        if small[i].finish == "length":
            assert len(small[i].tokens) == min(r.max_new_tokens, CAPACITY - len(r.prompt))
    assert b.pool.num_held == 0
    b.pool.check()


@pytest.mark.parametrize("method,refill", [("streaming", "before"), ("streaming", "after"),
                                           ("block", "after"), ("ar", "after")])
def test_a_paged_admission_runs_the_first_fill_of_a_window_method(params, method, refill):
    """Streaming and block admit a request with its first step already run (its window's first
    fill, which commits nothing), so its first generate step can commit; AR's first step emits,
    so it stays in generate. The tokens are those of the dense cache (the tests above)."""
    dec = _decoder(params, method, refill, page_size=PAGE)
    r = Request(prompt=(3, 4, 5, 6, 7), max_new_tokens=12, tau=0.3)
    state = dec.prefill_into_slot(dec.init_state(), r, 1, list(range(dec.pages_needed(r))))
    steps, count = int(np.asarray(state.steps)[1]), int(np.asarray(state.count)[1])
    filled = np.asarray(state.filled)[1]
    if method == "ar":
        assert steps == 0 and count == 0
    else:
        assert steps == 1 and count == 0 and filled.any()
        assert int(np.asarray(state.n_fwd)[1]) == dec.window         # one forward of W slots
        assert int(np.asarray(state.cache.length)[1]) == len(r.prompt)  # nothing committed


def test_a_readmitted_request_prefills_from_what_is_reused_at_readmission(params):
    """A request that reused a cached prefix at its first admission, preempted, and readmitted
    after that prefix was evicted prefills its whole prompt again (its prefill starts at the rows
    reused at this admission, not at the first one's); AR gives the dense cache's tokens."""
    prefix = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]            # > one page of 8 rows
    first = Request(prompt=tuple(prefix + [20]), max_new_tokens=3)
    again = Request(prompt=tuple(prefix + [21, 22]), max_new_tokens=12)
    dense, _ = run_requests(_decoder(params, "ar", "after"), [first, again])
    b = Batcher(_decoder(params, "ar", "after", page_size=PAGE))
    out = {}
    b.submit(first, on_finish=lambda f: out.__setitem__(0, f))
    b.run_until_idle()                                         # its prefix page stays cached
    b.submit(again, on_finish=lambda f: out.__setitem__(1, f))
    b.step()                                                   # admitted with the cached page
    slot = next(s for s, live in enumerate(b._slots) if live is not None)
    assert b._slots[slot].reused == PAGE
    b._preempt(slot)                                           # its pages go back ...
    for pool in b.pool.pools:                                  # ... and every cached page is evicted
        while pool.num_cached:
            pool._evict_one()
    layers = b.state.cache.layers                               # no page holds anything now
    b.state = b.state.replace(cache=b.state.cache.replace(
        layers=dict(layers, pool=jnp.zeros_like(layers["pool"]))))
    b.run_until_idle()
    assert out[1].preempted == 1 and out[1].cached_tokens == PAGE
    assert out[1].tokens == dense[1].tokens
    b.pool.check()


@pytest.mark.parametrize("method,refill,sampling", [("streaming", "after", False),
                                                    ("verified", "before", True)])
def test_a_live_slot_bucket_steps_its_slots_alone_with_the_tokens_of_every_slot(params, method,
                                                                                refill, sampling):
    """`generate(live=...)` steps only the smallest power-of-two bucket holding the live slots
    (gathered, stepped over the shared pool, scattered back): the tokens, log-probabilities and
    the whole state after it (pool included) are those of a call over every slot; one program
    per bucket, whichever slots are live."""
    from decode.engine.step.programs import compiled_count
    dec = plans.decoder(params, CONFIG, method=method, window=4, refill=refill, slots=8,
                  capacity=CAPACITY, steps_per_call=3, kv_tile=16, page_size=PAGE,
                  sampling=sampling, top_logprobs=2)
    assert dec.live_buckets() == [1, 2, 4]
    reqs = {6: Request(prompt=(3, 4, 5, 6, 7, 8, 9, 10, 11), max_new_tokens=9, tau=0.3,
                       temperature=0.8 if sampling else 0.0, seed=5, top_logprobs=2),
            1: Request(prompt=(9, 2, 7), max_new_tokens=14, tau=0.0)}

    def admitted():
        state, first = dec.init_state(), 0
        for slot, r in reqs.items():
            need = dec.pages_needed(r)
            state = dec.prefill_into_slot(state, r, slot, list(range(first, first + need)))
            first += need
        return state

    full, bucket = admitted(), admitted()
    for call in range(3):
        full, want = dec.generate(full)
        before = compiled_count()
        bucket, got = dec.generate(bucket, live=[6, 1])
        assert compiled_count() == before + (call == 0)             # bucket 2, compiled once
        for slot in reqs:
            assert got.new_ids(slot) == want.new_ids(slot)
            assert got.new_ids(slot) or call > 0
            np.testing.assert_allclose([lp for lp, _ in got.new_logprobs(slot, 2)],
                                       [lp for lp, _ in want.new_logprobs(slot, 2)], atol=1e-5)
        for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(bucket)):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                       atol=1e-5)
    before = compiled_count()
    bucket, _ = dec.generate(bucket, live=[3, 0])        # other slots, the same bucket
    assert compiled_count() == before


def test_a_slot_left_out_of_a_live_bucket_does_not_move(params):
    dec = _decoder(params, "ar", "before", page_size=PAGE)
    r = Request(prompt=(3, 4, 5), max_new_tokens=6)
    state = dec.init_state()
    state = dec.prefill_into_slot(state, r, 0, list(range(dec.pages_needed(r))))
    state = dec.prefill_into_slot(state, r, 2, list(range(8, 8 + dec.pages_needed(r))))
    state, res = dec.generate(state, live=[2])
    assert res.new_ids(2) and not res.new_ids(0)
    assert int(np.asarray(state.count)[0]) == 0 and int(np.asarray(state.count)[2]) > 0
    with pytest.raises(DecodeConfigError, match="slot must be an int"):
        dec.generate(state, live=[SLOTS])


def test_a_live_slot_bucket_updates_the_pool_in_place(params):
    """The bucket program gathers the live slots' rows, never the pool: compiled for two pool
    sizes, the donated pool is aliased to the output and the temporaries do not grow with it."""
    from decode.engine.step.programs import generate_live
    memory = []
    for pages in (64, 512):
        dec = _decoder(params, "streaming", "before", page_size=PAGE, num_pages=pages)
        state = dec.init_state()
        pool = state.cache.layers["pool"]
        m = generate_live.lower(dec.static, dec.steps_per_call, dec.params, state,
                      jnp.arange(2, dtype=jnp.int32), jnp.int32(dec.mask_id),
                      jnp.int32(1)).compile().memory_analysis()
        memory.append((pool.size * pool.dtype.itemsize, m.alias_size_in_bytes,
                       m.temp_size_in_bytes))
    (small, alias_small, temp_small), (big, alias_big, temp_big) = memory
    assert alias_small >= small and alias_big >= big, memory
    assert temp_big - temp_small < 0.05 * (big - small), memory


def test_the_servers_warm_up_compiles_every_live_slot_bucket(params):
    """After `Batcher.warm_up` nothing compiles while serving: a lone request, two, a full batch
    (every live-slot bucket and the every-slot program), pages mapped as they grow, and a long
    prompt (the warm-up's prompts reuse no prefix of one another, so every prompt bucket's
    prefill was compiled)."""
    from decode.engine.step.programs import compiled_count
    b = Batcher(_decoder(params, "streaming", "after", page_size=PAGE))
    b.warm_up(CAPACITY)
    before = compiled_count()
    for n in (1, 2, SLOTS):
        for r in paged_requests(n, seed=n):
            b.submit(dataclasses.replace(r, prompt=r.prompt[:15]))
        b.run_until_idle()
    b.submit(Request(prompt=tuple(range(1, 61)) + tuple(range(1, 11)), max_new_tokens=8))
    b.run_until_idle()
    assert compiled_count() == before


def test_choices_of_one_prompt_submitted_together_share_its_full_pages(params):
    """A request's n choices (the server submits them together, each its own seed) map the
    prompt's full pages the first choice prefilled: each later one computes only the last,
    partial page."""
    dec = _decoder(params, "streaming", "before", page_size=PAGE)
    b, out = Batcher(dec), {}
    prompt = tuple(range(1, 1 + 3 * PAGE + 5))            # 3 full pages and 5 rows
    for i in range(3):
        b.submit(Request(prompt=prompt, max_new_tokens=6, tau=1.0, seed=i),
                 on_finish=lambda f, i=i: out.__setitem__(i, f))
    while b.num_active or b.num_waiting:
        b.step()
    assert [out[i].cached_tokens for i in range(3)] == [0, 3 * PAGE, 3 * PAGE]
    b.pool.check()
