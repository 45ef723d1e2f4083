"""One tokenizer module for training and decoding: the same messages through the
training path (`train.data.pipeline.tokenize_record`) and the decoding path (`wedlm-decode`'s prompt reader)
give the ids transformers' `apply_chat_template` gives, for a Qwen-style template with a system
message, tools, tool calls, `{% break %}` and `{% continue %}`; the Jinja environment behaves like
transformers'; a template that fails names its own error and the message index, before anything
is loaded or compiled."""

from __future__ import annotations

import datetime
import json
import os

import pytest

from decode import cli
from decode import text as decode_text
from tests.released import MESSAGES, TOOLS, qwen_style_tokenizer
from train.data import pipeline as data_lib
from wedlm_jax import tokenizer as tokenizer_lib


def _hf(folder):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(folder)


def _hf_ids(hf, messages, **kw):
    return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def _decode_prompts(folder, tmp_path, records, *extra):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    args = cli._parser().parse_args(["--checkpoint", folder, "--prompts-file", str(f), *extra])
    return cli._read_prompts(args, decode_text.load_tokenizer(folder))


def test_training_and_decoding_give_transformers_ids(tmp_path):
    folder = qwen_style_tokenizer(tmp_path / "tok")
    hf = _hf(folder)
    # training: the whole conversation, assistant turns trained
    info = data_lib.load_tokenizer(folder)
    ids, trained = data_lib.tokenize_record({"messages": MESSAGES, "tools": TOOLS}, info)
    assert list(ids) == _hf_ids(hf, MESSAGES, tools=TOOLS)
    # decoding: the conversation up to the last assistant turn, with the generation prompt
    (text, prompt_ids), (text2, prompt_ids2) = _decode_prompts(
        folder, tmp_path, [{"messages": MESSAGES[:4], "tools": TOOLS}, {"messages": MESSAGES[:2]}])
    assert prompt_ids == _hf_ids(hf, MESSAGES[:4], tools=TOOLS, add_generation_prompt=True)
    assert prompt_ids2 == _hf_ids(hf, MESSAGES[:2], add_generation_prompt=True)
    # the SFT prompt of the last assistant turn is exactly the decode prompt of the same messages
    n = len(prompt_ids)
    assert list(ids[:n]) == prompt_ids and trained[n] and not trained[n - 1]
    # tojson neither escapes HTML nor non-ASCII; {% break %} found the last user turn
    assert "\\u" not in text and '"unit": "°C <&>"' in text and "<now> & later" in text
    assert text.count("[last query]") == 1 and "Zürich? <b>now</b> [last query]" in text
    assert text2.endswith("<|im_start|>assistant\n") and "# Tools" not in text2


@pytest.mark.parametrize("template, messages", [
    ("{{ messages | tojson(indent=2, sort_keys=True) }}|{{ messages | tojson(separators=(',', ':')) }}",
     [{"role": "user", "content": "<a href='x'>é & ü</a>"}]),
    ("{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{{ m.content }}|"
     "{% if m.content == 'c' %}{% break %}{% endif %}{% endfor %}",
     [{"role": "user", "content": c} for c in "abcd"]),
    ("{{ bos_token is defined }}/{{ eos_token }}/{{ pad_token }}/{{ unk_token is defined }}"
     "/{{ add_generation_prompt }}/{{ tools is none }}",
     [{"role": "user", "content": "x"}]),
    ("{% for m in messages %}{{ m.reasoning_content }}+{{ m.thinking }}+{{ m.content }}{% endfor %}",
     [{"role": "assistant", "content": "ok", "reasoning": "because"}]),
    ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
     "{{ ns.n }}{{ dict(a=1) | tojson }}",
     [{"role": "user", "content": "x"}] * 3),
])
def test_environment_renders_like_transformers(tmp_path, template, messages):
    folder = qwen_style_tokenizer(tmp_path / "tok")
    hf, ours = _hf(folder), tokenizer_lib.load_tokenizer(folder)
    want = hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                  add_generation_prompt=True)
    got = tokenizer_lib.render_chat(template, messages, add_generation_prompt=True,
                                    special=ours.special)
    assert got == want


def test_strftime_now_and_template_file_precedence(tmp_path):
    folder = qwen_style_tokenizer(tmp_path / "tok")
    got = tokenizer_lib.render_chat("{{ strftime_now('%Y-%m-%d') }}", [], add_generation_prompt=False)
    assert got == datetime.datetime.now().strftime("%Y-%m-%d")
    # chat_template.jinja takes precedence over tokenizer_config.json's template, as in transformers
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}]
    ours = tokenizer_lib.load_tokenizer(folder)
    assert ours.render_chat(msgs, add_generation_prompt=False) == "[user]hi"
    assert ours.template_source.endswith("chat_template.jinja")
    assert ours.encode_chat(msgs, add_generation_prompt=False) == _hf_ids(_hf(folder), msgs)


def test_template_errors_name_the_message(tmp_path, capsys):
    folder = qwen_style_tokenizer(tmp_path / "tok")  # no config.json, no weights: nothing loads
    bad = [{"role": "user", "content": "hi"}, {"role": "critic", "content": "meh"},
           {"role": "assistant", "content": "ok"}]
    code = cli.main(["--checkpoint", folder, "--prompts-file",
                     str(_write(tmp_path / "p.jsonl", [{"messages": MESSAGES[:2]}, {"messages": bad}]))])
    err = capsys.readouterr().err
    assert code == 2, err
    assert (f"p.jsonl:2: the chat template of {folder}/tokenizer_config.json fails to render from "
            f"message 1 (role 'critic') on: unknown role: critic") in err
    assert "config.json" not in err.replace("tokenizer_config.json", "")  # stopped before loading
    # the same line in training data: file:line and the same words, before anything compiles
    info = data_lib.load_tokenizer(folder)
    late_system = MESSAGES[1:3] + [MESSAGES[0], MESSAGES[4]]
    f = _write(tmp_path / "sft.jsonl", [{"messages": MESSAGES}, {"messages": bad},
                                        {"messages": late_system}])
    with pytest.raises(data_lib.DataError, match=r"sft\.jsonl:2: .*fails to render from message 1 "
                                                 r"\(role 'critic'\) on: unknown role: critic"):
        data_lib.load_documents([str(f)], info, vocab_size=151936)
    docs = data_lib.load_documents([str(f)], info, vocab_size=151936, skip_bad_lines=True)
    assert len(docs.tokens) == 1 and len(docs.skipped) == 2
    assert "message 2 (role 'system') on: a system message must come first" in docs.skipped[1]


def test_template_that_does_not_parse(tmp_path, capsys):
    folder = qwen_style_tokenizer(tmp_path / "tok", chat_template="{% for m in messages %}\n{{ m.content }")
    code = cli.main(["--checkpoint", folder, "--prompt", "hi", "--chat"])
    err = capsys.readouterr().err
    assert code == 2 and f"--prompt: the chat template of {folder}/tokenizer_config.json does not parse" in err
    assert "(template line 2)" in err
    info = data_lib.load_tokenizer(folder)
    with pytest.raises(ValueError, match="does not parse: unexpected '}'"):
        data_lib.tokenize_record({"messages": MESSAGES}, info)
    no_template = qwen_style_tokenizer(tmp_path / "none", chat_template=None)
    code = cli.main(["--checkpoint", no_template, "--prompt", "hi", "--chat"])
    assert code == 2 and "no chat template" in capsys.readouterr().err


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_sft_tool_turns_train_the_calls_only(tmp_path):
    """An SFT record in OpenAI's wire form (a call's arguments as JSON text, an id, the tool's
    answer by tool_call_id) renders as the same conversation with object arguments, and only
    the assistant turns, the call included, are targets: the tool's answer is not."""
    folder = qwen_style_tokenizer(tmp_path / "tok")
    info = data_lib.load_tokenizer(folder)
    wire = [dict(m) for m in MESSAGES]
    call = MESSAGES[2]["tool_calls"][0]
    wire[2] = {**MESSAGES[2], "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": call["function"]["name"],
        "arguments": json.dumps(call["function"]["arguments"], ensure_ascii=False)}}]}
    wire[3] = {**MESSAGES[3], "tool_call_id": "call_1"}
    ids, trained = data_lib.tokenize_record({"messages": wire, "tools": TOOLS}, info)
    ref, _ = data_lib.tokenize_record({"messages": MESSAGES, "tools": TOOLS}, info)
    assert list(ids) == list(ref)
    text = info.tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)
    targets = info.tokenizer.decode([int(t) for t, k in zip(ids, trained) if k],
                                    skip_special_tokens=False)
    assert '"name": "get_weather"' in targets and '"city": "Zürich"' in targets
    assert "21 °C & sunny." in targets
    assert '{"temp": 21}' in text and '{"temp": 21}' not in targets
    assert "Weather in Zürich?" not in targets
