"""The window ladder (decode/engine/runtime/window_policy.py): one Decoder steps its state at any rung
of its window, switching between calls. Verified's output is AR greedy's whatever the rungs
(a run whose rung changes every call, dense and paged, against the AR Decoder alone); streaming
switching rungs finishes every request within its budget, and at its own window alone gives the
fixed window's tokens; the load policy measures each rung and picks the fastest."""

from __future__ import annotations

import itertools
import random

import pytest

from decode.config import DecodeConfigError
from decode.engine.runtime.batcher import Batcher
from decode.engine.runtime.window_policy import WindowPolicy, bucket_of, ladder
from decode.engine.step.state import Request
from tests import plans
from tests.decode_cases import CONFIG, TILE

CAP = 64


class Cycle:
    """A policy that steps the rungs in turn, one a call (every switch the ladder allows)."""

    def __init__(self, rungs):
        self.rungs, self.seen = itertools.cycle(rungs), []

    def choose(self, live):
        self.seen.append(next(self.rungs))
        return self.seen[-1]

    def record(self, *args):
        pass


def _requests(n, seed):
    rng = random.Random(seed)
    return [Request(prompt=tuple(rng.randrange(0, 63) for _ in range(rng.randint(1, 18))),
                    max_new_tokens=rng.randint(3, 24), tau=rng.choice([0.3, 1.0, 2.5]),
                    stop_token_ids=(rng.randrange(0, 63),) if rng.random() < 0.4 else ())
            for _ in range(n)]


def _run(batcher, requests):
    done, ids = {}, {}
    for i, r in enumerate(requests):
        ids[batcher.submit(r, on_finish=lambda f: done.__setitem__(f.request_id, f))] = i
    batcher.run_until_idle()
    return {ids[k]: v for k, v in done.items()}


def test_ladders():
    assert ladder("verified", 16) == [16, 8, 4, 2, 1]
    assert ladder("streaming", 16) == [16, 8, 4, 2]
    assert ladder("streaming", 12) == [12, 6, 3]
    assert ladder("ar", 1) == [1] and ladder("block", 8) == [8]
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


@pytest.mark.parametrize("page_size", [0, 8])
def test_verified_at_a_rung_changed_every_call_equals_ar(params, page_size):
    requests = _requests(10, seed=3)
    kw = dict(slots=4, capacity=CAP, steps_per_call=2, kv_tile=TILE, sampling=False,
              page_size=page_size)
    verified = plans.decoder(params, CONFIG, method="verified", window=8, refill="after", **kw)
    assert verified.rungs() == [8, 4, 2, 1]
    cycle = Cycle([8, 1, 4, 2, 1, 8, 2])
    got = _run(Batcher(verified, window_policy=cycle), requests)
    want = _run(Batcher(plans.decoder(params, CONFIG, method="ar", window=1, **kw)), requests)
    assert set(cycle.seen) == {8, 4, 2, 1} and len(cycle.seen) > 10
    for i in range(len(requests)):
        assert got[i].tokens == want[i].tokens, (i, got[i].tokens, want[i].tokens)
        assert got[i].finish == want[i].finish


def test_streaming_switching_rungs_finishes_every_request_and_a_rung_of_its_own_is_fixed(params):
    requests = _requests(8, seed=4)
    kw = dict(method="streaming", refill="before", slots=4, capacity=CAP, steps_per_call=2,
              kv_tile=TILE, sampling=False)
    dec = plans.decoder(params, CONFIG, window=8, **kw)
    got = _run(Batcher(dec, window_policy=Cycle([2, 8, 4])), requests)
    for i, r in enumerate(requests):
        ids = got[i].tokens
        stopped = bool(ids) and ids[-1] in r.stop_token_ids
        assert len(ids) == r.max_new_tokens or stopped, (i, ids)
        assert all(0 <= t < CONFIG.vocab_size for t in ids)
    fixed = _run(Batcher(dec), requests)
    again = _run(Batcher(dec, window_policy=Cycle([8])), requests)     # its own window: as fixed
    assert [again[i].tokens for i in range(8)] == [fixed[i].tokens for i in range(8)]
    with pytest.raises(DecodeConfigError, match="not a rung"):
        dec.generate(dec.init_state(), 0, window=3)


def test_the_load_policy_climbs_the_ladder_to_the_fastest_rung():
    p = WindowPolicy([16, 8, 4, 2, 1], explore_every=1000)
    # a machine whose step time grows with the rows (live x rung); the yield grows with the rung
    cost = lambda live, rung: 0.01 + 0.001 * live * rung
    tpf = {16: 5.0, 8: 3.0, 4: 2.0, 2: 1.4, 1: 1.0}
    rate = lambda live, r: live * tpf[r] / cost(live, r)

    def call(live):
        rung = p.choose(live)
        p.record(rung, live, 4, int(round(4 * live * tpf[rung])), 4 * cost(live, rung))
        return rung

    lone = [call(1) for _ in range(8)]
    assert lone[:4] == [16, 16, 8, 8]               # W and its neighbour measured, twice each
    assert lone[4:] == [max(tpf, key=lambda r: rate(1, r))] * 4 == [16] * 4
    full = [call(64) for _ in range(16)]            # a new bucket: the climb starts at 16
    best = max(tpf, key=lambda r: rate(64, r))
    assert best == 1 and full[-4:] == [1] * 4, full
    assert full.count(16) + full.count(8) <= 6       # the far rungs are left once passed
    assert call(1) == 16                            # the lone request keeps the widest window
    # near ties do not move: a rung 2% faster is not taken from the current one
    q = WindowPolicy([8, 4], explore_every=1000)
    for _ in range(2):
        q.record(8, 1, 1, 3, 1.0), q.record(4, 1, 1, 3, 0.98)
    assert q.choose(1) == 8


def test_a_first_call_that_compiled_does_not_keep_its_rung_away():
    p = WindowPolicy([8, 4], explore_every=1000)
    p.record(8, 1, 4, 12, 30.0)            # its first call compiled: 7.5 s a step
    p.record(8, 1, 4, 12, 0.04)            # then 0.01 s a step
    p.record(4, 1, 4, 8, 30.0)
    p.record(4, 1, 4, 8, 0.04)
    assert p.step_s[(1, 8)] == p.step_s[(1, 4)] == 0.01 and p.choose(1) == 8


def test_warm_up_under_the_load_policy_compiles_every_rung(params):
    """With `--window-policy load` warm-up compiles each rung's step programs (every live-slot
    bucket) and teaches the policy nothing; the requests after it compile nothing, whichever
    rungs the policy picks."""
    from tests.compiles import COMPILES
    dec = plans.decoder(params, CONFIG, method="verified", window=4, refill="after", slots=4,
                        capacity=CAP, steps_per_call=2, kv_tile=TILE, sampling=False, page_size=8)
    b = Batcher(dec, window_policy="load")
    names = b.warm_up_programs(CAP)
    assert "generate, 2 live slot(s), window 1" in names and "generate, 4 live slot(s)" in names
    b.warm_up(CAP)
    assert b.window_policy.calls == 0 and b.window_policy.step_s == {}
    before = len(COMPILES)
    got = _run(b, _requests(9, seed=5))
    assert len(COMPILES) == before, COMPILES[before:]
    assert len(got) == 9 and len(b.window_policy.chosen) == len(dec.rungs()) == 3
