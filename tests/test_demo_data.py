"""The demo data builder (issue 5 item 1) on a small self-made code folder, and the demo configs."""

from __future__ import annotations

import json
import os
import random
import re

import pytest

from demo import data as dd
from train.config import load_config, model_config

CODE = '''"""Module {i}."""


def function_{i}(a, b):
    """Add things."""
    total = a + b
    for k in range({i}):
        total += k
    if total > 10:
        total -= 1
    result = [total] * 2
    return result[0] + {i}


class Thing{i}:
    def method(self, x):
        y = x * 2
        z = y + 1
        w = z - 3
        v = w * w
        u = v + {i}
        return u
'''


def _corpus(root):
    os.makedirs(root / "pkg", exist_ok=True)
    for i in range(40):
        (root / ("pkg" if i % 2 else ".") / f"mod_{i}.py").write_text(CODE.format(i=i) * 10)
    for skipped in ("test", "tests", "site-packages", "idlelib", "turtledemo"):
        os.makedirs(root / skipped)
        (root / skipped / "skipped_file.py").write_text("SKIPPED_MARKER = 1\n")
    (root / "latin1.py").write_bytes(b"NOT_UTF8 = '\xe9\xff'\n")
    (root / "notes.txt").write_text("TXT_MARKER\n")
    return root


def _read(path):
    return [json.loads(l) for l in open(path, encoding="utf-8")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = _corpus(tmp_path_factory.mktemp("stdlib"))
    out = tmp_path_factory.mktemp("out") / "demo"
    stats = dd.build(str(out), stdlib=str(root), vocab_size=600, heldout_percent=20, eval_count=12,
                     eval_arith=12, eval_sort=6, eval_code=5, log=lambda *a: None)
    return root, out, stats


def test_files_split_and_skips(built):
    root, out, stats = built
    files = dd.list_code_files(str(root))
    names = {os.path.basename(r) for r, _ in files}
    assert len(files) == 40 and "skipped_file.py" not in names and "latin1.py" not in names
    held = [r for r, _ in files if dd.heldout_file(r, 20)]
    assert 0 < len(held) < 40
    assert held == [r for r, _ in dd.list_code_files(str(root)) if dd.heldout_file(r, 20)]  # deterministic
    train_text = "\n".join(d["text"] for d in _read(out / "train.jsonl"))
    held_docs = _read(out / "heldout.jsonl")
    for marker in ("SKIPPED_MARKER", "NOT_UTF8", "TXT_MARKER"):
        assert marker not in train_text
    for r in held:  # a held-out file's unique function name never appears in training
        i = int(re.search(r"mod_(\d+)", r).group(1))
        assert f"def function_{i}(" not in train_text
        assert any(f"def function_{i}(" in d["text"] for d in held_docs if d["kind"] == "code")
    assert stats["train"]["code"]["documents"] == 40 - len(held)
    assert stats["heldout"]["code"]["documents"] == len(held)
    for kind in dd.GENERATED:
        assert stats["train"][kind]["documents"] > 0


def test_mix_and_sizes(built):
    root, out, stats = built
    tr = stats["train"]
    total_mb = sum(s["mb"] for s in tr.values())
    for kind, share in dd.DEFAULT_MIX.items():  # shares of the training text within a small tolerance
        assert abs(tr[kind]["mb"] / total_mb - share) < 0.02, (kind, tr[kind]["mb"] / total_mb)
    assert len(_read(out / "train.jsonl")) == sum(s["documents"] for s in tr.values())
    assert all(set(d) == {"text"} for d in _read(out / "train.jsonl"))
    assert json.load(open(out / "stats.json"))["train"] == tr


def test_tokenizer(built):
    from tokenizers import Tokenizer
    from train.data import find_mask_token, load_tokenizer
    root, out, stats = built
    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    assert stats["special_tokens"] == {"<|endoftext|>": 0, "<|pad|>": 1, "<|mask|>": 2}
    assert tok.get_vocab_size() == stats["vocab_size"] <= 600
    text = "Count from 12 to 15:\n12, 13\tdéjà vu ✓ def f(x):\n    return x"
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids) == text  # byte level: any text round-trips
    assert [tok.decode([i]) for i in tok.encode("90817", add_special_tokens=False).ids] == list("90817")
    assert tok.encode("<|mask|>", add_special_tokens=False).ids == [2]
    info = load_tokenizer(str(out / "tokenizer"))  # what the training program reads
    assert find_mask_token(info) == 2 and info.eos_token_id == 0
    cfg = json.load(open(out / "tokenizer" / "tokenizer_config.json"))
    assert (cfg["eos_token"], cfg["pad_token"], cfg["mask_token"]) == ("<|endoftext|>", "<|pad|>", "<|mask|>")


def test_eval_set(built):
    root, out, stats = built
    items = _read(out / "eval.jsonl")
    kinds = [e["kind"] for e in items]
    assert (kinds.count("counting"), kinds.count("arith"), kinds.count("sort"), kinds.count("code")) == (12, 12, 6, 5)
    train_text = "\n".join(d["text"] for d in _read(out / "train.jsonl"))
    held_code = "\n".join(d["text"] for d in _read(out / "heldout.jsonl") if d["kind"] == "code")
    for e in items:
        if e["kind"] == "counting":  # the prompt and its exact continuation are the whole count
            assert e["prompt"] + e["target"] == dd.counting_doc(e["seed"])
            nums = re.split(r", |\n| ", e["prompt"].split(":\n", 1)[1] + e["target"])
            assert len(nums) >= 10
        elif e["kind"] == "arith":
            a, op, b = re.match(r"Q: (\d+) ([-+*]) (\d+)\n", e["prompt"]).groups()
            assert int(e["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert e["target"].rstrip("\n").endswith(f"{a} {op} {b} = {e['answer']}")
            assert e["prompt"] not in train_text  # held-out seeds are not trained on
        elif e["kind"] == "sort":
            xs = json.loads(re.match(r"sort (\[.*\]) -> ", e["prompt"]).group(1))
            assert json.loads(e["answer"]) == sorted(xs)
            assert e["prompt"] not in train_text
        else:
            assert e["prompt"].lstrip().startswith("def ") and (e["prompt"] + e["target"]) in held_code


def test_worked_arithmetic_is_right():
    for seed in range(300):
        rng = random.Random(seed)
        q, work, ans = dd.arith_problem(rng)
        a, op, b = re.match(r"Q: (\d+) ([-+*]) (\d+)", q).groups()
        a, b = int(a), int(b)
        lines = work.strip().split("\n")
        if op == "+":
            digits = [int(re.search(r"write (\d)", l).group(1)) for l in lines if "write" in l and "carry" in l and "write carry" not in l]
            carry = [int(l.split()[-1]) for l in lines if l.startswith("write carry")]
            assert int("".join(map(str, (carry + digits[::-1])))) == a + b
        elif op == "-":
            digits = [int(re.search(r"= (\d+)", l).group(1)) for l in lines[:-1]]
            assert int("".join(map(str, digits[::-1]))) == a - b
        else:
            parts = [int(l.split(" = ")[1]) for l in lines[:-1] if " * " in l]
            assert sum(parts) == a * b
        assert lines[-1] == f"{a} {op} {b} = {ans}"
    assert dd.number_words(0) == "zero" and dd.number_words(42) == "forty-two"
    assert dd.number_words(1305) == "one thousand three hundred five"


def test_bad_inputs(tmp_path, built):
    empty = tmp_path / "empty"
    os.makedirs(empty / "test")
    (empty / "test" / "t.py").write_text("x = 1\n")
    with pytest.raises(dd.DemoDataError, match=f"code corpus is empty.*{re.escape(str(empty))}"):
        dd.build(str(tmp_path / "o1"), stdlib=str(empty))
    assert not (tmp_path / "o1").exists()
    with pytest.raises(dd.DemoDataError, match="does not exist"):
        dd.build(str(tmp_path / "o2"), stdlib=str(tmp_path / "nowhere"))
    root, out, _ = built
    before = (out / "train.jsonl").read_bytes()
    with pytest.raises(dd.DemoDataError, match="already exists; pass --force"):
        dd.build(str(out), stdlib=str(root))
    assert (out / "train.jsonl").read_bytes() == before
    with pytest.raises(dd.DemoDataError, match="unknown kind 'poetry'"):
        dd.parse_mix("code=0.5,poetry=0.5")
    with pytest.raises(dd.DemoDataError, match="code share must be > 0"):
        dd.parse_mix("counting=1")
    assert dd.parse_mix("code=1,arith=0.5") == {"code": 1.0, "counting": 0.0, "patterns": 0.0,
                                                "arith": 0.5, "sort": 0.0}
    # the CLI: the error names the folder, exit code 2, nothing written
    assert dd.main(["--out", str(tmp_path / "o3"), "--stdlib", str(empty)]) == 2
    assert not (tmp_path / "o3").exists()


def test_force_replaces(tmp_path, built):
    root, _, _ = built
    out = tmp_path / "demo"
    os.makedirs(out)
    (out / "old.txt").write_text("old")
    stats = dd.build(str(out), stdlib=str(root), force=True, vocab_size=400, mix=dd.parse_mix("code=1,counting=0.5"),
                     eval_count=2, eval_arith=0, eval_sort=0, eval_code=1, log=lambda *a: None)
    assert not (out / "old.txt").exists() and (out / "tokenizer" / "tokenizer.json").exists()
    assert stats["train"]["arith"]["documents"] == 0 and stats["train"]["counting"]["documents"] > 0
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_demo_configs(built):
    from train.main import prepare
    root, out, stats = built
    pre = load_config("configs/demo_pretrain.yaml")
    ada = load_config("configs/demo_adapt.yaml")
    assert pre.objective.kind == "ar_only" and ada.objective.kind == "dual_stream"
    assert ada.objective.ar_weight == 1.0 and 16 <= ada.objective.block_size <= 32
    assert ada.model.from_hf == pre.checkpoint.export_hf
    assert ada.optimizer.lr < pre.optimizer.lr and ada.steps < pre.steps
    assert 256 <= pre.data.seq_len <= 512
    mc = model_config(pre)
    assert 2e6 <= mc.num_params() <= 10e6 and mc.tie_word_embeddings
    assert (mc.model_type, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.qk_norm) == ("qwen3", 4, 2, 64, True)
    import inspect
    assert mc.vocab_size == inspect.signature(dd.build).parameters["vocab_size"].default == 6144
    assert pre.data.tokenizer == "data/demo/tokenizer" and pre.data.train_files == ("data/demo/train.jsonl",)
    # the pretraining config reads the built data (tokenizer, documents, packing) before any compile
    small = load_config("configs/demo_pretrain.yaml", [f"data.train_files=[{out}/train.jsonl]",
                                                       f"data.tokenizer={out}/tokenizer"])
    prep = prepare(small)
    assert prep["mask_token_id"] is None and prep["rows"]["tokens"].shape[1] == pre.data.seq_len
    assert prep["rows"]["tokens"].max() < stats["vocab_size"]
