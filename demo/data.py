"""Data for the demo model, made here; nothing is downloaded.

    python -m demo.data --out data/demo [--force] [--vocab-size 512] [--train-mb 12]
                        [--mix counting=0.4,arith=0.24,lists=0.12,records=0.16,code=0.08]
                        [--recipe 2]

Sources
  counting, arith, lists, records   generated (demo/tasks.py says what each looks like): document i
            of the training split is drawn from seed i, held-out problems from HELDOUT_SEED + i, and
            a training document holding a held-out prompt is skipped. `--recipe` (demo/tasks.py
            RECIPE): 2 composes the records' names from syllables, 1 (the shipped weights' data)
            draws them from 26 names; stats.json's settings record it.
  code      the Python standard library of the running interpreter (`sysconfig` "stdlib"), without
            site-packages, test/tests folders, idlelib, turtledemo and files that are not UTF-8;
            split by file: sha256 of the relative path, `--heldout-percent` of the files held out;
            the training share is filled with files in path-hash order.

Mixing: `--mix` gives each kind's share of the `--train-mb` training characters (shares are
normalised; a kind with share 0 is left out, but the training split must not be empty).

Output folder (refused when it exists, unless `--force`; built beside it and swapped in whole):
  train.jsonl      {"text": ...} training documents, shuffled
  heldout.jsonl    {"text": ..., "kind": ...} held-out documents (held-out files, held-out seeds)
  eval.jsonl       {"kind", "prompt", "target", "answer"?}: counting prompts with their exact
                   continuation, arithmetic / list / record problems with answers, code prompts
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

from demo import tasks

EOS, PAD, MASK = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = [EOS, PAD, MASK]
HELDOUT_SEED = 1_000_000_000
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo",
             "__pycache__"}
# shares of the characters; records tokenize at ~0.5 tokens a character, counts at ~0.9, so
# records get ~13% of the tokens where their share of characters is 16%
DEFAULT_MIX = {"counting": 0.40, "arith": 0.24, "lists": 0.12, "records": 0.16, "code": 0.08}
GENERATED = ("counting", "arith", "lists", "records")
EVAL_KINDS = ("counting", "arith", "lists", "records", "code")
EVAL_SIZES = {"counting": 64, "arith": 64, "lists": 32, "records": 32, "code": 48}  # per kind


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
    """`kind=share,...` -> {kind: share}, normalised to sum 1; kinds not named get 0."""
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
            if not mix[k] >= 0:
                raise DemoDataError(f"--mix: share of {k} must be >= 0, got {v}")
    total = sum(mix.values())
    if total <= 0:
        raise DemoDataError("--mix: every share is 0; the training split would be empty")
    return {k: v / total for k, v in mix.items()}


def _write_jsonl(path: str, records) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def generated_doc(kind: str, seed: int, skip=frozenset(), skip_headers=frozenset(),
                  recipe: int = tasks.RECIPE) -> str:
    """The document of a generated kind drawn from `seed` ("" when it would hold a held-out
    prompt: a counting header or a problem of the eval set); `recipe`: tasks.RECIPES."""
    rng = random.Random(seed)
    if kind == "counting":
        doc = tasks.counting_doc(rng)
        return "" if doc.split("\n", 1)[0] in skip_headers else doc
    if kind == "records":
        return tasks.records_doc(rng, skip, recipe)
    return {"arith": tasks.arith_doc, "lists": tasks.lists_doc}[kind](rng, skip)


def generate_share(kind: str, chars: float, worker: int, workers: int, skip, skip_headers,
                   recipe: int = tasks.RECIPE) -> list[str]:
    """One worker's share of a kind: documents from seeds worker, worker + workers, ... until
    `chars` characters (the same documents for the same worker count)."""
    docs, got, seed = [], 0, worker
    while got < chars:
        doc = generated_doc(kind, seed, skip, skip_headers, recipe)
        seed += workers
        if doc:
            docs.append(doc)
            got += len(doc)
    return docs


def tokenizer_sample(train: list[dict], mb: float):
    """The (shuffled) training documents' texts up to `mb` million characters: what the BPE
    merges are learned from (the whole split once it is larger than a sample needs)."""
    size = 0
    for d in train:
        if size >= mb * 1e6:
            return
        size += len(d["text"])
        yield d["text"]


def build(out: str, *, stdlib: str | None = None, force: bool = False, vocab_size: int = 512,
          heldout_percent: float = 5.0, train_mb: float = 12.0, mix: dict | None = None,
          eval_sizes: dict | None = None, seed: int = 0, workers: int = 1,
          tokenizer_mb: float = 12.0, recipe: int = tasks.RECIPE, log=print) -> dict:
    """Build the whole data folder (see the module docstring); returns the stats dict.
    `eval_sizes`: held-out items per kind (EVAL_KINDS), over EVAL_SIZES; `recipe`: how the
    records' names are drawn (tasks.RECIPES; 1 rebuilds the shipped weights' data)."""
    t_start = time.perf_counter()
    out = os.path.abspath(out)
    mix = parse_mix(None) if mix is None else dict(mix)
    check_build(out, force, vocab_size, heldout_percent, train_mb, workers, tokenizer_mb)
    try:
        tasks.check_recipe(recipe)
    except ValueError as e:
        raise DemoDataError(str(e)) from None
    root = stdlib or stdlib_dir()
    want = {k: train_mb * 1e6 * mix.get(k, 0.0) for k in DEFAULT_MIX}
    train_files, held_files = split_code(root, heldout_percent, want["code"], log)
    n = dict(EVAL_SIZES, **(eval_sizes or {}))
    if set(n) - set(EVAL_KINDS):
        raise DemoDataError(f"eval_sizes: unknown kinds {sorted(set(n) - set(EVAL_KINDS))}; "
                            f"allowed: {', '.join(EVAL_KINDS)}")
    evals = tasks.heldout_items(HELDOUT_SEED, n["counting"], n["arith"], n["lists"], n["records"],
                                recipe)
    evals += code_prompts(held_files, n["code"], seed)
    skip = {e["prompt"] for e in evals}
    skip_headers = {e["prompt"].split("\n", 1)[0] for e in evals if e["kind"] == "counting"}
    train = [{"text": t, "kind": "code"} for _, t in train_files]
    train += generate_all(want, workers, skip, skip_headers, recipe)
    if not train:
        raise DemoDataError("the training split is empty (every --mix share that has data is 0)")
    random.Random(seed).shuffle(train)
    held = [{"text": t, "kind": "code"} for _, t in held_files]
    for kind in GENERATED:
        held += [{"text": d, "kind": kind} for i in range(50)
                 if (d := generated_doc(kind, HELDOUT_SEED + 100_000 + i, skip, skip_headers,
                                        recipe))]
    settings = dict(stdlib=root, heldout_percent=heldout_percent, train_mb=train_mb, mix=mix,
                    requested_vocab_size=vocab_size, seed=seed, heldout_seed=HELDOUT_SEED,
                    python=sys.version.split()[0], workers=workers, tokenizer_mb=tokenizer_mb,
                    recipe=recipe)
    return write_folder(out, train, held, evals, vocab_size, tokenizer_mb, settings, t_start)


def check_build(out, force, vocab_size, heldout_percent, train_mb, workers, tokenizer_mb) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not force:
        raise DemoDataError(f"output folder {out} already exists; pass --force to replace it")
    if not 256 + len(SPECIAL_TOKENS) < vocab_size <= 65536:
        raise DemoDataError(f"vocab size must be in ({256 + len(SPECIAL_TOKENS)}, 65536], got {vocab_size}")
    if not 0 < heldout_percent < 100:
        raise DemoDataError(f"held-out percent must be in (0, 100), got {heldout_percent}")
    if not train_mb > 0:
        raise DemoDataError(f"--train-mb must be > 0, got {train_mb}")
    if workers < 1 or not tokenizer_mb > 0:
        raise DemoDataError(f"--workers must be >= 1 and --tokenizer-mb > 0, got {workers} and "
                            f"{tokenizer_mb}")


def split_code(root: str, heldout_percent: float, code_chars: float, log) -> tuple[list, list]:
    """(training files, held-out files) of the code corpus: the split by file hash, the training
    share whole files in path-hash order up to `code_chars` characters."""
    files = list_code_files(root)
    train_files = [(r, t) for r, t in files if not heldout_file(r, heldout_percent)]
    held_files = [(r, t) for r, t in files if heldout_file(r, heldout_percent)]
    if not train_files or not held_files:
        raise DemoDataError(f"{root}: {len(files)} files give an empty "
                            f"{'training' if not train_files else 'held-out'} split at "
                            f"{heldout_percent}% held out; the corpus is too small")
    ranked = sorted(train_files, key=lambda rt: hashlib.sha256(rt[0].encode()).hexdigest())
    chosen, size = [], 0
    for r, t in ranked:
        if size >= code_chars:
            break
        chosen.append((r, t))
        size += len(t)
    log(f"code: {len(files)} files under {root}: {len(chosen)} train, {len(held_files)} held out")
    return sorted(chosen), held_files


def generate_all(want: dict, workers: int, skip, skip_headers,
                 recipe: int = tasks.RECIPE) -> list[dict]:
    """The generated kinds' training documents, each kind's characters split over the workers."""
    jobs = [(kind, want[kind] / workers, w, workers, skip, skip_headers, recipe)
            for kind in GENERATED for w in range(workers)]
    if workers > 1:
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            parts = pool.starmap(generate_share, jobs)
    else:
        parts = [generate_share(*j) for j in jobs]
    return [{"text": doc, "kind": kind} for (kind, *_), docs in zip(jobs, parts) for doc in docs]


def write_folder(out, train, held, evals, vocab_size, tokenizer_mb, settings, t_start) -> dict:
    """The tokenizer, the splits, the eval set and stats.json, built beside `out` and swapped in
    whole; returns the stats."""
    tmp = out + f".partial-{os.getpid()}"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        t0 = time.perf_counter()
        tok_dir = train_tokenizer(tokenizer_sample(train, tokenizer_mb),
                                  os.path.join(tmp, "tokenizer"), vocab_size)
        t_tok = time.perf_counter() - t0
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
        stats = {"train": {}, "heldout": {}}
        for name, docs in (("train", train), ("heldout", held)):
            for kind in GENERATED + ("code",):
                texts = [d["text"] for d in docs if d["kind"] == kind]
                n_tok = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
                stats[name][kind] = {"documents": len(texts), "tokens": n_tok,
                                     "mb": sum(len(t.encode()) for t in texts) / 1e6}
            _write_jsonl(os.path.join(tmp, f"{name}.jsonl"),
                         [{"text": d["text"]} if name == "train" else d for d in docs])
        _write_jsonl(os.path.join(tmp, "eval.jsonl"), evals)
        stats.update(
            vocab_size=tok.get_vocab_size(), special_tokens={t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
            eval={k: sum(1 for e in evals if e["kind"] == k) for k in EVAL_KINDS},
            settings=settings, tokenizer_s=t_tok, build_s=time.perf_counter() - t_start)
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
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--heldout-percent", type=float, default=5.0)
    p.add_argument("--train-mb", type=float, default=12.0, help="training characters, in millions")
    p.add_argument("--mix", default=None,
                   help="shares, e.g. " + ",".join(f"{k}={v}" for k, v in DEFAULT_MIX.items()))
    for kind, flag in zip(EVAL_KINDS, ("count", "arith", "lists", "records", "code")):
        p.add_argument(f"--eval-{flag}", dest=f"eval_{kind}", type=int, default=EVAL_SIZES[kind],
                       help=f"held-out {kind} items")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1,
                   help="processes generating the tasks (the documents depend on this count)")
    p.add_argument("--tokenizer-mb", type=float, default=12.0,
                   help="training characters (millions) the tokenizer's merges are learned from")
    p.add_argument("--recipe", type=int, default=tasks.RECIPE, choices=tasks.RECIPES,
                   help=f"how the records' names are drawn (default {tasks.RECIPE}: composed from "
                        f"syllables; 1: the 26 names of the shipped weights' data)")
    a = p.parse_args(argv)
    try:
        stats = build(a.out, stdlib=a.stdlib, force=a.force, vocab_size=a.vocab_size,
                      heldout_percent=a.heldout_percent, train_mb=a.train_mb, mix=parse_mix(a.mix),
                      eval_sizes={k: getattr(a, f"eval_{k}") for k in EVAL_KINDS}, seed=a.seed,
                      workers=a.workers, tokenizer_mb=a.tokenizer_mb, recipe=a.recipe)
    except DemoDataError as e:
        print(f"demo_data: error: {e}", file=sys.stderr)
        return 2
    print(summary(stats, os.path.abspath(a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
