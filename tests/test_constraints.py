"""Structured outputs: the constraint compiler against Python's `re`, the request fields, and
constrained decoding on the demo model against a plain token-by-token reference loop (a full
forward per token, the logits masked with the same automaton on the host), at every method."""

from __future__ import annotations

import itertools
import json
import random
import re

import jsonschema
import numpy as np
import pytest

from decode.config import DecodeConfig, DecodeConfigError
from decode.constraints.automaton import compile_constraint
from decode.constraints.spec import Constraint, from_fields
from decode.constraints.vocab import vocabulary_bytes
from decode.engine.runtime.batcher import Batcher
from decode.static.static_batch import generate
from decode.engine.step.state import Request
from demo.eval import DEMO_MODEL, REGIMES, eval_items, load_model, stop_ids
from demo.tasks import list_problem
from tests import plans
from tests.decode_reference import FullForward

TYPES = {"name": "string", "city": "string", "color": "string", "age": "integer",
         "id": "integer", "score": "integer"}
N = 4


@pytest.fixture(scope="module")
def demo():
    config, params, tok = load_model(DEMO_MODEL)
    vocab, size = vocabulary_bytes(tok)
    return config, params, tok, vocab, size


def columns(item) -> list[str]:
    return item["prompt"].split("\n")[1].split(" | ")


def row_schema(cols) -> dict:
    return {"type": "object", "properties": {c: {"type": TYPES[c]} for c in cols},
            "required": list(cols), "additionalProperties": False}


def lines_constraint(schema) -> Constraint:
    """JSON lines of `schema`: 1-5 objects, one a line (a records answer)."""
    row = Constraint.json_schema(schema).to_regex()
    return Constraint.regex(f"{row}(\\n{row}){{0,4}}")


def records(demo, n=N):
    config, params, tok, vocab, size = demo
    items = eval_items(DEMO_MODEL, "records", n)
    autos = [compile_constraint(lines_constraint(row_schema(columns(it))), vocab, size)
             for it in items]
    return items, [tok.encode(it["prompt"]) for it in items], autos


def texts(tok, tokens, stops):
    return [tok.decode([t for t in ids if t not in stops]) for ids in tokens]


def check_lines(text, schema):
    lines = text.split("\n")
    assert 1 <= len(lines) <= 5, text
    for line in lines:
        jsonschema.validate(json.loads(line), schema)


# ------------------------------------------------------------------ the compiler

def _strings(alphabet, max_len):
    for n in range(1, max_len + 1):
        for chars in itertools.product(alphabet, repeat=n):
            yield "".join(chars)


@pytest.mark.parametrize("pattern", [r"[0-9]+( [0-9]+)*", r"(ab|a b)c?", r"\[[0-9]{1,2}(, [0-9]{1,2})*\]"])
def test_tables_accept_exactly_the_regex(demo, pattern):
    """Brute force over short strings: a string's tokens walk to an accepting state iff Python's
    re.fullmatch accepts it (every tokenization the tokenizer gives is checked)."""
    _, _, tok, vocab, size = demo
    auto = compile_constraint(Constraint.regex(pattern), vocab, size)
    alphabet = sorted(set("0123456789 ab c[],") & set("".join(ch for ch in pattern if ch.isprintable())) | {"1", " "})
    checked = 0
    for text in _strings(alphabet, 4):
        s = 0
        for t in tok.encode(text):
            s = auto.next_state(s, t)
            if s < 0:
                break
        assert (s >= 0 and bool(auto.accept[s])) == bool(re.fullmatch(pattern, text)), text
        checked += 1
    assert checked > 100


def test_every_allowed_path_stays_in_the_language(demo):
    """From every state, each allowed token leads to a state from which an accepting state is
    reachable; stop tokens are allowed in accepting states only."""
    _, _, tok, vocab, size = demo
    auto = compile_constraint(Constraint.choice(["yes", "no", "maybe so"]), vocab, size)
    k = auto.with_stops([0])
    for s in range(auto.num_states):
        allowed = auto.trans[s][k] >= 0
        assert allowed.any()
        assert bool(allowed[0]) == bool(auto.accept[s])
    outs = set()
    def spell(s, ids):
        if auto.accept[s]:
            outs.add(tok.decode(ids))
        for t in np.flatnonzero(auto.trans[s][auto.klass] >= 0):
            spell(auto.next_state(s, int(t)), ids + [int(t)])
    spell(0, [])
    assert outs == {"yes", "no", "maybe so"}


@pytest.mark.parametrize("make, field", [
    (lambda: Constraint.json_schema("{bad", "response_format.json_schema.schema"),
     "response_format.json_schema.schema"),
    (lambda: Constraint.json_schema({"type": "frobnicate"}, "structured_outputs.json"),
     "structured_outputs.json"),
    (lambda: Constraint.regex("", "guided_regex"), "guided_regex"),
    (lambda: Constraint.regex("a{100000}", "guided_regex"), "guided_regex"),
    (lambda: Constraint.choice([], "guided_choice"), "guided_choice"),
    (lambda: Constraint.choice(["a", 3], "structured_outputs.choice"), "structured_outputs.choice"),
])
def test_bad_constraints_name_their_field(make, field):
    with pytest.raises(DecodeConfigError) as e:
        make()
    assert e.value.field == field and field in str(e.value)


def test_compile_errors_name_the_field(demo):
    _, _, _, vocab, size = demo
    with pytest.raises(DecodeConfigError, match="guided_regex: cannot compile") as e:
        compile_constraint(Constraint.regex("(a", "guided_regex"), vocab, size)
    assert e.value.field == "guided_regex"
    with pytest.raises(DecodeConfigError, match="above the limit") as e:
        compile_constraint(Constraint.regex("[a-z]{1,40}", "structured_outputs.regex"), vocab, size,
                           max_bytes=1024)
    assert e.value.field == "structured_outputs.regex"


def test_request_fields_are_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    a = from_fields({"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": schema, "strict": True}}})
    b = from_fields({"structured_outputs": {"json": schema}})
    c = from_fields({"guided_json": json.dumps(schema)})
    assert a.key() == b.key() == c.key()
    assert from_fields({"guided_choice": ["x", "y"]}).key() == \
        from_fields({"structured_outputs": {"choice": ["x", "y"]}}).key()
    assert from_fields({"response_format": {"type": "json_object"}}).kind == "json_object"
    assert from_fields({"response_format": {"type": "text"}}) is None
    assert from_fields({}) is None
    for body, field in [({"response_format": {"type": "xml"}}, "response_format.type"),
                        ({"structured_outputs": {"grammar": "x"}}, "structured_outputs.grammar"),
                        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                         "response_format.json_schema.schema")]:
        with pytest.raises(DecodeConfigError) as e:
            from_fields(body)
        assert e.value.field == field


# ------------------------------------------------------------------ decoding

def reference_loop(params, config, prompt, auto, stops, max_new):
    """Constrained AR greedy decoding, plainly: a full forward (no cache) per token, its last
    logits masked with the automaton on the host, argmax, advance the state."""
    forward = FullForward(params, config, len(prompt) + max_new)
    klass, out, s = auto.with_stops(stops), [], 0
    toks = list(prompt)
    for _ in range(max_new):
        logits = forward(toks, list(range(len(toks))))[-1].astype(np.float64)
        allowed = np.zeros(config.vocab_size, bool)
        allowed[:len(klass)] = auto.trans[s][klass] >= 0
        t = int(np.argmax(np.where(allowed, logits, -np.inf)))
        out.append(t)
        toks.append(t)
        if t in stops:
            break
        s = int(auto.trans[s, klass[t]])
    return out


def test_verified_equals_the_constrained_reference_loop(demo):
    config, params, tok, _, _ = demo
    items, prompts, autos = records(demo, 1)
    stops = stop_ids(tok, config, REGIMES["records"])
    ref = [reference_loop(params, config, p, a, stops, 64) for p, a in zip(prompts, autos)]
    for method, window in (("verified", 8), ("ar", 1)):
        dc = DecodeConfig(method=method, window=window, max_new_tokens=64, stop_token_ids=stops)
        got = generate(params, config, prompts, dc, automata=autos).tokens
        assert [list(g) for g in got] == ref, method


@pytest.mark.parametrize("method, window, refill", [
    ("streaming", 8, "before"), ("streaming", 16, "after"), ("block", 8, "after"),
    ("verified", 8, "after"), ("verified", 16, "before"), ("ar", 1, "after")])
def test_records_outputs_parse_and_validate(demo, method, window, refill):
    config, params, tok, _, _ = demo
    items, prompts, autos = records(demo)
    stops = stop_ids(tok, config, REGIMES["records"])
    dc = DecodeConfig(method=method, window=window, refill=refill, max_new_tokens=192,
                      stop_token_ids=stops)
    res = generate(params, config, prompts, dc, automata=autos)
    for it, text, ids in zip(items, texts(tok, res.tokens, stops), res.tokens):
        assert ids[-1] in stops, text            # finished by the automaton's end, not a budget
        check_lines(text, row_schema(columns(it)))


def test_constraints_the_model_would_break_are_kept(demo):
    """Keys in the reverse of the table's order and a city outside what the table says: the
    model copies the table, the constraint wins."""
    config, params, tok, vocab, size = demo
    items = [it for it in eval_items(DEMO_MODEL, "records", 12) if "city" in columns(it)][:2]
    stops = stop_ids(tok, config, REGIMES["records"])
    schemas = []
    for it in items:
        cols = columns(it)[::-1]
        s = row_schema(cols)
        s["properties"]["city"] = {"enum": ["Atlantis"]}
        schemas.append(s)
    autos = [compile_constraint(Constraint.json_schema(s), vocab, size) for s in schemas]
    dc = DecodeConfig(method="streaming", window=16, max_new_tokens=64, stop_token_ids=stops)
    res = generate(params, config, [tok.encode(it["prompt"]) for it in items], dc, automata=autos)
    free = generate(params, config, [tok.encode(it["prompt"]) for it in items], dc)
    for it, s, text, free_text in zip(items, schemas, texts(tok, res.tokens, stops),
                                      texts(tok, free.tokens, stops)):
        obj = json.loads(text)
        jsonschema.validate(obj, s)
        assert list(obj) == columns(it)[::-1] and obj["city"] == "Atlantis"
        assert not free_text.startswith('{"' + columns(it)[-1])     # the model alone would not


def test_regex_on_list_prompts_and_choice(demo):
    config, params, tok, vocab, size = demo
    probs = [list_problem(random.Random(9000 + i)) for i in range(3)]
    pattern = r" \[[0-9]{1,2}(, [0-9]{1,2}){0,9}\]"
    auto = compile_constraint(Constraint.regex(pattern), vocab, size)
    choice = compile_constraint(Constraint.choice(["copy", "sort"]), vocab, size)
    stops = tuple(tok.default_stop_ids(config.eos_token_id))
    prompts = [tok.encode(p) for p, _ in probs] + [tok.encode("copy [1, 2] ->")]
    dc = DecodeConfig(method="verified", window=8, max_new_tokens=48, stop_token_ids=stops)
    res = generate(params, config, prompts, dc, automata=[auto] * 3 + [choice])
    out = texts(tok, res.tokens, stops)
    for (p, a), text in zip(probs, out):
        assert re.fullmatch(pattern, text), text
    assert out[3] in ("copy", "sort")


def test_mixed_batch_leaves_other_slots_alone(demo):
    """A batch of a schema, no constraint and a choice: the free row's tokens are those of the
    same prompt decoded with no constraint anywhere; the constrained rows keep theirs."""
    config, params, tok, vocab, size = demo
    items, prompts, autos = records(demo, 2)
    stops = stop_ids(tok, config, REGIMES["records"])
    choice = compile_constraint(Constraint.choice(["Alice", "Bob"]), vocab, size)
    dc = DecodeConfig(method="streaming", window=8, max_new_tokens=160, stop_token_ids=stops)
    batch = generate(params, config, [prompts[0], prompts[1], prompts[0]], dc,
                     automata=[autos[0], None, choice]).tokens
    alone = generate(params, config, [prompts[1]], dc).tokens[0]
    assert list(batch[1]) == list(alone)
    t = texts(tok, batch, stops)
    check_lines(t[0], row_schema(columns(items[0])))
    assert t[2] in ("Alice", "Bob")


def test_continuous_batching_with_constraints(demo):
    """The Batcher (paged admission, two slots): constrained and free requests queued together
    (a slot goes from one constraint to none to another); every constrained output validates,
    the free one equals its static decode."""
    config, params, tok, _, _ = demo
    page_size = 16
    items, prompts, autos = records(demo, 2)
    stops = stop_ids(tok, config, REGIMES["records"])
    kw = dict(page_size=page_size, num_pages=64) if page_size else {}
    dec = plans.decoder(params, config, method="streaming", window=8, slots=2, capacity=512,
                        steps_per_call=4, sampling=False, **kw)
    batcher = Batcher(dec)
    done = {}
    reqs = [Request(prompt=tuple(p), max_new_tokens=160, stop_token_ids=stops, automaton=a)
            for p, a in zip(prompts, autos)] + [Request(prompt=tuple(prompts[0]),
                                                        max_new_tokens=160, stop_token_ids=stops)]
    ids = {batcher.submit(r, on_finish=lambda f: done.__setitem__(f.request_id, f)): i
           for i, r in enumerate(reqs)}
    batcher.run_until_idle()
    out = {ids[k]: v for k, v in done.items()}
    for i, it in enumerate(items):
        check_lines(tok.decode([t for t in out[i].tokens if t not in stops]),
                    row_schema(columns(it)))
    dc = DecodeConfig(method="streaming", window=8, max_new_tokens=160, stop_token_ids=stops)
    assert list(out[2].tokens) == list(generate(params, config, [prompts[0]], dc).tokens[0])


# ------------------------------------------------------------------ the command line and batch job

def test_cli_and_batch_job_constraints(demo, tmp_path, capsys):
    """wedlm-decode --json-schema FILE decodes to a valid object; a bad flag or a bad batch line
    is one line naming the flag or FILE:LINE and the field, exit 2, before the weights load."""
    from decode.cli import main
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    prompt = "Table:\nname | age\nBob | 33\nJSON lines:\n"
    assert main(["--checkpoint", DEMO_MODEL, "--prompt", prompt, "--json-schema", str(path),
                 "--max-new-tokens", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["results"][0] if "results" in out else out
    jsonschema.validate(json.loads(row["text"]), schema)
    for flags, words in [(["--regex", "(bad"], "--regex: unclosed group"),
                         (["--json-schema", str(tmp_path / "none.json")], "--json-schema"),
                         (["--regex", "a", "--choice", "b"], "give one constraint")]:
        assert main(["--checkpoint", DEMO_MODEL, "--prompt", "x", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, err
    bad = tmp_path / "in.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps(
        {"prompt": "y", "structured_outputs": {"choice": []}}) + "\n")
    assert main(["--checkpoint", DEMO_MODEL, "--input", str(bad), "--output",
                 str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad}:2:" in err and "structured_outputs.choice" in err, err
    assert not (tmp_path / "out.jsonl").exists()


def test_preempted_constrained_requests_go_on_from_their_state(demo):
    """A pool too small for three growing records answers preempts one: readmitted with its
    prompt and emitted tokens, its automaton goes on from the state those tokens reached, so
    verified decoding gives the same tokens as with pages to spare, and every output validates."""
    config, params, tok, _, _ = demo
    items, prompts, autos = records(demo, 3)
    stops = stop_ids(tok, config, REGIMES["records"])
    reqs = [Request(prompt=tuple(p), max_new_tokens=160, stop_token_ids=stops, automaton=a)
            for p, a in zip(prompts, autos)]
    outs = []
    for pages in (96, 24):
        dec = plans.decoder(params, config, method="verified", window=8, slots=3, capacity=256,
                            steps_per_call=4, sampling=False, page_size=16, num_pages=pages)
        b, done = Batcher(dec), {}
        ids = {b.submit(r, on_finish=lambda f: done.__setitem__(f.request_id, f)): i
               for i, r in enumerate(reqs)}
        b.run_until_idle()
        outs.append(({ids[k]: v for k, v in done.items()}, b.preemptions))
    (roomy, none), (small, preempted) = outs
    assert none == 0 and preempted > 0
    for i, it in enumerate(items):
        assert small[i].tokens == roomy[i].tokens
        check_lines(tok.decode([t for t in small[i].tokens if t not in stops]),
                    row_schema(columns(it)))
