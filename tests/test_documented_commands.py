"""Every command the docs show (README.md, train/README.md, the `--help` texts) does what they say:
each is parsed by its own tool's parser with its options checked as the tool checks them before
anything loads (decoding options, training configs with their overrides), the pretokenizer is run
on a small file, the training dry run is compiled and must FIT as its comment says, and every
tool's --help answers. Placeholders (DIR, N, KEY, configs/NAME.yaml, the HF folders) stand for the
demo model and tiny files; `make demo` / `make test` are the demo pipeline's and the suite's own
tests. A command of a tool this test does not know fails it, so new docs are checked too."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest

from decode import cli as decode_cli
from decode.config import DoorOptions
from decode.serving import serve
from train import main as train_main
from train.data import pretokenize
from train.config import load_config
from wedlm_jax import convert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "train/README.md")
DEMO = os.path.join(ROOT, "demo", "model")
PLACEHOLDERS = {"DIR": DEMO, "N": "2", "i": "0", "KEY": "secret", "configs/NAME.yaml":
                "configs/tiny_cpu.yaml", "checkpoints/Qwen3-8B": DEMO}
TOOLS = {"wedlm-convert": "convert", "wedlm-decode": "decode", "wedlm-serve": "serve",
         "wedlm-train": "train", "train.main": "train", "train.data.pretokenize": "pretokenize"}
HELP_MODULES = ("wedlm_jax.convert", "decode.cli", "decode.serving.serve", "train.main",
                "train.data.pretokenize")


def _one_line(block: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in block.splitlines():
        cur += " " + line.strip()
        if cur.endswith("\\"):
            cur = cur[:-1]
            continue
        cur = re.sub(r"\s#\s.*$", "", cur).strip()
        if cur and not cur.startswith("#"):
            out.append(cur)
        cur = ""
    return out


def documented() -> list[tuple[str, str]]:
    """(where, command) of every command in the docs' bash blocks and the --help texts."""
    found = []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            found += [(doc, c) for c in _one_line(block)]
    for module in HELP_MODULES:
        text = help_text(module)
        found += [(f"{module} --help", c) for c in re.findall(r"`((?:wedlm|python)[^`]*)`", text)]
    return found


def help_text(module: str) -> str:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), (module, proc.stderr[-2000:])
    return proc.stdout


def argv_of(command: str) -> tuple[str | None, list[str]]:
    """(tool, its arguments) with optional groups' options kept, placeholder groups dropped and
    placeholders filled; the tool is None for `make` (covered by the demo pipeline's tests)."""
    command = re.sub(r"(?<=\s)\[((?:--|-)[^\[\]]*)\]", r"\1", command)     # [--flag value]
    command = re.sub(r"\s\[[^\[\]=]*=[^\[\]]*\.\.\.\]", "", command)       # [key=value ...]
    words = shlex.split(command)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):     # VAR=value before the command
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0].endswith(".sh"):                    # a launch script: it runs wedlm-train on CONFIG
        return "train", ["--config", launch_script(words[0], env, command), *words[1:]]
    if words[0] == "gcloud":                        # the command it runs on every worker
        words = shlex.split(words[words.index("--command") + 1].split("&&", 1)[1])
    if words[0] == "srun":
        words = words[1:]
    if words[0] == "make":
        return None, words[1:]
    if words[0] == "python":
        assert words[1] == "-m", command
        words = words[2:]
    tool = TOOLS.get(os.path.basename(words[0]))
    assert tool is not None, f"a documented command of an unknown tool: {command}"
    return tool, [PLACEHOLDERS.get(w, w) for w in words[1:]]


def launch_script(path: str, env: dict, command: str) -> str:
    """The config a documented launch script (train/launch/) is given, the script checked: in
    the repository, executable, valid bash, and reading the CONFIG the command sets."""
    script = os.path.join(ROOT, path)
    assert os.path.isfile(script) and os.access(script, os.X_OK), f"not an executable script: {command}"
    proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert proc.returncode == 0, (command, proc.stderr)
    assert "CONFIG" in env and "$CONFIG" in open(script).read(), command
    return env["CONFIG"]


def parsed(parser: argparse.ArgumentParser, argv: list[str], command: str):
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"the documented command does not parse: {command}")


def check(tool: str, argv: list[str], command: str, tmp_path) -> None:
    """The command's options as its tool checks them before it loads anything."""
    if tool == "convert":
        parsed(convert._parser(), argv, command)
    elif tool in ("decode", "serve"):
        parser = decode_cli._parser() if tool == "decode" else serve._parser()
        DoorOptions.from_args(parsed(parser, argv, command))
    elif tool == "train":
        try:
            args = train_main.parse_args(argv)
        except SystemExit:
            pytest.fail(f"the documented command does not parse: {command}")
        load_config(os.path.join(ROOT, args.config), args.overrides)
    else:
        run_pretokenize(argv, tmp_path)


def run_pretokenize(argv: list[str], tmp_path) -> None:
    """The documented pretokenize line, run on a small file into a temporary folder."""
    src = tmp_path / "part-0.jsonl"
    src.write_text("".join('{"text": "def f(x):\\n    return x + %d"}\n' % i for i in range(20)))
    argv = [str(src) if a in ("data/part-*.jsonl", "FILES...") else a for a in argv]
    out = tmp_path / f"packed-{len(os.listdir(tmp_path))}"
    argv[argv.index("--out") + 1] = str(out)
    argv[argv.index("--seq-len") + 1] = "32"
    assert pretokenize.main(argv) == 0
    assert os.listdir(out)


def test_every_documented_command_parses_and_its_options_hold(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    commands = documented()
    seen = set()
    for where, command in commands:
        tool, argv = argv_of(command)
        if tool is None:
            continue
        seen.add(tool)
        try:
            check(tool, argv, command, tmp_path)
        except Exception as e:  # noqa: BLE001 - reported with the command and where it is shown
            pytest.fail(f"{where}: {command}\n  -> {type(e).__name__}: {e}")
    assert seen == set(TOOLS.values()), seen
    assert len(commands) >= 20


def dry_runs() -> list[str]:
    """The training dry runs the docs show (their optional options left out), each once."""
    out = []
    for _, command in documented():
        bare = re.sub(r"\s\[[^\[\]]*\]", "", command)
        tool, argv = argv_of(bare)
        if tool == "train" and "--dry-run" in argv and bare not in out:
            out.append(bare)
    return out


def test_the_documented_training_dry_run_fits_as_its_comment_says():
    """The README's and train/README.md's training dry run (the 8B config, ~75 s of compile on 2
    cores): exit 0 and FITS in the 80 GiB it names."""
    runs = dry_runs()
    assert len(runs) == 1, runs
    _, argv = argv_of(runs[0])
    proc = subprocess.run([sys.executable, "-m", "train.main", *argv], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "verdict      FITS" in proc.stdout and "--device-memory 80 GiB" in proc.stdout


def launch_lines() -> list[tuple[dict, list[str]]]:
    """(environment, words) of every documented launch-script command (train/launch/*.sh)."""
    out = []
    for _, command in documented():
        words = shlex.split(command)
        env = {}
        while words and "=" in words[0] and not words[0].startswith("-"):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        if words and words[0].endswith(".sh"):
            out.append((env, words))
    return out


def test_the_documented_launch_lines_run_their_dry_run_then_submit(tmp_path):
    """The Slurm and XPK lines run as written, sbatch and xpk replaced by echo and wedlm-train by
    a recorder: each runs the dry run first (its arguments parse and its config loads with the
    overrides, as wedlm-train checks them), then submits with the same overrides."""
    lines = launch_lines()
    assert {os.path.basename(w[0]) for _, w in lines} >= {"submit_slurm.sh", "xpk.sh"}, lines
    recorder = tmp_path / "wedlm-train"
    recorder.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/args\n')
    recorder.chmod(0o755)
    for env, words in lines:
        proc = subprocess.run(["bash", *words], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env=dict(os.environ, **env, WEDLM_TRAIN=str(recorder),
                                                   SBATCH="echo sbatch", XPK="echo xpk"))
        assert proc.returncode == 0, (words, proc.stderr)
        argv = (tmp_path / "args").read_text().splitlines()
        args = train_main.parse_args(argv)
        assert args.dry_run and args.device_memory == float(env.get("DEVICE_MEMORY", 0)), argv
        load_config(os.path.join(ROOT, args.config), args.overrides)
        submitted = proc.stdout.strip()
        assert submitted.startswith(("sbatch ", "xpk workload create")), submitted
        assert all(o in submitted for o in words[1:]), (words, submitted)


def test_readme_python_examples_run():
    """README's Python section as written (DIR: the demo model, float32 on this CPU): the count
    ends at its target under its constraint, and the Batcher example finishes its request."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text[text.index("### Python"):text.index("### Released checkpoints")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    code = "\n".join(blocks).replace('"DIR"', repr(DEMO)).replace('"bfloat16"', '"float32"')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    first = out.stdout.splitlines()[0]
    assert first.split(" ")[-2] == "1560/1560", first
    assert "1563/1560" not in out.stdout
