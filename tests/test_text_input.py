"""Any text at the command-line doors: invalid Unicode (a lone surrogate from a JSON escape or a
non-UTF-8 byte in argv) or a non-UTF-8 line in a prompt file is refused with the door's one-line
error naming where it is (the flag, FILE:LINE, the field), exit 2, before anything loads; a fuzz
over random bytes and escapes at every place text enters asserts exactly that."""

import json
import os
import random
import subprocess
import sys

import pytest

from decode import cli
from wedlm_jax.tokenizer import TextError, check_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(capsys, *argv):
    code = cli.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_check_text_names_the_character():
    assert check_text("déjà vu ✓") == "déjà vu ✓"
    with pytest.raises(TextError, match=r"'\\ud800' at character 3 is a lone surrogate"):
        check_text("ab\ud800c")
    with pytest.raises(TextError, match="must be a string, got bytes"):
        check_text(b"ab")


def test_a_non_utf8_byte_in_argv_is_one_line(ckpt):
    r = subprocess.run([sys.executable.encode(), b"-m", b"decode.cli", b"--checkpoint",
                        ckpt[0].encode(), b"--prompt", b"caf\xe9 au lait", b"--max-new-tokens", b"4"],
                       cwd=ROOT, capture_output=True, timeout=300)
    err = r.stderr.decode("utf-8", "replace").strip().splitlines()
    assert r.returncode == 2, err
    assert err[-1] == ("wedlm-decode: error: --prompt: text is not valid Unicode: '\\udce9' at "
                       "character 4 is a lone surrogate (an invalid escape or byte)")


def test_prompt_files_name_the_line(ckpt, tmp_path, capsys):
    bad_byte = tmp_path / "bytes.txt"
    bad_byte.write_bytes(b'"fine"\n"caf\xe9"\n')
    code, err = _cli(capsys, "--checkpoint", ckpt[0], "--prompts-file", str(bad_byte))
    assert code == 2 and err == [f"wedlm-decode: error: {bad_byte}:2: not UTF-8 (invalid "
                                 "continuation byte at byte 5 of the line)"], err
    escape = tmp_path / "escape.jsonl"
    escape.write_text('{"prompt": "one two"}\n{"prompt": "x\\ud800y"}\n')
    code, err = _cli(capsys, "--checkpoint", ckpt[0], "--prompts-file", str(escape))
    assert code == 2 and len(err) == 1 and err[0].startswith(
        f"wedlm-decode: error: {escape}:2: text is not valid Unicode"), err
    code, err = _cli(capsys, "--checkpoint", ckpt[0], "--prompt", "one", "--stop", "\udc80")
    assert code == 2 and len(err) == 1 and err[0].startswith(
        "wedlm-decode: error: --stop: stop string '\\udc80': text is not valid Unicode"), err


def test_the_batch_job_names_the_line_and_field(ckpt, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    lines = [{"id": "a", "prompt": "one two"}, {"id": "b", "messages": [
        {"role": "user", "content": "hi \ud83d"}]}]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    code, err = _cli(capsys, "--checkpoint", ckpt[0], "--input", str(src), "--output",
                     str(tmp_path / "out.jsonl"))
    assert code == 2 and len(err) == 1 and err[0].startswith(f"wedlm-decode: error: {src}:2: field"), err
    assert "not valid Unicode" in err[0] or "chat template" in err[0], err
    src.write_text(json.dumps({"id": "c", "prompt": "a", "stop": ["\udfff"]}) + "\n")
    code, err = _cli(capsys, "--checkpoint", ckpt[0], "--input", str(src), "--output",
                     str(tmp_path / "out2.jsonl"))
    assert code == 2 and len(err) == 1 and f"{src}:1: field 'stop'" in err[0], err
    assert not (tmp_path / "out2.jsonl").exists() or not (tmp_path / "out2.jsonl").read_text()


def test_fuzz_every_text_door_refuses_with_one_line(ckpt, tmp_path, capsys):
    """Random bytes and escapes as --prompt, a prompt-file line, a batch-job prompt and a stop
    string: each run either decodes (exit 0) or fails with one line naming where (exit 2), never
    a traceback."""
    rng = random.Random(0)
    pieces = ["\ud800", "\udfff", "\udce9", "\x00", "é", "✓", "\n", "\\", '"', "\U0001f600", "ab"]
    for i in range(12):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))
        bad = any(0xD800 <= ord(c) <= 0xDFFF for c in text)
        f = tmp_path / f"p{i}.jsonl"
        f.write_text(json.dumps({"prompt": text}) + "\n")
        inp = tmp_path / f"i{i}.jsonl"
        inp.write_text(json.dumps({"id": "x", "prompt": "one", "stop": [text]}) + "\n")
        for argv, where in ((["--prompt", text], "--prompt"),
                            (["--prompts-file", str(f)], f"{f}:1"),
                            (["--input", str(inp), "--output", str(tmp_path / f"o{i}.jsonl")],
                             f"{inp}:1")):
            code, err = _cli(capsys, "--checkpoint", ckpt[0], "--max-new-tokens", "2", *argv)
            if bad:
                assert code == 2 and len(err) == 1, (text, argv, err)
                assert err[0].startswith(f"wedlm-decode: error: {where}"), (text, err)
            else:
                assert code in (0, 2), (text, argv, err)
                assert code == 0 or (len(err) == 1 and err[0].startswith("wedlm-decode: error:")), err
