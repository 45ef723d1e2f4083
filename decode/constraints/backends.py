"""Which backend enforces a request's constraint, chosen per request, behind one interface (the
way an engine keeps its grammar backends apart from its scheduler):

    device   the token automaton's tables (decode.constraints.automaton), read inside the decode
             loop: no host round trip. Only for schemas whose every keyword the tables enforce
             exactly (decode.constraints.keywords), and built within a time budget.
    host     llguidance's parser (decode.constraints.host), asked once a step for the slots that
             use it. Any schema llguidance enforces; anything else is refused by name.
    auto     device where it is exact and ready in time, host otherwise (at once while the
             device builder is busy with other schemas: nothing waits in its queue).

`compile_for(constraint, tokenizer, vocab_size, backend)` returns the compiled form (an
`Automaton` or a host `Grammar`); both answer `.backend`, `.key`,
`.next_state(state, token)` and `.matcher(stop_ids)`, the token-by-token walk that tests and the
MaskBench runner use as the reference of what the decoder allows.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading

from decode.config import CONSTRAINT_BACKENDS as BACKENDS
from decode.config import DEVICE_TABLE, DecodeConfigError
from decode.constraints import automaton as device_lib
from decode.constraints import host as host_lib
from decode.constraints.spec import Constraint

DEVICE_BUDGET_S = 2.0          # a device build longer than this goes to the host backend (auto)
MAX_DEVICE_REGEX = 20_000      # characters: longer regexes go to the host backend (auto)
MAX_QUEUED_BUILDS = 4          # device builds waiting or running at once (auto adds none past it)
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-tables")
_PENDING: dict = {}
_PENDING_LOCK = threading.Lock()


def device_exact(constraint: Constraint):
    """Raise a DecodeConfigError naming the first keyword the device tables do not enforce
    exactly (JSON schemas; regexes and choices are exact)."""
    if constraint.kind == "grammar":
        constraint.to_regex()            # refused: a grammar is the host's
    if constraint.kind != "json_schema":
        return
    from decode.constraints.keywords import check_device
    check_device(json.loads(constraint.value), constraint.field)


def _device(constraint: Constraint, tokenizer, budget_s: float | None, wait_behind: bool = True):
    """The Automaton, built on the pool; None when not ready within `budget_s` (the build goes
    on and lands in the cache for the next request). With `wait_behind` False (auto), a build
    that would queue behind another schema's is not waited for, and none is queued past
    MAX_QUEUED_BUILDS: the host takes the request at once and a later one asks again."""
    key = constraint.key()
    with _PENDING_LOCK:
        fut = _PENDING.get(key)
        if fut is None:
            behind = bool(_PENDING)
            if behind and not wait_behind and len(_PENDING) >= MAX_QUEUED_BUILDS:
                return None
            fut = _POOL.submit(device_lib.for_tokenizer, constraint, tokenizer)
            _PENDING[key] = fut
            fut.add_done_callback(lambda _f: _forget(key))
            if behind and not wait_behind:
                return None
    try:
        auto = fut.result(timeout=budget_s)
    except concurrent.futures.TimeoutError:
        return None
    if auto.num_states > DEVICE_TABLE[0] or auto.num_classes > DEVICE_TABLE[1]:
        raise DecodeConfigError(f"{constraint.field}: its automaton has {auto.num_states} states "
                                f"x {auto.num_classes} token classes, above the device tables' "
                                f"{DEVICE_TABLE[0]} x {DEVICE_TABLE[1]}; the host backend takes "
                                f"it", constraint.field)
    return auto


def _stricter(constraint: Constraint) -> bool:
    if constraint.kind != "json_schema":
        return False
    from decode.constraints.keywords import stricter
    return bool(stricter(json.loads(constraint.value)))


def pending_builds() -> list:
    """The device builds queued or running (futures)."""
    with _PENDING_LOCK:
        return list(_PENDING.values())


def _forget(key):
    with _PENDING_LOCK:
        _PENDING.pop(key, None)


def compile_for(constraint: Constraint, tokenizer, vocab_size: int | None = None,
                backend: str = "auto",
                budget_s: float | None = DEVICE_BUDGET_S):
    """The compiled constraint for `backend` (module docstring). Errors are DecodeConfigErrors
    naming the request's field and what is wrong."""
    if backend not in BACKENDS:
        raise DecodeConfigError(f"the constraint backend must be one of {', '.join(BACKENDS)}, "
                                f"got {backend!r}", "backend")
    if constraint.kind == "json_schema":     # nothing satisfies it: refused by its keyword's path
        from decode.constraints.keywords import check_satisfiable
        check_satisfiable(json.loads(constraint.value), constraint.field)
    if backend == "host":
        return host_lib.compile_grammar(constraint, tokenizer, vocab_size)
    try:
        device_exact(constraint)
        if backend == "auto" and len(constraint.to_regex()) > MAX_DEVICE_REGEX:
            raise DecodeConfigError("large", constraint.field)
    except DecodeConfigError:
        if backend == "device":
            raise
        return host_lib.compile_grammar(constraint, tokenizer, vocab_size)
    if backend == "auto" and _stricter(constraint):
        try:         # the tables would forbid valid instances: the host, where it takes it
            return host_lib.compile_grammar(constraint, tokenizer, vocab_size)
        except DecodeConfigError:
            pass
    if backend == "auto":
        try:
            auto = _device(constraint, tokenizer, budget_s, wait_behind=False)
        except DecodeConfigError:
            auto = None      # the host's words say what is wrong, or the host takes it
        return auto if auto is not None else host_lib.compile_grammar(constraint, tokenizer,
                                                                      vocab_size)
    auto = _device(constraint, tokenizer, budget_s)
    if auto is None:
        raise DecodeConfigError(f"{constraint.field}: the device tables were not built within "
                                f"{budget_s:g} s; the host backend takes it", constraint.field)
    return auto


def warm(tokenizer, vocab_size: int) -> None:
    """Read the tokenizer's vocabulary for both backends (a server does it before it is ready,
    so the first constrained request pays only its own constraint's build)."""
    probe = Constraint.choice(["a"], "warm-up")
    host_lib.compile_grammar(probe, tokenizer, vocab_size)
    device_lib.for_tokenizer(probe, tokenizer)


def allowed_alternatives(compiled, stop_ids, tokens, tops: list) -> list:
    """`tops` (per generated token, {id: log-probability} of its likeliest alternatives) with
    every alternative the constraint forbade at that position left out: the matcher walks the
    tokens as they were committed (a draft's alternatives come from the unrestricted reading)."""
    m, out = compiled.matcher(stop_ids), []
    for tok, top in zip(tokens, tops):
        if top is None:
            out.append(top)
            continue
        ok = m.allowed()
        out.append({t: v for t, v in top.items() if t < len(ok) and ok[t]})
        if not m.advance(int(tok)):
            break
    return out + list(tops[len(out):])
