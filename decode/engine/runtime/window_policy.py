"""The window sized to the load: which rung of the window ladder each device call steps with.

A step of `live` slots at window `w` computes about `live * span(w)` rows. While the step is bound
by the weights' bytes, rows are nearly free and the widest window commits the most tokens a
second; once the rows make it compute-bound, each extra row costs time and the tokens a forward
no longer pay for it (on a CPU after a few slots, on an accelerator after hundreds of rows). The
crossover moves with the machine, the model and the text, so it is measured, not assumed:

  ladder      the rungs a Decoder steps with (`Decoder.rungs`): its window W, W/2, ... down to 1
              for verified (a window of one slot is AR decoding: the pending token alone) and to
              2 for streaming; AR and block have one rung (block's window is its block).
  step time   seconds a step, per (live-slot bucket, rung): an average over the calls run there.
  yield       tokens committed per forward per live slot, per rung: an average over its calls.
  choice      a climb along the ladder per bucket: from the rung the bucket ran last (a new
              bucket starts at the nearest bucket's, the first at W), the rung and its two
              neighbours are measured (twice each: a first call may have compiled its program,
              the second call's time replaces it), then the call takes the one with the most
              tokens a second, live * yield / step time; one rung a move, so a few calls find
              the best rung without running the far ones. Every `explore_every` calls a
              neighbour is measured again (the text and the load drift). A move needs a
              predicted gain above `margin`, so the choice does not thrash between near ties.

Switching happens only between device calls, over the same state (`programs.at_rung`): verified's
output is AR's at every rung; streaming's depends on the rungs it ran (docs/algorithm.md).
Pure host code: `WindowPolicy` sees only what the Batcher reports after each call.
"""

from __future__ import annotations

import dataclasses

from wedlm_jax.buckets import pow2_at_least


def ladder(method: str, window: int) -> list[int]:
    """The rungs of `method` at window `window`, largest first."""
    if method in ("ar", "block"):
        return [window]
    low = 1 if method == "verified" else 2
    rungs, w = [], window
    while w >= low:
        rungs.append(w)
        w //= 2
    return rungs or [window]


def bucket_of(live: int) -> int:
    """The live-slot bucket a call of `live` slots runs in (a power of two)."""
    return pow2_at_least(live)


@dataclasses.dataclass
class WindowPolicy:
    """Picks a rung of `rungs` per call from the live slots and what the calls before measured."""
    rungs: list
    explore_every: int = 16
    margin: float = 0.05
    decay: float = 0.3          # the share of the averages' past a new call lets go
    step_s: dict = dataclasses.field(default_factory=dict)     # (bucket, rung) -> s a step
    yield_: dict = dataclasses.field(default_factory=dict)     # rung -> tokens / forward / slot
    seen_at: dict = dataclasses.field(default_factory=dict)    # (bucket, rung) -> call number
    samples: dict = dataclasses.field(default_factory=dict)    # (bucket, rung) -> calls measured
    sums: dict = dataclasses.field(default_factory=dict)       # the averages' decayed sums
    current: dict = dataclasses.field(default_factory=dict)    # bucket -> the rung it runs
    calls: int = 0
    chosen: dict = dataclasses.field(default_factory=dict)     # rung -> calls run there

    def rate(self, bucket: int, rung: int, live: int) -> float | None:
        """Predicted tokens a second at `rung` with `live` slots (None: not measured)."""
        s, y = self.step_s.get((bucket, rung)), self.yield_.get(rung)
        return None if s is None or y is None else live * y / max(s, 1e-9)

    def choose(self, live: int) -> int:
        """The rung the next call of `live` live slots steps with: a climb along the ladder from
        the rung this bucket ran last (a new bucket starts from the nearest bucket's), one rung
        at a time, each neighbour measured before it is compared."""
        if len(self.rungs) == 1:
            return self.rungs[0]
        b = bucket_of(live)
        here = self.current.get(b) or self.current.get(self._nearest(b), self.rungs[0])
        self.current[b] = here
        i = self.rungs.index(here)
        near = [self.rungs[j] for j in (i - 1, i + 1) if 0 <= j < len(self.rungs)]
        for r in [here] + near:                  # here and its neighbours measured first
            if self.samples.get((b, r), 0) < 2 or r not in self.yield_:
                return r
        if self.calls and self.calls % self.explore_every == 0:    # the load and text drift
            return min(near, key=lambda r: self.seen_at.get((b, r), -1))
        best = max([here] + near, key=lambda r: self.rate(b, r, live))
        if self.rate(b, best, live) > (1 + self.margin) * self.rate(b, here, live):
            self.current[b] = best
        return self.current[b]

    def _nearest(self, bucket: int) -> int | None:
        """The bucket with a rung of its own nearest to `bucket` (None: none yet)."""
        return min(self.current, key=lambda x: abs(x.bit_length() - bucket.bit_length()),
                   default=None)

    def record(self, rung: int, live: int, steps: int, tokens: int, seconds: float) -> None:
        """What a call at `rung` over `live` slots did: `steps` forwards, `tokens` committed,
        in `seconds`. A call that ran no step teaches nothing."""
        self.calls += 1
        self.chosen[rung] = self.chosen.get(rung, 0) + 1
        if steps <= 0 or live <= 0:
            return
        key = (bucket_of(live), rung)
        # a rung's first call at a bucket may have compiled its program: the second replaces it
        first = self.samples.get(key, 0) == 1
        self.samples[key] = self.samples.get(key, 0) + 1
        # ratios of decayed sums: a call weighs by its steps (a call cut short after a step or
        # two, at a new request's first tokens, carries its fixed cost over few steps)
        self.step_s[key] = self._ratio(("s",) + key, seconds, steps, reset=first)
        self.yield_[rung] = self._ratio(("y", rung), tokens, steps * live)
        self.seen_at[key] = self.calls

    def _ratio(self, key, num: float, den: float, reset: bool = False) -> float:
        old = None if reset else self.sums.get(key)
        keep = 1.0 - self.decay
        n, d = (num, den) if old is None else (keep * old[0] + num, keep * old[1] + den)
        self.sums[key] = (n, d)
        return n / d
