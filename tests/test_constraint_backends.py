"""The two constraint backends (decode/constraints/backends.py): the device tables and llguidance's
parser on the host, chosen per request. Each is checked against an independent reference:
constrained AR greedy decoding written plainly (a full forward per token, its logits masked by
the backend's own token-by-token matcher), and every output against `jsonschema`."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from decode.config import DecodeConfig, DecodeConfigError
from decode.constraints.backends import compile_for
from decode.constraints.spec import Constraint
from decode.engine.step.state import Request
from decode.static.static_batch import generate
from demo.eval import DEMO_MODEL, REGIMES, eval_items, load_model, stop_ids
from tests import plans
from tests.decode_reference import FullForward

from tests.compiles import COMPILES  # noqa: E402 - every compile (or cache load) here


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_MODEL)


def columns(item) -> list[str]:
    return item["prompt"].split("\n")[1].split(" | ")


def bounded_schema(cols) -> dict:
    """A records row whose integers must be >= 40 and names at least 5 characters: keywords
    the device tables do not enforce, so `auto` takes the host backend."""
    props = {c: ({"type": "integer", "minimum": 40} if c in ("age", "id", "score")
                 else {"type": "string", "minLength": 5, "maxLength": 12}) for c in cols}
    return {"type": "object", "properties": props, "required": list(cols),
            "additionalProperties": False}


def prompts_and_schemas(demo, n):
    config, params, tok = demo
    items = eval_items(DEMO_MODEL, "records", n)
    return ([tok.encode(it["prompt"]) for it in items],
            [bounded_schema(columns(it)) for it in items])


def reference_loop(params, config, prompt, compiled, stops, max_new):
    """Constrained AR greedy decoding, plainly: a full forward (no cache) per token, its last
    logits masked with the compiled constraint's own matcher, argmax, advance."""
    forward = FullForward(params, config, len(prompt) + max_new)
    m, out, toks = compiled.matcher(stops), [], list(prompt)
    for _ in range(max_new):
        logits = forward(toks, list(range(len(toks))))[-1].astype(np.float64)
        allowed = np.zeros(config.vocab_size, bool)
        ok = m.allowed()
        allowed[:len(ok)] = ok
        t = int(np.argmax(np.where(allowed, logits, -np.inf)))
        out.append(t)
        toks.append(t)
        if t in stops:
            break
        assert m.advance(t)
    return out


def decoded(tok, ids, stops):
    return tok.decode([t for t in ids if t not in stops])


def test_backend_choice_and_refusals(demo):
    config, _, tok = demo
    simple = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                     "required": ["a"], "additionalProperties": False})
    bounded = Constraint.json_schema({"type": "integer", "minimum": 18},
                                     "response_format.json_schema.schema")
    assert compile_for(simple, tok, config.vocab_size).backend == "device"
    assert compile_for(simple, tok, config.vocab_size, "host").backend == "host"
    assert compile_for(bounded, tok, config.vocab_size).backend == "host"
    with pytest.raises(DecodeConfigError) as e:
        compile_for(bounded, tok, config.vocab_size, "device")
    assert e.value.field == "response_format.json_schema.schema.minimum"
    for schema, words in [({"enum": []}, "empty"),
                          ({"type": "integer", "minimum": 10, "maximum": 3}, "10"),
                          ({"type": "array", "uniqueItems": True}, "uniqueItems")]:
        with pytest.raises(DecodeConfigError) as e:
            compile_for(Constraint.json_schema(schema, "s"), tok, config.vocab_size)
        assert e.value.field.startswith("s") and words in str(e.value), str(e.value)
    with pytest.raises(DecodeConfigError, match="lookaround"):
        compile_for(Constraint.regex("(?=a)b", "regex"), tok, config.vocab_size)


def test_host_matcher_follows_the_schema(demo):
    """The host matcher's walk over tokenized instances agrees with jsonschema."""
    config, _, tok = demo
    schema = {"type": "object", "properties": {"price": {"type": "number", "minimum": 0}},
              "required": ["price"], "additionalProperties": False}
    g = compile_for(Constraint.json_schema(schema), tok, config.vocab_size)
    for value in (0, 3.5, 12, -10.99, -1, 1e3):
        inst = {"price": value}
        m, ok = g.matcher(), True
        for t in tok.encode(json.dumps(inst)):
            ok = ok and bool(m.allowed()[t]) and m.advance(t)
        assert (ok and m.accepting()) == jsonschema.Draft202012Validator(schema).is_valid(inst)


def test_masks_computed_together_equal_each_parsers_own(demo):
    """host_guide.masks_along (all slots' masks in llguidance's pool, along their drafts) gives, row by
    row, what each matcher reports when walked one token at a time, stop ids included."""
    from decode.engine.step.host_guide import masks_along
    config, _, tok = demo
    stops = [tok.eos_token_id]
    schemas = [{"type": "integer", "minimum": 10}, {"type": "string", "maxLength": 4},
               {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]
    texts = ["123", '"ab"', "[true, false]"]
    jobs, want = [], []
    for schema, text in zip(schemas, texts):
        g = compile_for(Constraint.json_schema(schema), tok, config.vocab_size, backend="host")
        ids = tok.encode(text)
        for cut in (0, 1, len(ids)):
            m = g.matcher(stops)
            draft = ids[:min(cut, 3)]
            rows = []
            for p in range(4):
                m.advance_all(draft[:min(p, len(draft))])
                rows.append(m.bits())
                m.rollback(min(p, len(draft)))
            jobs.append((m, draft)), want.append(rows)
    got = masks_along(jobs, 4, (config.vocab_size + 31) // 32)
    words = want[0][0].shape[0]
    assert got.shape == (len(jobs), 4, (config.vocab_size + 31) // 32)
    for j, rows in enumerate(want):
        for p, row in enumerate(rows):
            assert np.array_equal(got[j, p, :words], row), (j, p)
    assert any(got[j, -1].any() for j in range(len(jobs)))


def test_host_backend_equals_the_constrained_reference_loop(demo):
    """Verified streaming and AR under the host backend give constrained AR greedy's tokens."""
    config, params, tok = demo
    prompts, schemas = prompts_and_schemas(demo, 1)
    stops = stop_ids(tok, config, REGIMES["records"])
    g = compile_for(Constraint.json_schema(schemas[0]), tok, config.vocab_size)
    assert g.backend == "host"
    ref = reference_loop(params, config, prompts[0], g, stops, 64)
    jsonschema.validate(json.loads(decoded(tok, ref, stops)), schemas[0])
    for method, window in (("verified", 8), ("ar", 1)):
        dc = DecodeConfig(method=method, window=window, max_new_tokens=64, stop_token_ids=stops)
        got = generate(params, config, prompts, dc, automata=[g]).tokens
        assert list(got[0]) == ref, method


def test_both_backends_in_one_streaming_batch(demo):
    """Streaming with a host-backed row, a device-backed row and a free row in one batch: the
    constrained rows validate and commit at least a token a forward; the free row is what it
    is alone."""
    config, params, tok = demo
    prompts, schemas = prompts_and_schemas(demo, 2)
    stops = stop_ids(tok, config, REGIMES["records"])
    host = compile_for(Constraint.json_schema(schemas[0]), tok, config.vocab_size)
    plain = {"type": "object", "properties": {c: {"type": "string"} for c in ("name", "city")},
             "required": ["name", "city"], "additionalProperties": False}
    device = compile_for(Constraint.json_schema(plain), tok, config.vocab_size)
    assert (host.backend, device.backend) == ("host", "device")
    dc = DecodeConfig(method="streaming", window=8, max_new_tokens=96, stop_token_ids=stops)
    res = generate(params, config, [prompts[0], prompts[1], prompts[1]], dc,
                   automata=[host, device, None])
    alone = generate(params, config, [prompts[1]], dc).tokens[0]
    assert list(res.tokens[2]) == list(alone)
    for ids, schema in ((res.tokens[0], schemas[0]), (res.tokens[1], plain)):
        assert ids[-1] in stops
        jsonschema.validate(json.loads(decoded(tok, ids, stops)), schema)
    for row in res.rows[:2]:            # a token a forward at least (the first step only fills)
        assert row.steps <= row.n_gen + 1, row


def test_continuous_batching_on_the_host_backend(demo):
    """The Batcher (paged, two slots) with host-backed requests that queue behind each other:
    each output validates (a slot's parser is its request's, from its first token)."""
    from decode.engine.runtime.batcher import Batcher
    config, params, tok = demo
    prompts, schemas = prompts_and_schemas(demo, 3)
    stops = stop_ids(tok, config, REGIMES["records"])
    dec = plans.decoder(params, config, method="streaming", window=8, slots=2, capacity=512,
                        steps_per_call=4, sampling=False, page_size=16, num_pages=64)
    batcher, done = Batcher(dec), {}
    ids = {}
    for i, (p, s) in enumerate(zip(prompts, schemas)):
        g = compile_for(Constraint.json_schema(s), tok, config.vocab_size, "host")
        r = Request(prompt=tuple(p), max_new_tokens=96, stop_token_ids=stops, automaton=g)
        ids[batcher.submit(r, on_finish=lambda f: done.__setitem__(f.request_id, f))] = i
    batcher.run_until_idle()
    for rid, f in done.items():
        jsonschema.validate(json.loads(decoded(tok, f.tokens, stops)), schemas[ids[rid]])
    assert len(done) == 3


def test_no_compile_on_a_constrained_request(demo):
    """A Batcher built `guided` (as wedlm-serve builds it) compiles in `warm_up` every program a
    constrained request runs: a device-table request and a host-parser request after it compile
    nothing (the host parser's programs were compiled ahead of time: no backend compile)."""
    from decode.engine.runtime.batcher import Batcher
    config, params, tok = demo
    prompts, schemas = prompts_and_schemas(demo, 2)
    stops = stop_ids(tok, config, REGIMES["records"])
    dec = plans.decoder(params, config, method="streaming", window=8, slots=2, capacity=256,
                        steps_per_call=4, sampling=False, page_size=16, num_pages=48)
    batcher = Batcher(dec, guided=True)
    batcher.warm_up(256)
    before = len(COMPILES)
    plain = Constraint.json_schema({"type": "object", "properties": {"name": {"type": "string"}},
                                    "required": ["name"], "additionalProperties": False})
    compiled = [compile_for(plain, tok, config.vocab_size),
                compile_for(Constraint.json_schema(schemas[1]), tok, config.vocab_size)]
    assert [c.backend for c in compiled] == ["device", "host"]
    done = []
    for p, c in zip(prompts, compiled):
        batcher.submit(Request(prompt=tuple(p), max_new_tokens=48, stop_token_ids=stops,
                               automaton=c), on_finish=done.append)
    batcher.run_until_idle()
    assert len(done) == 2 and len(COMPILES) == before


@pytest.mark.parametrize("backend", ["device", "host"])
def test_alternatives_never_list_a_forbidden_token(demo, backend):
    """Streaming drafts carry the unrestricted reading's alternatives; the ones the constraint
    forbade at their position are left out (as the server lists them), the committed token
    kept wherever it was listed."""
    from decode.constraints.backends import allowed_alternatives
    from decode.engine.runtime.batcher import Batcher
    config, params, tok = demo
    prompts, _ = prompts_and_schemas(demo, 1)
    stops = stop_ids(tok, config, REGIMES["records"])
    plain = {"type": "object", "properties": {c: {"type": "string"} for c in ("name", "city")},
             "required": ["name", "city"], "additionalProperties": False}
    compiled = compile_for(Constraint.json_schema(plain), tok, config.vocab_size, backend)
    dec = plans.decoder(params, config, method="streaming", window=8, slots=1, capacity=512,
                        sampling=False, top_logprobs=5)
    batcher, done = Batcher(dec), []
    batcher.submit(Request(prompt=tuple(prompts[0]), max_new_tokens=64, stop_token_ids=stops,
                           automaton=compiled, top_logprobs=5), on_finish=done.append)
    batcher.run_until_idle()
    tokens, tops = list(done[0].tokens), [top for _, top in done[0].logprobs]
    kept = allowed_alternatives(compiled, stops, tokens, tops)
    m, forbidden = compiled.matcher(stops), 0
    for t, before, after in zip(tokens, tops, kept):
        ok = m.allowed()
        forbidden += sum(not ok[k] for k in before)
        assert all(ok[k] for k in after) and set(after) <= set(before)
        assert (t in after) == (t in before)
        if not m.advance(t):
            break
    assert forbidden > 0      # the unrestricted drafts did list some: the filter is needed


def test_block_decoding_refuses_a_host_constraint(demo):
    config, params, tok = demo
    prompts, schemas = prompts_and_schemas(demo, 1)
    g = compile_for(Constraint.json_schema(schemas[0]), tok, config.vocab_size)
    dc = DecodeConfig(method="block", window=8, max_new_tokens=16,
                      stop_token_ids=stop_ids(tok, config, REGIMES["records"]))
    with pytest.raises(DecodeConfigError, match="block decoding does not take"):
        generate(params, config, prompts, dc, automata=[g])


def test_auto_takes_the_host_at_once_while_the_builder_is_busy(demo, monkeypatch):
    """A device build that outlives its budget goes on in the background; a request for another
    schema meanwhile is not queued behind it (host at once, not after its own budget), and once
    the builder is free the next request for that schema waits for its tables and gets them."""
    import threading
    import time

    from decode.constraints import automaton, backends
    config, _, tok = demo
    slow, other = Constraint.regex("(ab|ba){2}x"), Constraint.regex("(cd|dc){2}y")
    gate, real = threading.Event(), automaton.for_tokenizer

    def build(c, t):
        if c.key() == slow.key():
            gate.wait(60)
        return real(c, t)
    monkeypatch.setattr(automaton, "for_tokenizer", build)
    try:
        assert compile_for(slow, tok, config.vocab_size, budget_s=0.2).backend == "host"
        t0 = time.perf_counter()
        assert compile_for(other, tok, config.vocab_size, budget_s=20).backend == "host"
        assert time.perf_counter() - t0 < 5
    finally:
        gate.set()
    for _ in range(600):
        if not backends.pending_builds():
            break
        time.sleep(0.05)
    assert compile_for(other, tok, config.vocab_size, budget_s=20).backend == "device"


def test_a_schema_whose_regex_explodes_is_refused_for_the_device_not_fatal(demo):
    """Optional properties, free-form objects among them, and the object itself again as array
    items (MaskBench's Github_medium o33692, a mock server's config): outlines-core's regex of it
    grows past gigabytes (it would abort the process). It is built in a child with bounded
    memory: the device tables refuse it by name, `auto` gives it to the host, and this process
    lives on."""
    config, _, tok = demo
    props = {"method": {"type": "string", "enum": ["GET", "POST", "PUT"]},
             "delay": {"type": "integer"}, "name": {"type": "string"},
             "category": {"type": "string"}, "getParameters": {"type": "object"},
             "postParameters": {"type": "object"}, "postJson": {"type": "object"},
             "responseCode": {"type": "integer"},
             "alternatives": {"type": "array", "items": {"$ref": "#"}},
             "redirect": {"type": "string"}, "generatesJson": {"type": "boolean"},
             "hidden": {"type": "boolean"}, "responsePath": {"type": "string"},
             "checkHeaders": {"type": "object"}}
    c = Constraint.json_schema({"type": "object", "properties": props})
    with pytest.raises(DecodeConfigError, match=r"json_schema: the schema's regular expression "
                                                r"for the device tables is too large"):
        compile_for(c, tok, config.vocab_size, backend="device", budget_s=60)
    g = compile_for(c, tok, config.vocab_size)
    assert g.backend == "host"
    text = '{"name": "x", "postJson": {"k": [1]}, "alternatives": [{"delay": 3}]}'
    assert g.matcher().advance_all(tok.encode(text)) == len(tok.encode(text))
    assert Constraint.json_schema({"type": "integer"}).to_regex()    # the child came back


def test_device_only_programs_hold_no_host_call(demo):
    """A state guided for the device tables only (`--constraint-backend device`) compiles a step
    without the host parser's callback (which would keep it out of JAX's persistent cache); the
    default one holds it, and a device constraint decodes the same under both."""
    import jax

    from decode.engine.step import programs
    config, params, tok = demo
    dec = plans.decoder(params, config, method="streaming", window=4, slots=2, capacity=64,
                        steps_per_call=2, sampling=False, page_size=0)

    def step_text(parsers):
        st = dec.init_state(guided=True, parsers=parsers)
        return str(jax.make_jaxpr(programs.one_step, static_argnums=(0,))(
            dec.static, dec.params, st, np.int32(dec.mask_id)))
    assert "callback" in step_text(True) and "callback" not in step_text(False)
    from decode.engine.runtime.batcher import Batcher
    prompt = tuple(tok.encode("Count by 2 from 4 to 30:\n"))
    auto = compile_for(Constraint.regex("[0-9]+(, [0-9]+){3}"), tok, config.vocab_size,
                       backend="device")
    outs = []
    for parsers in (True, False):
        b, done = Batcher(dec, guided=True, parsers=parsers), {}
        b.submit(Request(prompt=prompt, max_new_tokens=12, automaton=auto,
                         stop_token_ids=(tok.eos_token_id,)),
                 on_finish=lambda f: done.setdefault("t", f.tokens))
        b.run_until_idle()
        outs.append(done["t"])
    assert outs[0] == outs[1] and len(outs[0]) > 0
