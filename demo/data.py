"""Data for the demo model (issue 5 item 1), made here from real text; nothing is downloaded.

    python -m demo.data --out data/demo [--force] [--vocab-size 6144] [--code-mb 2]

Sources
  code      the Python standard library of the running interpreter (`sysconfig` "stdlib"), without
            site-packages, test/tests folders, idlelib, turtledemo and files that are not UTF-8;
            split by file: sha256 of the relative path, `--heldout-percent` of the files held out.
  counting  counting in several formats ("1, 2, 3", one per line, "1 2 3", words, steps, backwards).
  patterns  repeated patterns (a short word or letter group repeated, the alphabet, cycles).
  arith     multi-digit addition / subtraction / multiplication with worked steps and a final
            "a op b = answer" line.
  sort      "sort [5, 2, 9] -> [2, 5, 9]".
  The generated kinds draw document i from seed i (train) or HELDOUT_SEED + i (held out); any
  held-out problem that the training generator happens to draw is skipped.

Mixing: `--mix code=0.7,counting=0.1,...` are shares of the training characters; the code share is
fixed by the stdlib (or `--code-mb`), the generated kinds are drawn until they reach theirs.

Output folder (refused when it exists, unless `--force`):
  train.jsonl      {"text": ...} training documents, shuffled
  heldout.jsonl    {"text": ..., "kind": ...} held-out documents (held-out files, held-out seeds)
  eval.jsonl       {"kind", "prompt", "target", "answer"?}: counting prompts with their exact
                   continuation, arithmetic and sorting problems with answers, code prompts
                   (function header + first lines of held-out stdlib functions) with the true next lines
  tokenizer/       tokenizer.json (byte-level BPE, digits split) + tokenizer_config.json:
                   eos <|endoftext|>, pad <|pad|>, mask <|mask|> (special tokens)
  stats.json       sizes (MB, documents, tokens) per split and kind, settings, build time
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import shutil
import sys
import sysconfig
import time

EOS, PAD, MASK = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = [EOS, PAD, MASK]
HELDOUT_SEED = 1_000_000_000
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo",
             "__pycache__"}
DEFAULT_MIX = {"code": 0.70, "counting": 0.12, "patterns": 0.03, "arith": 0.10, "sort": 0.05}
GENERATED = ("counting", "patterns", "arith", "sort")


class DemoDataError(ValueError):
    """Input the data builder cannot use (empty corpus, bad option, existing output)."""


# ----------------------------------------------------------------------------------- stdlib code

def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def heldout_file(relpath: str, percent: float) -> bool:
    """Deterministic split by file: the first 8 hex digits of sha256(relative path) as a fraction."""
    h = int(hashlib.sha256(relpath.replace(os.sep, "/").encode()).hexdigest()[:8], 16)
    return h / 0x100000000 < percent / 100.0


def list_code_files(root: str) -> list[tuple[str, str]]:
    """[(relative path, text)] of the UTF-8 `.py` files under root, sorted by path, without the
    skipped folders. Raises DemoDataError when there are none."""
    if not os.path.isdir(root):
        raise DemoDataError(f"code corpus folder {root} does not exist")
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("config-"))
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            try:
                with open(path, "rb") as fh:
                    text = fh.read().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                out.append((os.path.relpath(path, root), text))
    if not out:
        raise DemoDataError(f"the code corpus is empty: no non-empty UTF-8 .py files under {root} "
                            f"(skipping {', '.join(sorted(SKIP_DIRS))})")
    out.sort()
    return out


def code_prompts(files: list[tuple[str, str]], n: int, seed: int, head_lines: int = 2,
                 target_lines: int = 6) -> list[dict]:
    """Code continuation prompts from (held-out) files: a function's header and its first
    `head_lines` body lines; the target is the next `target_lines` lines of the function."""
    cands = []
    for rel, text in files:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
                continue
            body_start = node.body[0].lineno - 1
            end = node.end_lineno
            if end - body_start < head_lines + target_lines:
                continue
            start = node.lineno - 1
            prompt = "".join(lines[start:body_start + head_lines])
            target = "".join(lines[body_start + head_lines:body_start + head_lines + target_lines])
            if prompt.strip() and target.strip():
                cands.append({"kind": "code", "prompt": prompt, "target": target,
                              "source": f"{rel}:{node.lineno}"})
    random.Random(seed).shuffle(cands)
    return cands[:n]


# ----------------------------------------------------------------------------------- generated text

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen " \
       "fifteen sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """English words for 0 <= n < 1,000,000."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    if n < 1000:
        return ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + number_words(n % 100))
    return number_words(n // 1000) + " thousand" + ("" if n % 1000 == 0 else " " + number_words(n % 1000))


COUNT_FORMATS = ("comma", "lines", "spaces", "words", "step", "down")


def counting_parts(rng: random.Random) -> tuple[str, list[str], str]:
    """(header, items, separator): the document is header + sep.join(items)."""
    fmt = rng.choice(COUNT_FORMATS)
    length = rng.randint(20, 120)
    start = 1 if rng.random() < 0.4 else rng.randint(1, 2000)
    if fmt == "step":
        k = rng.randint(2, 12)
        nums = [start + k * i for i in range(length)]
        return f"Count by {k} from {nums[0]} to {nums[-1]}:\n", [str(x) for x in nums], ", "
    if fmt == "down":
        top = rng.randint(length, length + 2000)
        nums = list(range(top, top - length, -1))
        return f"Count down from {nums[0]} to {nums[-1]}:\n", [str(x) for x in nums], ", "
    nums = list(range(start, start + length))
    if fmt == "words":
        start = rng.randint(1, 900)
        nums = list(range(start, start + min(length, 60)))
        return (f"Count in words from {number_words(nums[0])} to {number_words(nums[-1])}:\n",
                [number_words(x) for x in nums], ", ")
    sep = {"comma": ", ", "lines": "\n", "spaces": " "}[fmt]
    return f"Count from {nums[0]} to {nums[-1]}:\n", [str(x) for x in nums], sep


def counting_doc(seed: int) -> str:
    header, items, sep = counting_parts(random.Random(seed))
    return header + sep.join(items)


WORDS = ("red blue green cat dog sun moon tree star fish bird rain snow wind fire stone "
         "apple river cloud light").split()


def patterns_doc(seed: int) -> str:
    rng = random.Random(seed)
    kind = rng.randrange(4)
    if kind == 0:   # a word group repeated
        unit = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        return "Repeat: " + " | ".join([unit] * rng.randint(8, 40))
    if kind == 1:   # a letter group repeated
        unit = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 6)))
        return "Pattern: " + " ".join([unit] * rng.randint(10, 60))
    if kind == 2:   # the alphabet, some times, upper or lower case
        abc = "abcdefghijklmnopqrstuvwxyz"
        if rng.random() < 0.5:
            abc = abc.upper()
        return "Alphabet:\n" + "\n".join(" ".join(abc) for _ in range(rng.randint(1, 4)))
    # a cycle of symbols with increasing index
    sym = rng.choice(["x", "item", "row", "node", "step"])
    return "List:\n" + "\n".join(f"{sym}_{i} = {i * rng.choice([1, 2, 10])}"
                                 for i in range(rng.randint(10, 40)))


def _digits(x: int) -> list[int]:
    return [int(c) for c in str(x)][::-1]


def add_steps(a: int, b: int) -> list[str]:
    da, db = _digits(a), _digits(b)
    carry, steps = 0, []
    for i in range(max(len(da), len(db))):
        x, y = (da[i] if i < len(da) else 0), (db[i] if i < len(db) else 0)
        s = x + y + carry
        steps.append(f"{x} + {y} + {carry} = {s}, write {s % 10}, carry {s // 10}")
        carry = s // 10
    if carry:
        steps.append(f"write carry {carry}")
    return steps


def sub_steps(a: int, b: int) -> list[str]:
    """a >= b."""
    da, db = _digits(a), _digits(b)
    borrow, steps = 0, []
    for i in range(len(da)):
        x, y = da[i], (db[i] if i < len(db) else 0)
        d = x - borrow - y
        nb = 1 if d < 0 else 0
        steps.append(f"{x} - {borrow} - {y} = {d + 10 * nb}" + (", borrow 1" if nb else ", borrow 0"))
        borrow = nb
    return steps


def mul_steps(a: int, b: int) -> list[str]:
    steps, partial = [], []
    for i, y in enumerate(_digits(b)):
        p = a * y * 10 ** i
        partial.append(p)
        steps.append(f"{a} * {y * 10 ** i} = {p}")
    if len(partial) > 1:
        steps.append(" + ".join(str(p) for p in partial) + f" = {sum(partial)}")
    return steps


def arith_problem(rng: random.Random) -> tuple[str, str, str]:
    """(question line, worked steps + final line, answer)."""
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(10, 9999), rng.randint(2, 99)
    else:
        a, b = rng.randint(10, 99999), rng.randint(10, 99999)
        if op == "-" and b > a:
            a, b = b, a
    ans = {"+": a + b, "-": a - b, "*": a * b}[op]
    steps = {"+": add_steps, "-": sub_steps, "*": mul_steps}[op](a, b)
    return f"Q: {a} {op} {b}\n", "\n".join(steps) + f"\n{a} {op} {b} = {ans}\n", str(ans)


def sort_problem(rng: random.Random) -> tuple[str, str]:
    xs = [rng.randint(0, 99 if rng.random() < 0.7 else 999) for _ in range(rng.randint(3, 10))]
    return f"sort {xs} -> ", str(sorted(xs))


def arith_doc(seed: int, skip: set | None = None) -> str:
    rng = random.Random(seed)
    parts = []
    for _ in range(rng.randint(1, 3)):
        q, work, _ = arith_problem(rng)
        if skip and q in skip:
            continue
        parts.append(q + work)
    return "\n".join(parts)


def sort_doc(seed: int, skip: set | None = None) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(rng.randint(2, 8)):
        p, a = sort_problem(rng)
        if skip and p in skip:
            continue
        lines.append(p + a)
    return "\n".join(lines)


def eval_items(n_count: int, n_arith: int, n_sort: int) -> list[dict]:
    """Held-out problems with exact targets (seeds HELDOUT_SEED + i)."""
    items = []
    for i in range(n_count):
        header, xs, sep = counting_parts(random.Random(HELDOUT_SEED + i))
        k = 4 if len(xs) > 12 else 2
        items.append({"kind": "counting", "prompt": header + sep.join(xs[:k]) + sep,
                      "target": sep.join(xs[k:]), "seed": HELDOUT_SEED + i})
    for i in range(n_arith):
        q, work, ans = arith_problem(random.Random(HELDOUT_SEED + i))
        items.append({"kind": "arith", "prompt": q, "target": work, "answer": ans,
                      "seed": HELDOUT_SEED + i})
    for i in range(n_sort):
        p, ans = sort_problem(random.Random(HELDOUT_SEED + i))
        items.append({"kind": "sort", "prompt": p, "target": ans, "answer": ans,
                      "seed": HELDOUT_SEED + i})
    return items


# ----------------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts, folder: str, vocab_size: int) -> str:
    """Byte-level BPE (digits split one per token) trained on `texts`; eos, pad and mask as special
    tokens; writes tokenizer.json and tokenizer_config.json into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    os.makedirs(folder, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD,
           "mask_token": MASK, "bos_token": None, "unk_token": None,
           "model_max_length": 4096, "add_bos_token": False}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return folder


# ----------------------------------------------------------------------------------- build

def parse_mix(spec: str | None) -> dict:
    mix = dict(DEFAULT_MIX)
    if spec:
        mix = {k: 0.0 for k in DEFAULT_MIX}
        for item in spec.split(","):
            if "=" not in item:
                raise DemoDataError(f"--mix: expected kind=share items, got {item!r}")
            k, v = item.split("=", 1)
            k = k.strip()
            if k not in DEFAULT_MIX:
                raise DemoDataError(f"--mix: unknown kind {k!r}; kinds: {', '.join(DEFAULT_MIX)}")
            try:
                mix[k] = float(v)
            except ValueError:
                raise DemoDataError(f"--mix: share of {k} is not a number: {v!r}") from None
            if mix[k] < 0:
                raise DemoDataError(f"--mix: share of {k} must be >= 0, got {v}")
    if mix["code"] <= 0:
        raise DemoDataError("--mix: the code share must be > 0 (it fixes the corpus size)")
    return mix


def _write_jsonl(path: str, records) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def build(out: str, *, stdlib: str | None = None, force: bool = False, vocab_size: int = 6144,
          heldout_percent: float = 5.0, code_mb: float | None = None, mix: dict | None = None,
          eval_count: int = 64, eval_arith: int = 64, eval_sort: int = 32, eval_code: int = 48,
          seed: int = 0, log=print) -> dict:
    """Build the whole data folder (see the module docstring); returns the stats dict."""
    t_start = time.perf_counter()
    out = os.path.abspath(out)
    mix = dict(DEFAULT_MIX if mix is None else mix)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not force:
        raise DemoDataError(f"output folder {out} already exists; pass --force to replace it")
    if not 256 + len(SPECIAL_TOKENS) < vocab_size <= 65536:
        raise DemoDataError(f"vocab size must be in ({256 + len(SPECIAL_TOKENS)}, 65536], got {vocab_size}")
    if not 0 < heldout_percent < 100:
        raise DemoDataError(f"held-out percent must be in (0, 100), got {heldout_percent}")
    if code_mb is not None and code_mb <= 0:
        raise DemoDataError(f"--code-mb must be > 0, got {code_mb}")
    root = stdlib or stdlib_dir()
    files = list_code_files(root)
    train_files = [(r, t) for r, t in files if not heldout_file(r, heldout_percent)]
    held_files = [(r, t) for r, t in files if heldout_file(r, heldout_percent)]
    if not train_files or not held_files:
        raise DemoDataError(f"{root}: {len(files)} files give an empty "
                            f"{'training' if not train_files else 'held-out'} split at "
                            f"{heldout_percent}% held out; the corpus is too small")
    if code_mb is not None:  # a deterministic subset (by path hash order) of about code_mb MB
        ranked = sorted(train_files, key=lambda rt: hashlib.sha256(rt[0].encode()).hexdigest())
        chosen, size = [], 0
        for r, t in ranked:
            if size >= code_mb * 1e6:
                break
            chosen.append((r, t))
            size += len(t.encode())
        train_files = sorted(chosen)
    log(f"code: {len(files)} files under {root}: {len(train_files)} train, {len(held_files)} held out")

    evals = eval_items(eval_count, eval_arith, eval_sort)
    evals += code_prompts(held_files, eval_code, seed)
    skip = {e["prompt"] for e in evals if e["kind"] in ("arith", "sort")}
    skip_arith = {p for p in skip if p.startswith("Q: ")}

    train = [{"text": t, "kind": "code"} for _, t in train_files]
    code_chars = sum(len(t) for _, t in train_files)
    gens = {"counting": counting_doc, "patterns": patterns_doc,
            "arith": lambda s: arith_doc(s, skip_arith), "sort": lambda s: sort_doc(s, skip)}
    for kind in GENERATED:
        want = code_chars * mix[kind] / mix["code"]
        got, i = 0, 0
        while got < want:
            doc = gens[kind](i)
            i += 1
            if doc:
                train.append({"text": doc, "kind": kind})
                got += len(doc)
    random.Random(seed).shuffle(train)

    held = [{"text": t, "kind": "code"} for _, t in held_files]
    for kind in GENERATED:
        fn = {"counting": counting_doc, "patterns": patterns_doc, "arith": arith_doc,
              "sort": sort_doc}[kind]
        held += [{"text": fn(HELDOUT_SEED + 100_000 + i), "kind": kind} for i in range(50)]

    tmp = out + f".partial-{os.getpid()}"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        t0 = time.perf_counter()
        tok_dir = train_tokenizer((d["text"] for d in train), os.path.join(tmp, "tokenizer"),
                                  vocab_size)
        t_tok = time.perf_counter() - t0
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
        stats = {"train": {}, "heldout": {}}
        for name, docs in (("train", train), ("heldout", held)):
            for kind in ("code",) + GENERATED:
                texts = [d["text"] for d in docs if d["kind"] == kind]
                n_tok = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
                stats[name][kind] = {"documents": len(texts), "mb": sum(len(t.encode()) for t in texts) / 1e6,
                                     "tokens": n_tok}
            _write_jsonl(os.path.join(tmp, f"{name}.jsonl"),
                         [{"text": d["text"]} if name == "train" else d for d in docs])
        _write_jsonl(os.path.join(tmp, "eval.jsonl"), evals)
        stats.update(
            vocab_size=tok.get_vocab_size(), special_tokens={t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
            eval={k: sum(1 for e in evals if e["kind"] == k) for k in ("counting", "arith", "sort", "code")},
            settings=dict(stdlib=root, heldout_percent=heldout_percent, code_mb=code_mb, mix=mix,
                          requested_vocab_size=vocab_size, seed=seed, heldout_seed=HELDOUT_SEED,
                          python=sys.version.split()[0]),
            tokenizer_s=t_tok)
        stats["build_s"] = time.perf_counter() - t_start
        with open(os.path.join(tmp, "stats.json"), "w") as f:
            json.dump(stats, f, indent=1)
        if os.path.exists(out):
            shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return stats


def summary(stats: dict, out: str) -> str:
    lines = [f"wrote {out}  (vocab {stats['vocab_size']}, built in {stats['build_s']:.1f} s, "
             f"tokenizer {stats['tokenizer_s']:.1f} s)",
             f"{'split':<8}{'kind':<10}{'docs':>8}{'MB':>9}{'tokens':>12}"]
    for split in ("train", "heldout"):
        tot = {"documents": 0, "mb": 0.0, "tokens": 0}
        for kind, s in stats[split].items():
            lines.append(f"{split:<8}{kind:<10}{s['documents']:>8}{s['mb']:>9.2f}{s['tokens']:>12,}")
            for k in tot:
                tot[k] += s[k]
        lines.append(f"{split:<8}{'total':<10}{tot['documents']:>8}{tot['mb']:>9.2f}{tot['tokens']:>12,}")
    lines.append("eval: " + ", ".join(f"{k} {v}" for k, v in stats["eval"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m demo.data", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="data/demo", help="output folder (default data/demo)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--stdlib", default=None, help="code corpus folder (default: this Python's stdlib)")
    p.add_argument("--vocab-size", type=int, default=6144)
    p.add_argument("--heldout-percent", type=float, default=5.0)
    p.add_argument("--code-mb", type=float, default=None, help="use about this many MB of training code")
    p.add_argument("--mix", default=None, help="shares, e.g. code=0.7,counting=0.12,patterns=0.03,arith=0.1,sort=0.05")
    p.add_argument("--eval-count", type=int, default=64)
    p.add_argument("--eval-arith", type=int, default=64)
    p.add_argument("--eval-sort", type=int, default=32)
    p.add_argument("--eval-code", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        stats = build(a.out, stdlib=a.stdlib, force=a.force, vocab_size=a.vocab_size,
                      heldout_percent=a.heldout_percent, code_mb=a.code_mb, mix=parse_mix(a.mix),
                      eval_count=a.eval_count, eval_arith=a.eval_arith, eval_sort=a.eval_sort,
                      eval_code=a.eval_code, seed=a.seed)
    except DemoDataError as e:
        print(f"demo_data: error: {e}", file=sys.stderr)
        return 2
    print(summary(stats, os.path.abspath(a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
