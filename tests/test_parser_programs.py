"""A server's programs without the host parser's call (decode/engine/runtime/parser_programs.py): a guided
Batcher warms up with the Guide's `parsers` False (programs JAX's persistent cache can keep),
compiles the host parser's programs after that on a thread of its own, holds the requests that
need them meanwhile (the others go past), and then decodes them as the host parser always did."""

from __future__ import annotations

import contextlib
import json

import jax
import jsonschema
import pytest

from decode.constraints.backends import compile_for
from decode.constraints.spec import Constraint
from decode.engine.step import programs
from decode.engine.runtime.batcher import Batcher
from decode.engine.runtime.parser_programs import abstract
from decode.engine.step.state import Request
from demo.eval import DEMO_MODEL, REGIMES, load_model, stop_ids
from tests import plans

from tests.compiles import COMPILES  # noqa: E402 - every compile (or cache load) here

CAPACITY = 64
PROMPT = "Table:\nname | age\nTina | 18\nHeidi | 82\nJSON lines:\n"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 40}},
          "required": ["name", "age"], "additionalProperties": False}   # minimum: the host's
PROGRAMS = ("prefill", "prefill_into", "insert", "free", "generate", "generate_live",
            "prefill_slot", "unmap", "set_rows", "copy_pages")


class _Recorded:
    """A jitted program that records each call: (name, program, its arguments' shapes)."""

    def __init__(self, name, fn, calls):
        self.name, self.fn, self.calls = name, fn, calls

    def __call__(self, *args):
        shapes = jax.tree.map(lambda x: abstract(x) if isinstance(x, jax.Array) else x, args)
        self.calls.append((self.name, self.fn, shapes))
        return self.fn(*args)

    def __getattr__(self, attr):          # .lower, .trace: the program's own
        return getattr(self.fn, attr)


@contextlib.contextmanager
def recording():
    calls: list = []
    originals = {name: getattr(programs, name) for name in PROGRAMS}
    for name, fn in originals.items():
        setattr(programs, name, _Recorded(name, fn, calls))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(programs, name, fn)


def parsers_of(args):
    """The Guide's `parsers` of the state among a call's arguments (None: no guided state)."""
    guides = [a.guide for a in args if hasattr(a, "guide") and a.guide is not None]
    return guides[0].parsers if guides else None


def holds_host_call(fn, args) -> bool:
    return "callback" in str(fn.trace(*args).jaxpr)


def requests(demo):
    config, _, tok = demo
    stops = stop_ids(tok, config, REGIMES["records"])
    g = compile_for(Constraint.json_schema(SCHEMA), tok, config.vocab_size)
    assert g.backend == "host"              # the device tables refuse minimum
    prompt = tuple(tok.encode(PROMPT))
    return (Request(prompt=prompt, max_new_tokens=32, stop_token_ids=stops, automaton=g),
            Request(prompt=prompt, max_new_tokens=12, stop_token_ids=stops))


def run(batcher, *reqs, on_finish=None):
    done = {}
    ids = [batcher.submit(r, on_finish=lambda f: (done.__setitem__(f.request_id, f),
                                                  on_finish and on_finish(f))) for r in reqs]
    batcher.run_until_idle()
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_MODEL)


@pytest.fixture(scope="module")
def served(demo):
    """A server's Batcher warmed up with the host parser's programs left to the background, a
    host-parser request and an unconstrained one submitted right after (in that order)."""
    config, params, _ = demo
    dec = plans.decoder(params, config, method="streaming", window=4, slots=2, capacity=CAPACITY,
                        steps_per_call=2, sampling=False, page_size=16, num_pages=16)
    batcher = Batcher(dec, guided=True)
    with recording() as warm_calls:
        batcher.warm_up(CAPACITY, background=True)
    holding = batcher.parser_programs.holding
    order = []
    with recording() as calls:
        host, free = run(batcher, *requests(demo), on_finish=lambda f: order.append(
            (f.request_id, batcher.parser_programs.holding)))
    return dict(batcher=batcher, decoder=dec, warm_calls=warm_calls, holding=holding,
                order=order, host=host, free=free, calls=calls)


def test_warm_up_programs_hold_no_host_call(served):
    """Every program the warm-up ran took a state without the host parser (and holds no host
    callback: JAX's persistent cache keeps them); the host parser's programs are not among the
    ones readiness waits for, and compile in the background."""
    guided = [(name, fn, args) for name, fn, args in served["warm_calls"]
              if parsers_of(args) is not None]
    assert {name for name, _, _ in guided} >= {"prefill_slot", "generate", "generate_live",
                                               "unmap", "set_rows"}
    assert all(parsers_of(args) is False for _, _, args in guided)
    seen = {}
    for name, fn, args in guided:
        seen.setdefault((name, str(jax.tree.map(lambda x: getattr(x, "shape", x), args))),
                        (fn, args))
    assert not any(holds_host_call(fn, args) for fn, args in seen.values())
    b = served["batcher"]
    names = b.warm_up_programs(CAPACITY, background=True)
    assert not any(n.startswith("host parser") for n in names)
    assert [n for n in b.warm_up_programs(CAPACITY) if n not in names] == \
        b.parser_programs.names([1, 16, 32, 64])
    assert served["holding"]                # still compiling when warm-up returned


def test_host_request_right_after_ready_waits_and_equals_the_old_path(served, demo):
    """Submitted right after ready, the host-parser request waits in the queue while its
    programs compile, the unconstrained one behind it goes past; it then gives the schema's
    output, the tokens of a Batcher stepping with the host parser throughout (the old path)."""
    config, _, tok = demo
    host, free = served["host"], served["free"]
    assert served["order"][0] == (free.request_id, True)     # finished while the other was held
    assert served["order"][1][0] == host.request_id
    assert host.finish == "stop" and free.finish in ("stop", "length")
    text = tok.decode([t for t in host.tokens if t not in requests(demo)[0].stop_token_ids])
    jsonschema.validate(json.loads(text), SCHEMA)
    old_host, old_free = (run(Batcher(served["decoder"]), r)[0] for r in requests(demo))
    assert host.tokens == old_host.tokens and free.tokens == old_free.tokens
    calls = served["calls"]
    on = [(name, fn, args) for name, fn, args in calls if parsers_of(args)]
    assert {name for name, _, _ in on} == {"prefill_slot", "generate_live"}
    assert all(holds_host_call(fn, args) for _, fn, args in on)
    b = served["batcher"]
    assert b.parser_programs.ready and b.parser_programs.error is None


def test_host_and_unconstrained_in_one_batch_as_alone(served, demo):
    """Once the host parser's programs are compiled, a host-parser request and an unconstrained
    one in one batch each give what they gave alone, and nothing compiles on their clock."""
    b = served["batcher"]
    assert b.parser_programs.wait(600)
    before = len(COMPILES)
    host, free = run(b, *requests(demo))
    assert host.tokens == served["host"].tokens and free.tokens == served["free"].tokens
    assert len(COMPILES) == before


def test_a_host_request_waits_only_for_the_programs_it_runs(served, demo):
    """While the host parser's programs compile, a host-parser request is admitted once every
    `generate` and its own prompt bucket's admission are compiled (the smallest bucket first);
    a request without a host parser is never held."""
    from decode.engine.runtime.parser_programs import ParserPrograms
    host, free = requests(demo)
    short = Request(prompt=host.prompt[-10:], max_new_tokens=8, stop_token_ids=host.stop_token_ids,
                    automaton=host.automaton)            # prompt bucket 16; `host`'s is 32
    family, seen = ParserPrograms(served["decoder"]), []
    family.start(served["batcher"].state, [1, 16, 32, 64], progress=lambda name, s: seen.append(
        (name, family.admits(short), family.admits(host), family.admits(free))))
    assert family.wait(600) and family.error is None
    names = [name for name, *_ in seen]
    assert names == family.names([1, 16, 32, 64])
    assert [(s, h, f) for _, s, h, f in seen] == \
        [(False, False, True)] * 2 + [(True, False, True), (True, True, True), (True, True, True)]
    assert family.admits(short) and family.admits(host)
