"""Compiling before serving (`Batcher.warm_up`): one short request per prompt bucket, then the
step programs, so no client waits on a compile; a guided Batcher's host-parser programs
(decode.engine.runtime.parser_programs) after them, inline or in the background."""

from __future__ import annotations

import time

from decode.engine.step.state import Request


def prompt_lengths(capacity: int, every_bucket: bool = True) -> list[int]:
    """The prompt lengths warm-up submits: 1, then 16, 32, .. up to the capacity (every_bucket
    False: 1 only)."""
    lengths, n = [1], 16
    while every_bucket and n <= 2 * capacity:
        lengths.append(min(n, capacity))
        n *= 2
    return list(dict.fromkeys(lengths))


def program_names(batcher, capacity: int, every_bucket: bool = True,
                  background: bool = False) -> list[str]:
    """The names `warm_up` reports its programs by, in its order (`background`: without the
    host parser's, which then compile after it)."""
    names = [f"prompt bucket {n}" for n in prompt_lengths(capacity, every_bucket)]
    if not every_bucket:
        return names
    names += batcher.decoder.step_programs(rungs(batcher))
    parsers = batcher.parser_programs
    if parsers is not None and not background:
        names += parsers.names(prompt_lengths(capacity))
    return names


def warm_up(batcher, capacity: int, every_bucket: bool = True, progress=None,
            background: bool = False) -> float:
    """`Batcher.warm_up`: the prompt buckets' programs, one short request each (each prompt its
    own first token, so a paged cache reuses no prefix of another and prefills the whole bucket),
    then `Decoder.compile_steps`; a guided Batcher's host-parser programs then (`background`: on
    a thread of their own, its requests held in the queue until they are compiled). Returns the
    seconds it took (without a background compile's)."""
    report = progress or (lambda name, seconds: None)
    t0 = time.perf_counter()
    windows = rungs(batcher)
    policy, batcher.window_policy = batcher.window_policy, None    # the warm-up's calls teach it nothing
    try:
        return _warm_up(batcher, capacity, every_bucket, report, background, t0, windows)
    finally:
        batcher.window_policy = policy


def rungs(batcher) -> tuple:
    """The windows whose step programs warm-up compiles: every rung of the ladder under a window
    policy (`--window-policy load`), else the plan's window."""
    return tuple(batcher.decoder.rungs()) if batcher.window_policy is not None else (None,)


def _warm_up(batcher, capacity, every_bucket, report, background, t0, windows) -> float:
    vocab = batcher.decoder.model_config.vocab_size
    lengths = prompt_lengths(capacity, every_bucket)
    for i, length in enumerate(lengths):
        t1 = time.perf_counter()
        batcher.submit(Request(prompt=(i % vocab,) + (0,) * (length - 1), max_new_tokens=1))
        batcher.run_until_idle()
        report(f"prompt bucket {length}", time.perf_counter() - t1)
    if not every_bucket:
        return time.perf_counter() - t0
    batcher.state = batcher.decoder.compile_steps(batcher.state, report, windows)
    parsers = batcher.parser_programs
    if parsers is not None and background:
        parsers.start(batcher.state, lengths)
    elif parsers is not None:
        parsers.compile(batcher.state, lengths, report)
    return time.perf_counter() - t0
