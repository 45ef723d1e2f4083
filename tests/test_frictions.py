"""What a new user meets in the first hour, each a one-line answer: an output folder that cannot be
written (wedlm-convert, wedlm-train), a missing or broken tokenizer at conversion, the prompts of
a file told apart on stdout, --stream not printing the text twice on a terminal, the help and
install hints that name real flags and commands."""

import argparse
import os
import re
import shutil
import subprocess
import sys

import pytest

from decode import cli
from decode.serving import serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNWRITABLE = "/proc/wedlm-out"      # a file system where nothing can be created, even by root


def _run(*argv):
    r = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    return r.returncode, r.stderr.strip().splitlines()


def test_convert_names_an_unwritable_output_before_reading_weights(ckpt):
    code, err = _run("wedlm_jax.convert", "hf-to-orbax", "--hf", ckpt[0], "--out", UNWRITABLE)
    assert code == 2 and err == [f"wedlm-convert: error: --out {UNWRITABLE}: cannot write in "
                                 "/proc (No such file or directory)"], err


def test_convert_refuses_a_broken_tokenizer_and_notes_a_missing_one(ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ckpt[0], src)
    (src / "tokenizer.json").write_text("{not json")
    code, err = _run("wedlm_jax.convert", "hf-to-orbax", "--hf", str(src), "--out",
                     str(tmp_path / "o1"))
    assert code == 2 and len(err) == 1 and err[0].startswith(
        f"wedlm-convert: error: {src / 'tokenizer.json'}: not a tokenizer the tokenizers library "
        "reads"), err
    assert not (tmp_path / "o1").exists()
    os.remove(src / "tokenizer.json")
    code, err = _run("wedlm_jax.convert", "hf-to-orbax", "--hf", str(src), "--out",
                     str(tmp_path / "o2"), "--no-progress")
    assert code == 0 and err[-1] == (f"wrote {tmp_path / 'o2'} (note: {src} has no tokenizer.json, "
                                     "so neither has the converted folder; decoding needs one: "
                                     "copy it in)"), err


def test_train_names_an_unwritable_checkpoint_dir_before_the_model_loads():
    code, err = _run("train.main", "--config", "configs/tiny_cpu.yaml", f"checkpoint.dir={UNWRITABLE}")
    assert code == 2 and err == [f"wedlm-train: error: checkpoint.dir {UNWRITABLE}: cannot write "
                                 "in /proc (No such file or directory)"], err


def test_prompt_texts_are_told_apart_and_stream_is_not_repeated(monkeypatch, capsys):
    rows = [{"text": "one\n\ntwo"}, {"text": "three"}]
    cli.print_texts(rows, shown=False)
    assert capsys.readouterr().out == "=== [0] ===\none\n\ntwo\n=== [1] ===\nthree\n"
    cli.print_texts(rows[:1], shown=False)
    assert capsys.readouterr().out == "one\n\ntwo\n"          # one prompt: the text alone
    cli.print_texts(rows, shown=True)                         # --stream showed it on the screen
    assert capsys.readouterr().out == ""


def test_help_and_install_hints_name_real_things():
    from decode import cli
    text = " ".join(serve._parser().format_help().split())
    assert "--port PORT TCP port to listen on (default 8000)" in text
    for door in (serve._parser(), cli._parser()):      # each option says its default once
        for action in door._actions:
            if not action.help or action.help == argparse.SUPPRESS or action.dest == "help":
                continue
            shown = door._get_formatter()._get_help_string(action)     # as --help renders it
            said = len(re.findall(r"(?<!%)\(default", shown.lower()))
            assert said <= 1, (action.option_strings, shown)
            if action.default is not None and action.default is not False:
                assert said == 1, (action.option_strings, shown)
    for path, hint in (("decode/serving/serve.py", "'.[serve]' in the repository"),
                       ("decode/static/trace.py", "pip install -e '.[plot]'")):
        src = open(os.path.join(ROOT, path)).read()
        assert "wedlm-jax[" not in src and hint in src, path


@pytest.mark.parametrize("kernel", ["pallas", "cudnn"])
def test_a_gpu_kernel_on_cpu_is_one_line_naming_the_backends_here(ckpt, kernel):
    code, err = _run("decode.cli", "--checkpoint", ckpt[0], "--prompt", "hi", "--max-new-tokens", "2",
                     "--attention", kernel)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"wedlm-decode: error: attention='{kernel}' (")
    assert err[0].endswith("needs the GPU (CUDA) backend; this process runs on the 'cpu' backend, "
                           "where 'cache' attention can use: dense, tiled"), err
    assert "shared memory" not in err[0] and "smem" not in err[0]
