"""The training loop: steps dispatched ahead of the host, metrics read at the log steps, and the
reasons to stop early, each ending in a saved checkpoint or in none:

    last step          saved (and exported by the caller)
    time_limit_s       the first log step past it: saved and exported as at the end
    SIGTERM / SIGINT   (a preempted TPU VM, a Slurm job's end, Ctrl-C) the step in flight
                       finishes, a checkpoint is saved at it on every host together (jax's
                       preemption sync point when multi-host), and the run says so and ends;
                       a rerun resumes from it exactly
    a non-finite loss  or gradient norm: the run stops naming the first such step and saves
                       nothing past the last finite checkpoint (with `nonfinite_skips` N > 0
                       the step skips such updates, up to N, and stops at the next one)

Metrics stay on the device between log steps (no host round trip per step); before every save
the pending steps are read, so no checkpoint holds a step the guard has not seen.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import time

log = logging.getLogger("wedlm-train")
SKIPPED_NAMED = 20     # malformed lines named (file:line) in the run's first metrics row


class NonFiniteError(RuntimeError):
    """The loss or gradient norm stopped being finite; the message names the step."""


class StopSignals:
    """SIGTERM and SIGINT recorded instead of killing the run, while the loop holds them (one
    process; a second one stops it at once, unsaved); on several hosts jax's preemption service
    gets the signal and the loop asks its sync point, so every host stops at the same step."""

    def __init__(self):
        self.received = None
        self.saved = {}

    def __enter__(self):
        import jax
        if jax.process_count() == 1:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.saved[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum, frame):
        if self.received is not None:       # asked twice: stop now, without the checkpoint
            before = self.saved.get(signum)
            if callable(before) and before is not signal.default_int_handler:
                before(signum, frame)       # the command's own (one line, at once)
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)

    def reached(self, step: int) -> bool:
        import jax
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            if multihost_utils.reached_preemption_sync_point(step):
                self.received = signal.SIGTERM
        return self.received is not None


@dataclasses.dataclass
class Loop:
    """What the loop runs over (built by train.main.setup)."""
    cfg: object
    step_fn: object
    state: dict
    it: object                   # the data iterator (its state saved with each checkpoint)
    to_batch: object             # host rows -> the global batch
    mgr: object                  # the checkpoint manager, or None
    writer: object               # metrics.jsonl / TensorBoard
    bar: object                  # tqdm, or None
    start: int
    rows: int                    # packed rows of the data (saved beside the data state)
    flops_per_peak: float | None
    skipped_lines: list
    records: list = dataclasses.field(default_factory=list)
    pending: list = dataclasses.field(default_factory=list)
    t_prev: float = 0.0
    skips: int = 0


def run_loop(loop: Loop) -> str:
    """Train from loop.start to cfg.steps, or until a reason to stop; returns it: "done",
    "time_limit" or the signal's name. Raises NonFiniteError (nothing saved past the last finite
    checkpoint)."""
    cfg = loop.cfg
    loop.t_prev = t_loop = time.perf_counter()
    reason = "done"
    with StopSignals() as signals:
        for step in range(loop.start, cfg.steps):
            loop.state, metrics = loop.step_fn(loop.state, loop.to_batch(next(loop.it)))
            loop.pending.append((step, metrics))
            last = step + 1 == cfg.steps
            if signals.reached(step + 1):
                reason, last = signal.Signals(signals.received).name, True
            if step == loop.start or (step + 1) % cfg.log_every == 0 or last:
                flush(loop)     # the first step alone (its time holds the compile)
                if step == loop.start:
                    t_loop = time.perf_counter()
                elif not last and out_of_time(cfg.time_limit_s, t_loop):
                    reason, last = "time_limit", True
            if loop.mgr is not None and ((step + 1) % cfg.checkpoint.every == 0 or last):
                flush(loop)     # every step the checkpoint holds has passed the guard
                save(loop, step + 1)
            if last:
                break
    if reason == "time_limit":
        log.warning("stopping at step %d of %d: time_limit_s=%s reached; saved and exported as at "
                    "the end (a rerun resumes)", step + 1, cfg.steps, cfg.time_limit_s)
    elif reason != "done":
        log.warning("%s at step %d of %d: %s; a rerun of the same command resumes from it", reason,
                    step + 1, cfg.steps, "saved" if loop.mgr is not None else
                    "nothing saved (no checkpoint.dir)")
    return reason


def flush(loop: Loop) -> None:
    """The pending steps' metrics to host, one record each (the interval's wall time shared
    evenly: the steps were in flight together); the divergence guard reads them."""
    import jax
    if not loop.pending:
        return
    got = jax.device_get([m for _, m in loop.pending])
    now = time.perf_counter()
    dt, loop.t_prev = (now - loop.t_prev) / len(loop.pending), now
    for (step, _), metrics in zip(loop.pending, got):
        rec = step_record(step, {k: float(v) for k, v in metrics.items()}, dt, loop.start,
                          loop.flops_per_peak, loop.skipped_lines, not loop.records)
        check_finite(loop, rec)
        loop.records.append(rec)
        cfg = loop.cfg
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps or "skipped_where" in rec:
            loop.writer.write(rec)
        if loop.bar is not None:
            loop.bar.update(1)
            loop.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
    loop.pending.clear()


def check_finite(loop: Loop, rec: dict) -> None:
    """Raise NonFiniteError at a step whose loss or gradient norm is not finite, unless the step
    skipped that update and fewer than `nonfinite_skips` were skipped before."""
    if math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"]):
        return
    allowed = loop.cfg.nonfinite_skips
    if rec.get("skipped_update") and loop.skips < allowed:
        loop.skips += 1
        log.warning("step %d: non-finite loss or gradient norm; update skipped (%d of %d)",
                    rec["step"], loop.skips, allowed)
        return
    kept = f" after skipping {loop.skips}" if allowed else ""
    raise NonFiniteError(
        f"step {rec['step']}: the loss is {rec['loss']} and the gradient norm {rec['grad_norm']}"
        f"{kept}; stopped without saving it (lower optimizer.lr, raise optimizer.warmup_steps "
        "or check the data; nonfinite_skips=N skips up to N such updates)")


def save(loop: Loop, step: int) -> None:
    from train import checkpoint as ckpt
    from wedlm_jax.runtime.failures import check_space
    import jax
    cfg = loop.cfg
    if jax.process_index() == 0 and "://" not in cfg.checkpoint.dir:
        check_space(cfg.checkpoint.dir, ckpt.state_bytes(loop.state), f"the checkpoint of step {step}")
    ckpt.save(loop.mgr, step, loop.state, {"grain": loop.it.get_state(), "rows": loop.rows},
              cfg.to_dict(), force=True)


def out_of_time(limit_s: float | None, t0: float) -> bool:
    """Whether `limit_s` seconds have passed since t0, agreed by every process (process 0's
    clock decides)."""
    if limit_s is None:
        return False
    import jax
    over = time.perf_counter() - t0 > limit_s
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        over = bool(multihost_utils.broadcast_one_to_all(over))
    return over


def step_record(step: int, metrics: dict, dt: float, start: int, flops_per_peak: float | None,
                skipped: list, first: bool) -> dict:
    """One metrics row: the step's loss terms, its wall time and rates (and MFU when the peak is
    known); the run's skipped lines counted, and named on its first row."""
    rec = {"step": step + 1, **metrics, "step_time_s": dt, "tokens_per_s": metrics["tokens"] / dt,
           "includes_compile": step == start}
    if flops_per_peak is not None:
        rec["mfu"] = flops_per_peak / dt
    if skipped:
        rec["skipped_lines"] = len(skipped)
        if first:
            rec["skipped_where"] = skipped[:SKIPPED_NAMED]
    return rec
