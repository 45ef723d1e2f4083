"""The engine thread of wedlm-serve (`EngineThread`): ONE thread owns the device and calls
`Batcher.step()` (one jitted chunk of steps); request handlers only submit, cancel and receive
tokens through callbacks, which must be cheap and thread-safe. Admission is bounded (`Busy` beyond
`max_pending`); a device failure answers everyone in flight and stops admitting; `drain` answers
what is left at shutdown. With `metrics` (decode.metrics.ServerMetrics) every request is counted on
this thread from what its callbacks carry."""

import logging
import threading

log = logging.getLogger("wedlm-serve")


class Busy(Exception):
    pass


def _guarded(callback):
    """A callback that never raises into `Batcher.step()` (a handler whose event loop has already
    closed, at shutdown, must not take the engine down with it)."""
    def call(*a):
        try:
            callback(*a)
        except RuntimeError as e:
            if "event loop is closed" not in str(e).lower():
                log.warning("a request callback failed", exc_info=True)
            # else: its handler is gone (the server is stopping); nobody is left to answer
        except Exception:   # noqa: BLE001 - logged; the engine and the other requests go on
            log.warning("a request callback failed", exc_info=True)
    return call


class EngineThread:
    """The one thread that owns the device: admits requests (bounded), calls `Batcher.step()`,
    and hands tokens and finishes to the callbacks (which must be cheap and thread-safe)."""

    def __init__(self, batcher, max_pending: int, scorer=None, score_batch: int = 64,
                 metrics=None):
        self.batcher = batcher
        self.metrics = metrics           # decode.metrics.ServerMetrics, or None
        self.max_pending = max_pending
        self.scorer = scorer             # scorer(sequences, top_n) -> per-sequence logprobs
        self.score_batch = score_batch   # sequences per scoring forward (jobs are batched)
        self.score_calls = 0             # scoring forwards run (one per batch of jobs)
        self._scores: list = []          # (sequences, top_n, on_done) waiting for the thread
        self._jobs: list = []            # (fn, on_done): device work between steps (`call`)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._live: dict = {}            # request id -> on_error(message, status)
        self._early: set = set()         # ids whose finish came before submit() registered them
        self._reasons: dict = {}         # request id -> why it was cancelled (the metrics' reason)
        self._pending = 0
        self._accepting = True
        self._stop = False
        self.error: str | None = None
        self.steps = 0
        self.finished = {"stop": 0, "length": 0, "cancelled": 0}
        self._thread = threading.Thread(target=self._loop, name="wedlm-engine", daemon=True)

    def start(self):
        self._thread.start()
        return self

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def accepting(self) -> bool:
        return self._accepting and self.error is None

    def submit(self, request, on_tokens, on_finish, on_error, adapter: str | None = None) -> int:
        """Raises Busy (queue full), RuntimeError (not accepting) or DecodeConfigError. The Batcher
        is never called under this engine's lock (its callbacks take that lock: no lock-order cycle).
        `adapter`: the LoRA adapter's name it decodes with (None: the base model)."""
        with self._lock:
            if not self.accepting:
                raise RuntimeError(self.error or "the server is shutting down")
            if self._pending >= self.max_pending:
                raise Busy()
            self._pending += 1
        track = self.metrics.track(request) if self.metrics is not None else None
        if track is not None:
            on_tokens = self.metrics.counting(track, on_tokens)
            if request.automaton is not None:
                self.metrics.count_constrained(request.automaton.backend)
        try:
            rid = self.batcher.submit(request, on_tokens=_guarded(on_tokens),
                                      on_finish=lambda fin: self._finished(fin, _guarded(on_finish),
                                                                           track),
                                      **({} if adapter is None else {"adapter": adapter}))
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        with self._lock:
            if rid in self._early:        # finished before we got here
                self._early.discard(rid)
            else:
                self._live[rid] = on_error
        self._wake.set()
        return rid

    def cancel(self, rid: int, reason: str = "abort") -> None:
        """Stop request `rid`; `reason` is what its finish is counted as ('stop': a stop string)."""
        with self._lock:
            live = rid in self._live
            if live:
                self._reasons[rid] = reason
        if live:
            self.batcher.cancel(rid)
            self._wake.set()

    def _finished(self, fin, on_finish, track=None):
        with self._lock:
            if self._live.pop(fin.request_id, None) is None:
                self._early.add(fin.request_id)
            self._pending -= 1
            self.finished[fin.finish] = self.finished.get(fin.finish, 0) + 1
            reason = self._reasons.pop(fin.request_id, None)
        if track is not None:
            _guarded(self.metrics.finished)(track, fin, reason)
        on_finish(fin)

    def score(self, sequences, top_n: int, on_done) -> None:
        """Score token sequences with the AR reading on the engine thread, between decode steps;
        on_done(result list, or the exception) is called from that thread."""
        with self._lock:
            if not self.accepting:
                raise RuntimeError(self.error or "the server is shutting down")
            if self.scorer is None:
                raise RuntimeError("this engine has no scorer")
            self._scores.append((sequences, top_n, on_done))
        self._wake.set()

    def call(self, fn, on_done) -> None:
        """Run fn() on the engine thread between steps (work on the device's state, e.g. a LoRA
        adapter's table row); on_done(its result, or the exception) is called from that thread."""
        with self._lock:
            if not self.accepting:
                raise RuntimeError(self.error or "the server is shutting down")
            self._jobs.append((fn, on_done))
        self._wake.set()

    def _run_jobs(self) -> None:
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for fn, on_done in jobs:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - answered to the caller alone
                result = e
            _guarded(on_done)(result)

    def _run_scores(self) -> None:
        """Every scoring job waiting, batched: the jobs that ask for the same number of top
        alternatives share forwards of up to `score_batch` sequences; a batch that fails is
        scored again job by job, so one bad request fails alone."""
        with self._lock:
            jobs, self._scores = self._scores, []
        groups: dict = {}
        for job in jobs:
            groups.setdefault(job[1], []).append(job)
        for top_n, group in groups.items():
            while group:
                batch, n = [], 0
                while group and (not batch or n + len(group[0][0]) <= self.score_batch):
                    batch.append(group.pop(0))
                    n += len(batch[-1][0])
                self._score_together(batch, top_n)

    def _score_together(self, batch, top_n: int) -> None:
        try:
            results = self.scorer([seq for job in batch for seq in job[0]], top_n)
        except Exception as e:  # noqa: BLE001 - a request's failure, answered to it alone
            if len(batch) == 1:
                _guarded(batch[0][2])(e)
            else:               # which job failed: score them one by one
                for job in batch:
                    self._score_together([job], top_n)
            return
        self.score_calls += 1
        at = 0
        for sequences, _, on_done in batch:
            _guarded(on_done)(results[at:at + len(sequences)])
            at += len(sequences)

    def _loop(self):
        while True:
            self._run_jobs()
            self._run_scores()
            with self._lock:
                if self._stop and self._pending == 0:
                    return
                busy = self._pending > 0
            if not busy:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                self.batcher.step()
                self.steps += 1
            except Exception as e:  # the device failed: answer everyone, accept nothing more
                log.exception("engine step failed")
                with self._lock:
                    self.error = f"the decoding engine failed: {type(e).__name__}: {e}"
                    live, self._live, self._pending = self._live, {}, 0
                for on_error in live.values():
                    _guarded(on_error)(self.error, 500)
                return

    def stop_accepting(self):
        with self._lock:
            self._accepting = False

    def drain(self, message: str) -> int:
        """Answer every request still in flight with `message` (503: their handlers end the
        response, a stream with an error event and [DONE]) and cancel them; returns how many."""
        with self._lock:
            live = list(self._live.items())
        for rid, on_error in live:
            _guarded(on_error)(message, 503)
            self.batcher.cancel(rid)
        self._wake.set()
        return len(live)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting; cancel what is still in flight; stop the thread (bounded wait)."""
        self.stop_accepting()
        with self._lock:
            live = list(self._live)
            self._stop = True
        for rid in live:
            self.batcher.cancel(rid)
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
