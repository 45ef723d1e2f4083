"""Structured outputs through wedlm-serve with the official openai client: OpenAI's
response_format (json_schema, json_object) on chat and completions, vLLM's structured_outputs
and guided_* fields, server-sent events under a constraint, and bad constraints refused with a
400 naming the field before any decoding. The demo model serves (its records prompts)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

openai = pytest.importorskip("openai")

from decode.serving import serve  # noqa: E402
from demo.eval import DEMO_MODEL, eval_items  # noqa: E402
from tests.live_server import serve_in_thread  # noqa: E402  (the app on 127.0.0.1 in a thread)

TYPES = {"name": "string", "city": "string", "color": "string", "age": "integer",
         "id": "integer", "score": "integer"}


@pytest.fixture(scope="module")
def server():
    from decode.engine.runtime.batcher import Batcher
    args = serve._parser().parse_args(["--checkpoint", DEMO_MODEL, "--slots", "2", "--window", "8",
                                       "--capacity", "384", "--model-name", "demo"])
    decoder, tokenizer, cfg = serve.load_decoder(args)
    from decode.metrics import ServerMetrics
    batcher = Batcher(decoder)
    engine = serve.EngineThread(batcher, max_pending=16, scorer=serve.scorer_for(decoder),
                          metrics=ServerMetrics(batcher, "demo", "streaming")).start()
    app = serve.build_app(engine, tokenizer, cfg)
    url, srv, thread, sock = serve_in_thread(app)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    srv.should_exit = True
    thread.join(15)
    engine.shutdown(timeout=15)
    sock.close()


def item_and_schema(i=0):
    it = eval_items(DEMO_MODEL, "records", i + 1)[i]
    cols = it["prompt"].split("\n")[1].split(" | ")
    return it, {"type": "object", "properties": {c: {"type": TYPES[c]} for c in cols},
                "required": cols, "additionalProperties": False}


def test_response_format_json_schema_on_completions_and_chat(server):
    it, schema = item_and_schema()
    rf = {"type": "json_schema", "json_schema": {"name": "row", "schema": schema, "strict": True}}
    out = server.completions.create(model="demo", prompt=it["prompt"], max_tokens=96,
                                    extra_body={"response_format": rf})
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    assert out.choices[0].finish_reason == "stop"
    # the demo model has no chat template: the chat endpoint reads the field first (a bad one
    # is refused by name before the messages are looked at)
    bad = {"type": "json_schema", "json_schema": {"name": "row", "schema": {"type": "frob"}}}
    with pytest.raises(openai.BadRequestError) as e:
        server.chat.completions.create(model="demo", max_tokens=96, response_format=bad,
                                       messages=[{"role": "user", "content": it["prompt"]}])
    assert e.value.body["param"] == "response_format.json_schema.schema"


def test_vllm_fields_and_streaming(server):
    it, schema = item_and_schema(1)
    a = server.completions.create(model="demo", prompt=it["prompt"], max_tokens=96,
                                  extra_body={"structured_outputs": {"json": schema}})
    b = server.completions.create(model="demo", prompt=it["prompt"], max_tokens=96,
                                  extra_body={"guided_json": schema})
    assert a.choices[0].text == b.choices[0].text
    jsonschema.validate(json.loads(a.choices[0].text), schema)
    chunks = server.completions.create(model="demo", prompt=it["prompt"], max_tokens=96,
                                       stream=True, extra_body={"guided_json": schema})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == a.choices[0].text
    c = server.completions.create(model="demo", prompt="copy [3, 1, 2] ->", max_tokens=32,
                                  extra_body={"guided_regex": r" \[[0-9]+(, [0-9]+)*\]"})
    assert re.fullmatch(r" \[[0-9]+(, [0-9]+)*\]", c.choices[0].text)
    d = server.completions.create(model="demo", prompt=it["prompt"], max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert d.choices[0].text in ("red", "blue")
    e = server.completions.create(model="demo", prompt=it["prompt"], max_tokens=96,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(e.choices[0].text), dict)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar"),
    ({"guided_json": {"enum": []}}, "guided_json.enum"),                  # the keyword's path
    ({"guided_json": {"type": "integer", "minimum": 10, "maximum": 3}}, "guided_json.minimum"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json.uniqueItems"),
    ({"guided_regex": "(?=a)b"}, "guided_regex"),
])
def test_bad_constraints_are_400_naming_the_field(server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.completions.create(model="demo", prompt="Table:", max_tokens=8, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_host_backend_keywords_hold_and_are_counted(server):
    """A schema with bounds the device tables cannot enforce goes to the host parser: the output
    keeps the bounds, the alternatives listed never include a forbidden token, and the
    constrained-requests counter says which backend served it."""
    import httpx
    it, schema = next(x for x in map(item_and_schema, range(2, 12))
                      if any(p["type"] == "integer" for p in x[1]["properties"].values()))
    for key, prop in schema["properties"].items():
        if prop["type"] == "integer":
            prop["minimum"] = 500
    out = server.completions.create(model="demo", prompt=it["prompt"], max_tokens=96, logprobs=3,
                                    extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    assert all(v > -1e30 for top in out.choices[0].logprobs.top_logprobs for v in top.values())
    text = httpx.get(str(server.base_url).replace("/v1/", "/metrics")).text
    counts = {ln.split('backend="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1])
              for ln in text.splitlines() if ln.startswith("wedlm:constrained_requests_total{")}
    assert counts.get("host", 0) >= 1 and counts.get("device", 0) >= 1, counts
