"""Tool calling through wedlm-serve with the official openai client: `tools`, `tool_choice`
(required, a named function, auto, none) and `parallel_tool_calls`, the calls read back (whole
and streamed) and always valid under their function's schema, the tool turn rendered by the
chat template, and bad input refused by field. The demo model serves, with a chat template that
renders tools in the hermes format (its weights never saw one: the grammar writes the calls)."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

openai = pytest.importorskip("openai")

from decode.config import DecodeConfig  # noqa: E402
from decode.constraints.backends import compile_for  # noqa: E402
from decode.serving import serve  # noqa: E402
from decode.static.static_batch import generate  # noqa: E402
from decode.tools.calls import split_calls  # noqa: E402
from decode.tools.request import parse_tools  # noqa: E402
from demo.eval import DEMO_MODEL, load_model  # noqa: E402
from tests.live_server import serve_in_thread  # noqa: E402

TEMPLATE = (
    "{%- if tools %}<|system|>Functions:\n{%- for t in tools %}\n{{ t.function | tojson }}"
    "{%- endfor %}\nCall one as <tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>"
    "{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}\n"
    "{%- elif m.role == 'tool' %}<|tool|>{{ m.content }}\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}/[A-Z][a-z]{2,8}$"}},
        "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Oslo for 3 days?"}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """The demo model's folder with a chat template that renders tools (weights linked)."""
    folder = tmp_path_factory.mktemp("tool-model")
    for name in os.listdir(DEMO_MODEL):
        src = os.path.join(DEMO_MODEL, name)
        if name != "tokenizer_config.json" and os.path.isfile(src):
            os.symlink(os.path.abspath(src), folder / name)
    cfg = json.load(open(os.path.join(DEMO_MODEL, "tokenizer_config.json")))
    cfg["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(folder)


@pytest.fixture(scope="module")
def client(tool_model):
    from decode.engine.runtime.batcher import Batcher
    args = serve._parser().parse_args([
        "--checkpoint", tool_model, "--slots", "2", "--window", "8", "--capacity", "1024",
        "--model-name", "demo", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
        "--lazy-compile"])
    decoder, tokenizer, cfg = serve.load_decoder(args)
    engine = serve.EngineThread(Batcher(decoder, guided=True), max_pending=16).start()
    url, srv, thread, sock = serve_in_thread(serve.build_app(engine, tokenizer, cfg))
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    srv.should_exit = True
    thread.join(15)
    engine.shutdown(timeout=15)
    sock.close()


def check_calls(calls, names=None):
    for c in calls:
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_required_call_round_trip(client):
    """Call, tool result, final answer: the call is valid under its schema, the tool turn goes
    back through the template, and tool_choice 'none' answers in text."""
    out = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=96)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    check_calls(msg.tool_calls)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        c.model_dump() for c in msg.tool_calls]}] + [
        {"role": "tool", "tool_call_id": c.id, "content": '{"sky": "clear"}'}
        for c in msg.tool_calls]
    final = client.chat.completions.create(model="demo", messages=history, tools=[WEATHER],
                                           tool_choice="none", max_tokens=16)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason in ("stop", "length")


def test_parallel_calls_each_valid(client):
    """Parallel calls allowed under `required`: the output may end after any call (the demo
    model, never taught tools, used to write calls until its budget); every call returned is
    valid, each with its own id, and the answer ends as tool_calls, not at its length."""
    out = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=200)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls"
    assert len(calls) >= 1 and len({c.id for c in calls}) == len(calls)
    check_calls(calls)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_several_calls_are_split_each_whole_a_cut_one_dropped(parser):
    from decode.tools.formats import FORMATS
    fmt = FORMATS[parser]
    one = lambda city: fmt.open + json.dumps({"name": "get_weather", fmt.args_key: {  # noqa: E731
        "city": city, "days": 2}}) + fmt.close
    for tail in ("", fmt.sep, fmt.sep + one("Lima")[:-3]):      # nothing, a separator, a cut call
        content, calls = split_calls(fmt, one("Oslo") + fmt.sep + one("Paris") + tail)
        assert content is None and [json.loads(c["function"]["arguments"])["city"]
                                    for c in calls] == ["Oslo", "Paris"], (tail, calls)
        assert len({c["id"] for c in calls}) == 2


def test_named_choice_streamed_equals_whole(client):
    """A named function, one call (parallel off): the streamed deltas (index, id and name
    first, then the arguments in pieces) add up to the whole answer's call."""
    kw = dict(model="demo", messages=ASK, tools=[WEATHER, TIME], max_tokens=96,
              tool_choice={"type": "function", "function": {"name": "get_time"}},
              parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw)
    calls = whole.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    check_calls(calls, {"get_time"})
    name, args, reasons, first = None, "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        reasons.append(chunk.choices[0].finish_reason)
        for tc in chunk.choices[0].delta.tool_calls or []:
            first = first or tc
            name = name or (tc.function.name if tc.function else None)
            args += (tc.function.arguments or "") if tc.function else ""
    assert first.id and first.function.name == "get_time" and first.index == 0
    assert (name, args) == ("get_time", calls[0].function.arguments)
    assert reasons[-1] == "tool_calls"


def test_auto_answers_text_or_valid_calls(client):
    out = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER],
                                         tool_choice="auto", max_tokens=32)
    msg = out.choices[0].message
    check_calls(msg.tool_calls or [])
    assert msg.tool_calls or msg.content is not None


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]},
     "tools[0].function.parameters.properties.a.uniqueItems"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "messages": ASK + [{"role": "tool", "tool_call_id": "x",
                                              "content": "1"}]}, "messages[1].tool_call_id"),
])
def test_bad_tool_requests_are_400_by_field(client, extra, param):
    kw = dict(model="demo", messages=ASK, max_tokens=8)
    kw.update(extra)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert e.value.body["param"] == param, e.value.body


def test_a_template_without_tools_and_a_server_without_a_parser_refuse():
    body = {"tools": [WEATHER]}
    for parser, template, words in ((None, "{{ tools }}", "--tool-call-parser"),
                                    ("hermes", "{{ messages }}", "does not render tools; start "
                                     "with --chat-template FILE")):
        with pytest.raises(Exception, match=words):
            parse_tools(body, parser, True, template)


SHIPPED = os.path.join(os.path.dirname(DEMO_MODEL), "..", "configs", "chat_templates")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_shipped_chat_templates_render_tools_and_calls_the_parser_reads_back(parser):
    """configs/chat_templates/PARSER.jinja lists every function in the system turn and writes an
    assistant turn's calls (arguments as a string or an object) in the form PARSER splits back
    into the same calls; the server's tool check takes the template."""
    from decode.tools.formats import FORMATS
    from wedlm_jax.tokenizer import render_chat
    template = open(os.path.join(SHIPPED, f"{parser}.jinja")).read()
    calls = [{"id": "a", "type": "function", "function": {
                 "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 3})}},
             {"id": "b", "type": "function", "function": {
                 "name": "get_time", "arguments": {"zone": "Europe/Oslo"}}}]
    tools = [WEATHER, TIME]
    asked = render_chat(template, ASK, add_generation_prompt=True, tools=tools, special={})
    whole = render_chat(template, ASK + [{"role": "assistant", "content": None,
                                          "tool_calls": calls}],
                        add_generation_prompt=False, tools=tools, special={})
    assert all(json.dumps(t["function"]["name"]) in asked for t in tools) and ASK[0]["content"] in asked
    assert whole.startswith(asked)                 # the generation prompt opens the model's turn
    turn = whole[len(asked):].split("<|im_end|>")[0].split("<|eot_id|>")[0]
    content, got = split_calls(FORMATS[parser], turn)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                for c in got] == [("get_weather", {"city": "Oslo", "days": 3}),
                                                  ("get_time", {"zone": "Europe/Oslo"})]
    assert parse_tools({"tools": tools}, parser, True, template) is not None


def test_chat_template_flag_at_the_doors_and_the_start_up_mismatches(tmp_path, capsys, caplog):
    """--chat-template FILE replaces the checkpoint's template at both doors; an unreadable or
    broken file, and --enable-auto-tool-choice without a parser, exit 2 with one line before
    any model loads; a parser over a template that does not render tools warns once."""
    import logging

    from decode import cli
    from decode.checkpoint import OpenCheckpoint
    hermes = os.path.join(SHIPPED, "hermes.jinja")
    args = serve._parser().parse_args(["--checkpoint", DEMO_MODEL, "--chat-template", hermes])
    ckpt = OpenCheckpoint.from_args(args)
    assert ckpt.tokenizer.chat_template == open(hermes).read()
    assert ckpt.tokenizer.template_source == hermes
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    for door, argv, says in (
            (serve.main, ["--chat-template", str(tmp_path / "none.jinja")],
             f"--chat-template {tmp_path / 'none.jinja'}: cannot read it"),
            (serve.main, ["--chat-template", str(broken)], f"--chat-template {broken}"),
            (serve.main, ["--enable-auto-tool-choice"],
             "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json)"),
            (cli.main, ["--chat-template", str(tmp_path / "none.jinja"), "--prompt", "hi"],
             "cannot read it")):
        rc = door(["--checkpoint", DEMO_MODEL] + argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and says in err[-1] and "Traceback" not in "\n".join(err), (argv, err)
    with caplog.at_level(logging.WARNING, logger="wedlm-serve"):
        serve.load_decoder(serve._parser().parse_args([
            "--checkpoint", DEMO_MODEL, "--tool-call-parser", "hermes", "--slots", "1",
            "--capacity", "64"]))
    warned = [r.getMessage() for r in caplog.records if "does not render tools" in r.getMessage()]
    assert len(warned) == 1 and "--chat-template FILE" in warned[0], warned


def test_verified_tool_calls_equal_ar():
    """Under a tool grammar (host backend), verified streaming gives AR's tokens."""
    config, params, tok = load_model(DEMO_MODEL)
    tools = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}, "hermes", False,
                        "{{ tools }}")
    compiled = compile_for(tools.constraint(), tok, config.vocab_size)
    prompt = tok.encode("<|user|>weather in Lima for 2 days\n<|assistant|>")
    stops = tuple(tok.default_stop_ids(config.eos_token_id))
    out = {}
    for method, window in (("verified", 8), ("ar", 1)):
        dc = DecodeConfig(method=method, window=window, max_new_tokens=80, stop_token_ids=stops)
        out[method] = list(generate(params, config, [prompt], dc, automata=[compiled]).tokens[0])
    assert out["verified"] == out["ar"]
    content, calls = split_calls(tools.fmt, tok.decode([t for t in out["ar"] if t not in stops]))
    assert calls and content is None
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])



def test_batch_job_lines_with_tools(tool_model, tmp_path, capsys):
    """wedlm-decode --input: a line's messages, tools and tool_choice; its output line carries
    the calls (valid under their schemas) beside a plain line; a bad tool line is refused by
    file:line and field before loading; the parser flag alone is refused."""
    from decode.cli import main
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": "t", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
              "parallel_tool_calls": False, "max_tokens": 96},
             {"id": "p", "prompt": "Count by 3 from 12 to 30:\n", "max_tokens": 8}]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["--checkpoint", tool_model, "--window", "8", "--slots", "2", "--capacity", "1024"]
    assert main(args + ["--input", str(src), "--output", str(out),
                        "--tool-call-parser", "hermes"]) == 0
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert got["t"]["finish_reason"] == "tool_calls" and len(got["t"]["tool_calls"]) == 1
    call = got["t"]["tool_calls"][0]["function"]
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert "tool_calls" not in got["p"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(dict(lines[0], tool_choice={"type": "function",
                                                          "function": {"name": "nope"}})) + "\n")
    assert main(args + ["--input", str(bad), "--output", str(tmp_path / "o2.jsonl"),
                        "--tool-call-parser", "hermes"]) == 2
    assert "bad.jsonl:1: field 'tool_choice.function.name'" in capsys.readouterr().err
    assert main(args + ["--prompt", "x", "--tool-call-parser", "hermes"]) == 2
    assert "--tool-call-parser goes with --input" in capsys.readouterr().err


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_the_grammar_ends_a_named_call_after_one_and_lets_required_stop_after_any(parser):
    """Token by token through the host matcher: a named function accepts exactly one call (a
    second is refused, whatever parallel_tool_calls says); `required` with parallel calls may
    end after any call, a trailing separator included; `auto` may end after a call too."""
    from decode.tools.formats import FORMATS
    from decode.constraints.host import compile_grammar
    _, _, tok = load_model(DEMO_MODEL)
    fmt = FORMATS[parser]
    one = fmt.open + json.dumps({"name": "get_weather", fmt.args_key: {"city": "Oslo", "days": 3}}) \
        + fmt.close

    def accepts(choice, text: str) -> tuple[bool, bool]:
        """(every token of `text` allowed, the output may end there)"""
        body = {"tools": [WEATHER], "tool_choice": choice}
        tools = parse_tools(body, parser, True, TEMPLATE)
        m = compile_grammar(tools.constraint(), tok, None).matcher()
        ids = tok.encode(text)
        return m.advance_all(ids) == len(ids), m.accepting()
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert accepts(named, one) == (True, True)
    assert not accepts(named, one + fmt.sep + one)[0]            # never a second call
    assert accepts("required", one) == (True, True)
    assert accepts("required", one + fmt.sep + one) == (True, True)
    assert accepts("required", one + fmt.sep) == (True, True)     # may stop after the separator


def test_named_choice_is_one_call_with_parallel_calls_allowed(client):
    """A named function with parallel_tool_calls left at its default (true): one call, finish
    `tool_calls` (it used to repeat the call until max_tokens), the same whole and streamed."""
    kw = dict(model="demo", messages=ASK, tools=[WEATHER, TIME], max_tokens=200,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    check_calls(calls, {"get_weather"})
    args, reasons = "", []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            reasons.append(chunk.choices[0].finish_reason)
            for tc in chunk.choices[0].delta.tool_calls or []:
                assert tc.index == 0
                args += (tc.function.arguments or "") if tc.function else ""
    assert args == calls[0].function.arguments and reasons[-1] == "tool_calls"
