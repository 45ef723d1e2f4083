"""The demo data builder on a small self-made code folder, and the demo configs."""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest

from demo import data as dd
from demo import tasks
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
    stats = dd.build(str(out), stdlib=str(root), vocab_size=500, heldout_percent=20, train_mb=0.4,
                     eval_sizes=dict(counting=12, arith=12, lists=6, records=4, code=5),
                     log=lambda *a: None)
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
    assert 0 < stats["train"]["code"]["documents"] < 40 - len(held)   # only the code share is used
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
    assert stats["settings"]["recipe"] == tasks.RECIPE == 2       # names composed from syllables


def test_tokenizer(built):
    from tokenizers import Tokenizer
    from train.data.pipeline import find_mask_token, load_tokenizer
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
    assert [kinds.count(k) for k in dd.EVAL_KINDS] == [12, 12, 6, 4, 5]
    train_docs = [d["text"] for d in _read(out / "train.jsonl")]
    train_text = "\n".join(train_docs)
    held_code = "\n".join(d["text"] for d in _read(out / "heldout.jsonl") if d["kind"] == "code")
    for e in items:
        if e["kind"] == "counting":  # the prompt and its exact continuation are the whole count
            assert e["prompt"] + e["target"] == tasks.counting_doc(random.Random(e["seed"]))
            header, body = e["prompt"].split(":\n", 1)
            assert not any(d.startswith(header + ":\n") for d in train_docs)    # fresh numbers
            nums = [int(x.split("/")[0]) for x in re.split(r", |\n", body + e["target"])]
            k = int(m.group(1)) if (m := re.search(r" by (\d+) ", header)) else 1
            step = -k if "down" in header else k
            assert nums == list(range(nums[0], nums[0] + step * len(nums), step))
            assert header.endswith(f"from {nums[0]} to {nums[-1]}") or \
                header.endswith(f"from {nums[0]} to {nums[-1]}, one per line")
        elif e["kind"] == "arith":
            a, op, b = re.match(r"Q: (\d+) ([-+]) (\d+)\n", e["prompt"]).groups()
            assert int(e["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
            assert e["target"].rstrip("\n").endswith(f"{a} {op} {b} = {e['answer']}")
            assert len(a) >= 2 and len(b) >= 2
            assert e["prompt"] not in train_text  # held-out problems are not trained on
        elif e["kind"] == "lists":
            op, xs = re.match(r"(copy|sort) (\[.*\]) ->$", e["prompt"]).groups()
            xs = json.loads(xs)
            assert json.loads(e["answer"]) == (sorted(xs) if op == "sort" else xs)
            assert e["prompt"] not in train_text
        elif e["kind"] == "records":
            rows = [r.split(" | ") for r in e["prompt"].split("\n")[1:-2]]
            got = [json.loads(line) for line in e["answer"].split("\n")]
            assert [[str(v) for v in g.values()] for g in got] == rows[1:]
            assert all(list(g) == rows[0] for g in got)
        else:
            assert e["prompt"].lstrip().startswith("def ") and (e["prompt"] + e["target"]) in held_code


def _check_work(q: str, work: str, ans: str):
    """Every line of the worked steps checked on its own: its operands are what the line above left
    (the last digit taken off), its column sum / difference, carry or borrow and result so far are
    right, and the last line is the answer."""
    a, op, b = re.match(r"Q: (\d+) ([-+]) (\d+)", q).groups()
    lines = work.strip().split("\n")
    ra, rb, c, so_far = a, b, 0, ""
    for line in lines[:-1]:
        if op == "+":
            m = re.fullmatch(r"(\d+)\+(\d+) c(\d): (\d)\+(\d)\+(\d)=(\d+) -> (\d+)", line)
            xa, xb, cin, x, y, cc, s, sf = m.groups()
            assert (xa, xb) == (ra or "0", rb or "0") and int(cin) == int(cc) == c
            assert (int(x), int(y)) == (int(ra[-1]) if ra else 0, int(rb[-1]) if rb else 0)
            assert int(s) == int(x) + int(y) + c
            c, so_far = int(s) // 10, str(int(s) % 10) + so_far
        else:
            m = re.fullmatch(r"(\d+)-(\d+) b(\d): (\d)-(\d)-(\d)=(\d) b(\d) -> (\d+)", line)
            xa, xb, bin_, x, y, bb, d, bout, sf = m.groups()
            assert (xa, xb) == (ra, rb or "0") and int(bin_) == int(bb) == c
            assert (int(x), int(y)) == (int(ra[-1]), int(rb[-1]) if rb else 0)
            raw = int(x) - int(y) - c
            assert (int(d), int(bout)) == (raw % 10, int(raw < 0))
            c, so_far = int(bout), d + so_far
        assert sf == so_far
        ra, rb = ra[:-1], rb[:-1]
    assert not ra and not rb and c == 0
    assert int(so_far) == int(ans) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert lines[-1] == f"{a} {op} {b} = {ans}"


def test_worked_arithmetic_is_right():
    ops = set()
    for seed in range(2000):
        q, work, ans = tasks.arith_problem(random.Random(seed))
        _check_work(q, work, ans)
        ops.add(q.split()[2])
    assert ops == {"+", "-"}
    for a, b in ((999, 1), (1000, 1), (5, 5), (9999, 9999), (10, 0)):
        for op, work in (("+", tasks.add_work(a, b)), ("-", tasks.sub_work(a, b))):
            ans = str(a + b if op == "+" else a - b)
            _check_work(f"Q: {a} {op} {b}", "\n".join(work) + f"\n{a} {op} {b} = {ans}", ans)


def test_counts_carry_their_end_value_so_the_stop_is_an_equality():
    """Every item of a count is "x/b" with b the header's end value; the count ends at "b/b" and
    no earlier item has x == b; the numbers step by the header's stride."""
    import re
    for seed in range(500):
        header, items, sep = tasks.counting_parts(random.Random(seed))
        m = re.fullmatch(r"Count (by (\d+) |down by (\d+) |)from (\d+) to (\d+)(, one per line)?:\n", header)
        assert m, header
        a, b = int(m.group(4)), int(m.group(5))
        step = int(m.group(2) or 0) or -int(m.group(3) or 0) or 1
        xs = [tuple(map(int, it.split("/"))) for it in items]
        assert all(end == b for _, end in xs) and xs[0][0] == a and xs[-1][0] == b
        assert all(x != b for x, _ in xs[:-1]) and len(xs) >= 6
        assert all(y - x == step for (x, _), (y, _) in zip(xs, xs[1:]))
        assert sep == ("\n" if m.group(6) else ", ")


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
    with pytest.raises(dd.DemoDataError, match="every share is 0"):
        dd.parse_mix("counting=0,code=0")
    with pytest.raises(dd.DemoDataError, match="share of arith must be >= 0"):
        dd.parse_mix("arith=-1")
    assert dd.parse_mix("code=1,arith=3") == {"counting": 0.0, "arith": 0.75, "lists": 0.0,
                                              "records": 0.0, "code": 0.25}
    with pytest.raises(dd.DemoDataError, match="unknown data recipe 3"):
        dd.build(str(tmp_path / "o5"), stdlib=str(root), recipe=3)
    with pytest.raises(dd.DemoDataError, match="--train-mb must be > 0"):
        dd.build(str(tmp_path / "o4"), stdlib=str(root), train_mb=0)
    # the CLI: the error names the folder, exit code 2, nothing written
    assert dd.main(["--out", str(tmp_path / "o3"), "--stdlib", str(empty)]) == 2
    assert not (tmp_path / "o3").exists()


def test_force_replaces(tmp_path, built):
    root, _, _ = built
    out = tmp_path / "demo"
    os.makedirs(out)
    (out / "old.txt").write_text("old")
    stats = dd.build(str(out), stdlib=str(root), force=True, vocab_size=400, train_mb=0.1,
                     mix=dd.parse_mix("code=1,counting=0.5"),
                     eval_sizes=dict(counting=2, arith=0, lists=0, records=0, code=1),
                     log=lambda *a: None)
    assert not (out / "old.txt").exists() and (out / "tokenizer" / "tokenizer.json").exists()
    assert stats["train"]["arith"]["documents"] == 0 and stats["train"]["counting"]["documents"] > 0
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_demo_configs(built, tmp_path):
    from train.main import prepare
    from train.data.pretokenize import pretokenize
    root, out, stats = built
    pre = load_config("configs/demo_pretrain.yaml")
    ada = load_config("configs/demo_adapt.yaml")
    assert pre.objective.kind == "ar_only" and ada.objective.kind == "dual_stream"
    assert ada.objective.ar_weight == 1.0 and 16 <= ada.objective.block_size <= 32
    assert ada.model.from_hf == pre.checkpoint.export_hf + "_roundtrip"
    assert ada.optimizer.lr < pre.optimizer.lr
    assert pre.data.seq_len == ada.data.seq_len == 512 and pre.data.packed_dir == ada.data.packed_dir
    assert pre.compute_dtype == ada.compute_dtype == "bf16"
    assert pre.time_limit_s and ada.time_limit_s       # a slower card still ends, saved
    mc = model_config(pre)
    assert 10e6 <= mc.num_params() <= 40e6 and mc.tie_word_embeddings
    assert 2 * mc.num_params() <= 50e6                 # the shipped bf16 folder
    assert (mc.model_type, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.qk_norm) == ("qwen3", 6, 2, 64, True)
    import inspect
    assert mc.vocab_size == inspect.signature(dd.build).parameters["vocab_size"].default == 512
    # the pretraining config reads the built data, packed (tokenizer, rows) before any compile
    packed = tmp_path / "packed"
    pretokenize([str(out / "train.jsonl")], str(out / "tokenizer"), str(packed), pre.data.seq_len,
                workers=2)
    small = load_config("configs/demo_pretrain.yaml", [f"data.packed_dir={packed}",
                                                       f"data.tokenizer={out}/tokenizer"])
    prep = prepare(small)
    assert prep["mask_token_id"] is None and prep["rows"]["tokens"][0].shape == (pre.data.seq_len,)
    assert int(np.max(prep["rows"]["tokens"][0])) < stats["vocab_size"]


def test_workers_split_the_same_documents(tmp_path):
    """demo.data --workers N: each worker draws its own seeds; the kinds' shares and the held-out
    exclusions hold whatever N; one worker gives seeds 0, 1, 2, ... as before."""
    a = [dd.generated_doc("arith", i) for i in range(6)]
    assert dd.generate_share("arith", sum(map(len, a[:5])) + 1, 0, 1, frozenset(), frozenset()) == a
    two = dd.generate_share("arith", 2000, 1, 2, frozenset(), frozenset())
    assert two[:3] == [dd.generated_doc("arith", s) for s in (1, 3, 5)]
    header = dd.generated_doc("counting", 3).split("\n", 1)[0]
    assert dd.generated_doc("counting", 3, skip_headers={header}) == ""
