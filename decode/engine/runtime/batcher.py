"""Continuous batching on the host: requests wait in a queue, take a free slot when one opens,
and leave it the moment they finish, so no slot idles while a slower neighbour runs on.

    batcher = Batcher(decoder)
    rid = batcher.submit(Request(prompt=ids, max_new_tokens=64), on_tokens=..., on_finish=...)
    while batcher.step():      # insert waiting requests, one generate chunk, hand out new ids
        pass

`submit` and `cancel` are thread-safe; `step` must be called from one thread (the one that owns
the device) and the callbacks run on it: on_tokens(request_id, new_ids) after every chunk that
gave the request ids, on_finish(Finished) once.

With a paged Decoder (`page_size`), pages come from the pool (`decode.engine.runtime.pages.PagePool`, one per
slot shard) as a sequence grows: at admission what its prompt and first generate call can write
(`Decoder.pages_for_call`), before every later call what that call can write, all back at its end;
a prompt prefix's full pages an earlier request computed (under the same LoRA adapter, or both on
the base) are mapped, not computed again (`prefix_reuse`; `Finished.cached_tokens`). Live
requests grow first, oldest first; a waiting request is admitted from the pages left after that,
waiting at the head of the queue (first come, first served) while the pool cannot give its first
pages. When the live requests cannot all grow, the newest is preempted: its slot and pages go
back and it heads the queue as its prompt plus the tokens it emitted, prefilled again to go on
(its tokens stand; AR and verified continue exactly; streaming and block start a fresh window,
a sampled request's draws restart from its seed). A request larger than the pool is refused.

With slots over data x fsdp (a mesh), each slot shard has a pool of its own (`ShardedPool`): a
request goes to a free slot of the shard holding the longest cached prefix of its prompt (then
the most free pages), and a shard short of pages preempts only its own newest request.

A guided Batcher with host parsers (a server's) steps with the programs holding the host parser's
call only while a live request needs one (decode.engine.runtime.parser_programs); while they compile in
the background (`warm_up(background=True)`) such requests wait and the others go past them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

import jax

from decode.config import DecodeConfigError
from decode.engine.runtime import warm_up
from decode.engine.runtime.decoder import Decoder
from decode.engine.runtime.parser_programs import ParserPrograms, needs_parser, with_parsers
from decode.engine.step.state import Request
from decode.engine.runtime.pages import ROOT, ShardedPool
from decode.engine.runtime.window_policy import WindowPolicy

log = logging.getLogger(__name__)


def _failure(e: Exception) -> str:
    """A failed device call, in one line: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


@dataclasses.dataclass
class Finished:
    request_id: int
    tokens: list          # every generated id
    finish: str           # 'stop' | 'length' | 'cancelled' | 'error'
    steps: int            # forwards while the request was live
    n_fwd: int            # token slots processed for it (p_cache = len(tokens) / n_fwd)
    accepted: int = 0     # verified: drafts accepted
    rejected: int = 0     # verified: drafts rejected
    wall_s: float = 0.0   # submit to finish
    error: str | None = None   # finish 'error': what failed (the other requests go on)
    cached_tokens: int = 0     # paged cache: prompt rows reused from earlier requests
    preempted: int = 0         # paged cache: times it gave its pages back and was prefilled again
    # per token: (log-probability, {id: log-probability} of the alternatives the request asked for)
    logprobs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Live:
    request_id: int
    request: Request
    on_tokens: Callable | None
    on_finish: Callable | None
    submitted: float
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    pages: list = dataclasses.field(default_factory=list)   # paged cache: the pages it holds
    cached_tokens: int = 0     # prompt rows reused at its first admission (reported)
    reused: int = 0            # prompt rows reused at this admission: its prefill starts there
    admitted: int = -1         # admission order (paged cache: the newest is preempted first)
    before: tuple = (0, 0, 0, 0)   # (steps, n_fwd, accepted, rejected) of its preempted runs
    base: int = 0              # tokens emitted before this admission (a preempted request's)
    preempted: int = 0
    held: int = 0              # the LoRA adapter row it holds (0: none; decode.engine.runtime.adapters)


class Batcher:
    """Slot-based continuous batching over one Decoder."""

    def __init__(self, decoder: Decoder, prefix_reuse: bool = True, guided: bool = False,
                 parsers: bool = True, window_policy: str | WindowPolicy = "fixed"):
        """`guided`: the state holds constraint rows from the start, so `warm_up` compiles the
        programs a constrained request runs (a server: none compiles on a request's clock);
        `parsers` False: device tables only (no host call in the programs, which JAX's persistent
        compile cache keeps); True: with it only while a live request needs it (`parser_programs`).
        `window_policy`: "fixed" (the plan's window), "load" (a rung of the window ladder per
        call, decode/engine/runtime/window_policy.py) or a policy object (choose / record)."""
        self.decoder = decoder
        self.prefix_reuse = prefix_reuse
        self.guided, self.parsers = guided, parsers
        self.parser_programs = ParserPrograms(decoder) if guided and parsers else None
        self.pool = self._new_pool()
        self._lock = threading.Lock()
        self._waiting: collections.deque = collections.deque()
        self._cancelled: set = set()
        self._slots: list[_Live | None] = [None] * decoder.slots
        self._next_id = 0
        self.state = self._new_state()
        self.loop_iterations = 0
        self.resets = 0             # device state rebuilt after a failed call
        self.preemptions = 0        # paged cache: requests sent back to the queue to free pages
        self._admissions = 0
        # the LoRA adapters' names (a Decoder with an adapter table): `submit(adapter=NAME)`
        self.adapters = decoder.adapters
        self.window_policy = (WindowPolicy(decoder.rungs()) if window_policy == "load" else
                              None if window_policy == "fixed" else window_policy)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def num_active(self) -> int:
        return sum(s is not None for s in self._slots)

    def _new_state(self):
        """Every slot free (a guided state's Guide without the host parser's call between calls)."""
        return self.decoder.init_state(self.guided, self.parsers and self.parser_programs is None)

    def _parsers(self, state, on: bool):
        """`state` calling the host parser's programs or not (decode.engine.runtime.parser_programs)."""
        return state if self.parser_programs is None else with_parsers(state, on)

    def _new_pool(self):
        st = self.decoder.static
        return ShardedPool(st.num_pages, st.page_size, st.page_shards) if st.paged else None

    def submit(self, request: Request, on_tokens: Callable | None = None,
               on_finish: Callable | None = None, adapter: str | None = None) -> int:
        """Validate (DecodeConfigError names the field) and queue a request; returns its id.
        `adapter`: the name of a loaded LoRA adapter it decodes with (held until it ends)."""
        held = 0
        if adapter is not None:
            if self.adapters is None:
                raise DecodeConfigError(f"the model {adapter!r} does not exist (no LoRA adapters "
                                        "are served: --enable-lora)", "model")
            held = self.adapters.acquire(adapter)
            request = dataclasses.replace(request, adapter=held)
        try:
            rid = self._queue(request, on_tokens, on_finish, held)
        except BaseException:
            if held:
                self.adapters.release(held)
            raise
        return rid

    def _queue(self, request: Request, on_tokens, on_finish, held: int) -> int:
        request = self.decoder.check_request(request)
        if self.pool is not None and self.decoder.pages_needed(request) > self.pool.per_shard:
            st = self.decoder.static
            whole = ("the whole pool holds" if st.page_shards == 1 else
                     f"each of the {st.page_shards} slot shards' pools holds")
            raise DecodeConfigError(
                f"the request needs {self.decoder.pages_needed(request)} pages of {st.page_size} "
                f"rows (prompt {len(request.prompt)} + max_new_tokens {request.max_new_tokens} + "
                f"a window's {st.span}); {whole} {self.pool.per_shard}")
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            self._waiting.append(_Live(rid, request, on_tokens, on_finish, time.perf_counter(),
                                       held=held))
        warning = request.bias_warning(f"request {rid}")
        if warning is not None:
            log.warning(warning)
        return rid

    def cancel(self, request_id: int) -> None:
        """Stop a request: its slot is freed at the next `step` boundary."""
        with self._lock:
            self._cancelled.add(request_id)

    def _finish(self, live: _Live, finish: str, stats=(0, 0, 0, 0), error: str | None = None) -> None:
        steps, n_fwd, acc, rej = (a + b for a, b in zip(stats, live.before))
        if live.pages:
            self.pool.release(live.pages)      # its slot is unmapped (or the state rebuilt) by now
        if live.held:
            self.adapters.release(live.held)
        live.pages, live.held = [], 0
        if live.on_finish is not None:
            live.on_finish(Finished(live.request_id, live.tokens, finish, steps, n_fwd, acc, rej,
                                    time.perf_counter() - live.submitted, error, live.cached_tokens,
                                    live.preempted, live.logprobs))

    def _state_lost(self) -> bool:
        """Was the (donated) state consumed by a call that then failed?"""
        return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.state))

    def _reset(self, error: str) -> None:
        """After a failed device call: every live request ends with 'error', the state is built
        anew, the queue is kept; the next `step` goes on with the waiting requests."""
        self.state = self._new_state()
        for slot, live in enumerate(self._slots):
            if live is not None:
                self._slots[slot] = None
                self._finish(live, "error", error=error)
        self.pool = self._new_pool()           # the pool's contents went with the state
        self.resets += 1

    def _take_cancelled(self):
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            kept = collections.deque()
            dropped = []
            for live in self._waiting:
                (dropped if live.request_id in cancelled else kept).append(live)
            self._waiting = kept
        return cancelled, dropped

    def _counts(self):
        """Host copies of the per-slot (steps, n_fwd, accepted, rejected)."""
        st = self.state
        return jax.device_get((st.steps, st.n_fwd, st.accepted, st.rejected))

    def step(self) -> bool:
        """Free cancelled slots, map the pages live requests grow into (paged cache), insert
        waiting requests, run one generate chunk, hand out the new ids and finish the requests
        that are done. Returns True while work remains."""
        self._end_cancelled()
        self._map_growth()
        self._admit_waiting()
        if self.num_active == 0:
            if self.num_waiting and self.parser_programs is not None:
                self.parser_programs.wait(0.1)   # what waits may be held: no busy loop
            return self.num_waiting > 0
        result = self._generate()
        if result is None:                     # the call failed: its requests ended
            return self.num_waiting > 0
        self._hand_out(result)
        done = [slot for slot, live in enumerate(self._slots)
                if live is not None and bool(result.done[slot])]
        if done:
            self._end_slots(done)
        return self.num_active > 0 or self.num_waiting > 0

    def _end_cancelled(self) -> None:
        """End the cancelled requests: the waiting ones, then the live ones' slots."""
        cancelled, dropped = self._take_cancelled()
        for live in dropped:
            self._finish(live, "cancelled")
        hit = [s for s, live in enumerate(self._slots)
               if live is not None and live.request_id in cancelled]
        if hit:
            self._end_slots(hit, cancelled=True)

    def _end_slots(self, slots: list[int], cancelled: bool = False) -> None:
        """Take the requests in `slots` off the device and finish them ('cancelled', else 'stop'
        or 'length' by their last token), their counts read in one host copy. A paged cache
        unmaps every slot in one call, before their pages go back to the pool; a dense cache
        marks a cancelled slot done (a finished one is done already)."""
        dec = self.decoder
        counts = self._counts()
        if self.pool is not None:
            self.state = dec.unmap(self.state, slots)
        for slot in slots:
            live = self._slots[slot]
            if cancelled and self.pool is None:
                self.state = dec.free(self.state, slot)
            self._slots[slot] = None
            self._finish(live, "cancelled" if cancelled else self._stop_or_length(live),
                         tuple(int(c[slot]) for c in counts))

    @staticmethod
    def _stop_or_length(live: _Live) -> str:
        stops = set(live.request.stop_token_ids)
        return "stop" if live.tokens and live.tokens[-1] in stops else "length"

    def _map_growth(self) -> None:
        """Paged cache (a dense one holds every row already): `_grow`; a failed device call
        ends the live requests (the state and the pool rebuilt)."""
        if self.pool is None:
            return
        try:
            self._grow()
        except Exception as e:  # noqa: BLE001 - a failed device call: its requests end, we go on
            self._reset(f"mapping pages failed ({_failure(e)})")

    def _admit_waiting(self) -> None:
        """Insert waiting requests into free slots, first come first served (past those held
        while their host parser's programs compile); with a paged cache the first admissible
        request waits while the pool cannot give it its first pages."""
        while True:
            free = [s for s, live in enumerate(self._slots) if live is None]
            with self._lock:
                at = next((i for i, w in enumerate(self._waiting) if self.parser_programs is None
                           or self.parser_programs.admits(w.request)), None)
                live = self._waiting[at] if at is not None and free else None
            if live is None:
                return
            slot = self._slot_for(live, free)
            pages = None
            if self.pool is not None:
                pages = self._pages_for(live, self.decoder.static.shard_of(slot))
                if pages is None:
                    return                     # the pool cannot hold it yet: it waits, first in line
            with self._lock:
                del self._waiting[at]
            if self._insert(live, slot, pages):
                self._slots[slot] = live
                live.admitted, self._admissions = self._admissions, self._admissions + 1
                live.base = len(live.tokens)

    def _insert(self, live: _Live, slot: int, pages) -> bool:
        """Prefill `live`'s request into `slot` (a paged cache: into its `pages`, publishing its
        prompt's full pages). False when it failed: the request ends with 'error' alone, unless
        the state was lost with it (then every live request ends, the state rebuilt)."""
        dec = self.decoder
        try:
            if pages is None:
                self.state = dec.insert(dec.prefill(live.request), self.state, slot)
            else:
                live.pages = pages
                on = self._parsers(self.state, needs_parser(live.request))
                on = dec.prefill_into_slot(on, live.request, slot, pages, live.reused)
                self.state = self._parsers(on, False)
                self.pool.publish(self._prefilled(live.request), pages, self._root(live.request))
        except Exception as e:  # noqa: BLE001 - this request fails alone
            error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if self._state_lost():
                live.pages = []                # the pool is rebuilt with the state
                self._reset(f"the decoding state was lost while admitting request "
                            f"{live.request_id} ({error})")
            self._finish(live, "error", error=error)
            return False
        return True

    def _generate(self):
        """One generate call over the live slots (a paged cache steps only their bucket); None
        when it failed (its requests ended, the state rebuilt)."""
        live = [s for s, x in enumerate(self._slots) if x is not None]
        host = any(needs_parser(self._slots[s].request) for s in live)
        policy = self.window_policy
        window = policy.choose(len(live)) if policy is not None else None
        try:
            t0 = time.perf_counter()
            state, result = self.decoder.generate(self._parsers(self.state, host), live=live,
                                                  window=window)
            self.state = self._parsers(state, False)
            if policy is not None:
                policy.record(window, len(live), result.steps, int(result.counts.sum()),
                              time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - the device call failed: its requests end, we go on
            self._reset(f"the decoding step failed ({_failure(e)})")
            return None
        self.loop_iterations += result.steps
        return result

    def _hand_out(self, result) -> None:
        """Each live request's new ids (and their log-probabilities) to it and its on_tokens."""
        for slot, live in enumerate(self._slots):
            if live is None:
                continue
            new = result.new_ids(slot)
            if new:
                live.tokens.extend(new)
                live.logprobs.extend(result.new_logprobs(slot, live.request.top_logprobs))
                if live.on_tokens is not None:
                    live.on_tokens(live.request_id, new)

    def _root(self, request: Request):
        """The root its prompt's pages are cached under: its LoRA adapter's, or the base's."""
        return self.adapters.prefix_root(request.adapter) if request.adapter else ROOT

    def _prefilled(self, request: Request) -> tuple:
        """The prompt rows the prefill writes (AR and verified hold the last token back)."""
        held = 1 if self.decoder.method in ("ar", "verified") else 0
        return tuple(request.prompt[:len(request.prompt) - held])

    def _slot_for(self, live: _Live, free: list[int]) -> int:
        """The free slot a waiting request goes to: the first one, or with slots over data x fsdp
        (a pool per shard) the first of the shard holding the longest cached prefix of its prompt,
        then the most free pages."""
        st = self.decoder.static
        if self.pool is None or st.page_shards == 1:
            return free[0]
        rows = self._prefilled(live.request)
        limit = len(rows) // st.page_size
        first = {}                                   # shard -> its first free slot
        for slot in free:
            first.setdefault(st.shard_of(slot), slot)
        root = self._root(live.request)
        best = max(first, key=lambda d: (self.pool.cached(d, rows, limit, root)
                                         if self.prefix_reuse else 0, self.pool.free_in(d), -d))
        return first[best]

    def _pages_for(self, live: _Live, shard: int):
        """The pages a waiting request gets now in `shard`'s pool: its cached prefix (when
        reused) and fresh ones for the rest of what its prompt and first generate call write;
        None (nothing taken) when the pool cannot give them yet."""
        pool, dec = self.pool, self.decoder
        rows = self._prefilled(live.request)
        limit = len(rows) // pool.page_size
        need = dec.pages_for_call(len(rows), dec.end_of(live.request))
        reuse, root = self.prefix_reuse, self._root(live.request)
        hit = pool.match(shard, rows, limit, root) if reuse else []
        # a longer prefix cached in another slot shard's pool: its pages past this shard's hit
        # are copied over (device to device) rather than prefilled again
        src = []
        if reuse and dec.static.page_shards > 1:
            cached = {d: pool.cached(d, rows, limit, root) for d in range(dec.static.page_shards)
                      if d != shard}
            other = max(cached, key=cached.get)
            if cached[other] > len(hit):
                src = pool.match(other, rows, limit, root)
        more = pool.allocate(shard, max(need - len(hit), 0))
        if more is None:
            pool.release(hit + src)
            return None
        copied = max(len(src) - len(hit), 0)
        if copied:
            self.state = dec.copy_pages(self.state, src[len(hit):], more[:copied])
        pool.release(src)                         # they stay cached in their own shard
        live.reused = (len(hit) + copied) * pool.page_size
        if live.admitted < 0:                      # a preempted request's own prompt pages do not count
            live.cached_tokens = live.reused
        return hit + more

    def _grow(self) -> None:
        """Map the pages every live slot's next generate call can write, oldest request first;
        when the pool runs short, preempt the newest live request of the slot's shard (possibly
        the one growing)."""
        dec = self.decoder
        order = sorted((s for s, live in enumerate(self._slots) if live is not None),
                       key=lambda s: self._slots[s].admitted)
        if not order:
            return
        lengths = jax.device_get(self.state.cache.length)
        grown = {}
        for slot in order:
            live = self._slots[slot]
            if live is None:                       # preempted for an older one
                continue
            extra = dec.pages_for_call(int(lengths[slot]), dec.end_of(live.request)) - len(live.pages)
            while extra > 0:
                shard = dec.static.shard_of(slot)
                more = self.pool.allocate(shard, extra)
                if more is not None:
                    live.pages += more
                    grown[slot] = live.pages
                    break
                newest = max((s for s, x in enumerate(self._slots)
                              if x is not None and dec.static.shard_of(s) == shard),
                             key=lambda s: self._slots[s].admitted)
                grown.pop(newest, None)
                self._preempt(newest)
                if newest == slot:
                    break
        if grown:
            self.state = dec.set_page_rows(self.state, grown)

    def _preempt(self, slot: int) -> None:
        """Give `slot`'s request's slot and pages back and queue it first, as its prompt plus the
        tokens it emitted (prefilled again when readmitted)."""
        counts = self._counts()
        self.state = self.decoder.unmap(self.state, [slot])
        live = self._slots[slot]
        self._slots[slot] = None
        self.pool.release(live.pages)
        live.pages = []
        live.before = tuple(a + int(c[slot]) for a, c in zip(live.before, counts))
        new = tuple(live.tokens[live.base:])      # emitted since this admission
        state = live.request.automaton_state       # a constraint goes on from where it was
        for t in new if live.request.automaton is not None else ():
            state = live.request.automaton.next_state(state, int(t))
        live.request = dataclasses.replace(live.request, prompt=tuple(live.request.prompt) + new,
                                           max_new_tokens=live.request.max_new_tokens - len(new),
                                           automaton_state=state)
        with self._lock:
            self._waiting.appendleft(live)
        live.preempted += 1
        self.preemptions += 1

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def warm_up_programs(self, capacity: int, every_bucket: bool = True,
                         background: bool = False) -> list[str]:
        """The names `warm_up` reports its programs by, in its order (decode.engine.runtime.warm_up)."""
        return warm_up.program_names(self, capacity, every_bucket, background)

    def warm_up(self, capacity: int, every_bucket: bool = True, progress=None,
                background: bool = False) -> float:
        """Compile before serving (decode.engine.runtime.warm_up): one short request per prompt bucket
        (the Decoder compiles prefill and insert once per power-of-two prompt bucket), then the
        step programs (`Decoder.compile_steps`: generate for every live-slot bucket, the page
        table's updates), then a guided Batcher's host-parser programs (`background`: on a
        thread of their own, the requests that need them held in the queue meanwhile), so no
        client waits on a compile. every_bucket=False compiles the smallest prompt bucket and
        what it runs only (the others compile on first use). progress(name, seconds): after
        each program (names as `warm_up_programs`). Returns the seconds it took."""
        return warm_up.warm_up(self, capacity, every_bucket, progress, background)
