"""The shipped demo model and how it is judged: one place for `make demo`, the experiments
(benchmarks/demo_model/demo_experiments.py) and the tests that decode with the trained weights.

    check_model(folder)            every file the demo needs, verified (sha256 manifest) before use
    load_model(folder)             (config, params, tokenizer)
    eval_items(folder, kind, n)    held-out prompts of one regime (counting | arith | lists | records | code)
    REGIMES                        per regime: new-token budget, extra stop strings, how it is scored
    decode_items(...)              decode every item (one row each, or a batch), timed, scored
    ar_nll(...)                    the AR reading's negative log-likelihood per token of continuations

Quality, per regime (what the issue asks for):
  counting  exact: the continuation is a prefix of the true count (or all of it, ending in eos);
  arith     the final line "<question> = <answer>" of the worked steps is present and right;
  lists     the copied / sorted list is right;
  records   the JSON lines are right;
  answer    (any checkpoint's items: {"kind": "answer", "prompt", "answer"}) the line is the answer;
  code      not right/wrong: the AR-reading NLL per token of the generated continuation, reported
            beside AR greedy's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO_MODEL = os.path.join(HERE, "model")
MANIFEST = "MANIFEST.sha256"
REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json", "eval.jsonl")  # + weights
REBUILD = ("restore it with `git checkout -- demo/model`, or rebuild it (minutes on one GPU): "
           "`python -m demo.pipeline --target gpu --out runs/demo && python -m demo.ship`")


class DemoModelError(RuntimeError):
    """The shipped demo model is missing or damaged; the message names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class Regime:
    max_new_tokens: int
    stop_strings: tuple = ()     # cut after decoding; single-token ones also stop the loop


REGIMES = {
    "counting": Regime(max_new_tokens=128),
    "arith": Regime(max_new_tokens=160, stop_strings=("\n\n",)),
    "code": Regime(max_new_tokens=64),
    "lists": Regime(max_new_tokens=48, stop_strings=("\n",)),
    "records": Regime(max_new_tokens=128, stop_strings=("\n\n",)),
    "answer": Regime(max_new_tokens=64, stop_strings=("\n",)),   # any checkpoint: a short answer line
}


# ------------------------------------------------------------------------------- the files

def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_model(folder: str = DEMO_MODEL) -> None:
    """Raise DemoModelError naming the first missing, truncated or altered file (sha256 against
    MANIFEST.sha256), before anything is loaded or compiled."""
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder):
        raise DemoModelError(f"{folder}: the demo model folder is missing; {REBUILD}")
    if not os.path.exists(manifest_path):
        raise DemoModelError(f"{manifest_path}: missing (it lists each file's sha256); {REBUILD}")
    want = {}
    with open(manifest_path) as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if len(parts) != 2 or len(parts[0]) != 64:
                raise DemoModelError(f"{manifest_path}:{n}: not '<sha256> <file>': {line.strip()!r}; {REBUILD}")
            want[parts[1]] = parts[0]
    for name in REQUIRED:
        if name not in want:
            raise DemoModelError(f"{manifest_path}: does not list {name}; {REBUILD}")
    if not any(name.endswith(".safetensors") for name in want):
        raise DemoModelError(f"{manifest_path}: lists no .safetensors weights; {REBUILD}")
    for name, digest in want.items():
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise DemoModelError(f"{path}: missing; {REBUILD}")
        got = sha256(path)
        if got != digest:
            raise DemoModelError(f"{path}: corrupt (sha256 {got[:12]}..., expected {digest[:12]}... "
                                 f"from {MANIFEST}); {REBUILD}")


def write_manifest(folder: str) -> None:
    names = sorted(n for n in os.listdir(folder)
                   if n not in (MANIFEST, "README.md") and os.path.isfile(os.path.join(folder, n)))
    with open(os.path.join(folder, MANIFEST), "w") as f:
        for n in names:
            f.write(f"{sha256(os.path.join(folder, n))} {n}\n")


def load_model(folder: str = DEMO_MODEL, check: bool = True):
    """(ModelConfig, params, TextTokenizer) of the demo model (or any checkpoint folder with a
    tokenizer), opened the way every door opens one (decode.checkpoint)."""
    from decode.checkpoint import OpenCheckpoint
    if check:
        check_model(folder)
    ckpt = OpenCheckpoint.open(folder)
    config, params, _ = ckpt.load()
    return config, params, ckpt.tokenizer


def eval_items(path: str, kind: str, n: int | None = None) -> list[dict]:
    """The first n held-out items of one kind from an eval.jsonl (demo.data's format)."""
    if os.path.isdir(path):
        path = os.path.join(path, "eval.jsonl")
    items = []
    with open(path) as f:
        for line in f:
            if line.strip():
                item = json.loads(line)
                if item["kind"] == kind:
                    items.append(item)
    if not items:
        raise ValueError(f"{path}: no eval items of kind {kind!r}")
    return items[:n] if n else items


# ------------------------------------------------------------------------------- scoring

def score(kind: str, item: dict, text: str, finished_by_stop: bool) -> bool | None:
    """Is `text` (the continuation, stop strings cut) right? None for code (scored by NLL)."""
    if kind == "counting":
        target = item["target"]
        if finished_by_stop:
            return text.strip() == target.strip()
        return target.startswith(text)
    if kind == "arith":
        question = item["prompt"].strip()
        question = question[2:].strip() if question.startswith("Q:") else question
        lines = [ln.strip() for ln in text.strip().splitlines()]
        return bool(lines) and lines[-1] == f"{question} = {item['answer']}"
    if kind in ("lists", "records", "answer"):
        return text.strip() == item["answer"].strip()
    return None


def cut(text: str, stop_strings) -> tuple[str, bool]:
    """Text before the first stop string, and whether one was found (decode.text.first_stop)."""
    from decode.text import first_stop
    at = first_stop(text, stop_strings)
    return (text[:at], True) if at >= 0 else (text, False)


# ------------------------------------------------------------------------------- decoding

def stop_ids(tokenizer, config, regime: Regime) -> tuple[int, ...]:
    """eos ids plus the regime's single-token stop strings (the rest are cut after decoding)."""
    from decode.text import split_stop_strings
    ids, _ = split_stop_strings(tokenizer, regime.stop_strings)
    return tuple(dict.fromkeys(tokenizer.default_stop_ids(config.eos_token_id) + ids))


def decode_items(params, config, tokenizer, items, kind, dc, *, batch: int = 1, repeats: int = 1,
                 capacity: int = 512, warmup: bool = True, prompt_bucket: int | None = None,
                 decoder=None):
    """Decode every item with DecodeConfig `dc` (its stop ids are set here from the regime), `batch`
    rows per generate call; the whole set is timed `repeats` times after a compile pass and the
    median wall time kept (warmup=False: no compile pass, for a program already compiled, e.g. a
    sweep over the runtime knobs tau and lambda); `prompt_bucket` and `decoder`: generate()'s
    (one prefill and one step program across regimes). Returns a dict of totals and per-item texts and scores."""
    from decode.static.static_batch import generate
    regime = REGIMES[kind]
    dc = dc.replace(stop_token_ids=stop_ids(tokenizer, config, regime))
    prompts = [tokenizer.encode(it["prompt"]) for it in items]
    groups = [list(range(i, min(i + batch, len(items)))) for i in range(0, len(items), batch)]

    def one_pass():
        results = [None] * len(items)
        wall = 0.0
        steps = n_gen = slots = 0
        for g in groups:
            res = generate(params, config, [prompts[i] for i in g], dc, capacity=capacity,
                           prompt_bucket=prompt_bucket, decoder=decoder)
            wall += res.wall_s
            steps += res.steps
            n_gen += res.n_gen
            slots += res.token_slots
            for i, ids, row in zip(g, res.tokens, res.rows):
                results[i] = (ids, row)
        return wall, steps, n_gen, slots, results

    if warmup:
        one_pass()  # compile (one program per bucket)
    walls, last = [], None
    for _ in range(max(1, repeats)):
        last = one_pass()
        walls.append(last[0])
    _, steps, n_gen, slots, results = last
    accepted = sum(row.accepted for _, row in results)
    rejected = sum(row.rejected for _, row in results)
    wall = statistics.median(walls)
    rows, correct = [], []
    for it, pids, (ids, row) in zip(items, prompts, results):
        text, found = cut(tokenizer.decode(ids), regime.stop_strings)
        ok = score(kind, it, text, found or row.finish == "stop")
        if ok is not None:
            correct.append(ok)
        rows.append(dict(prompt=it["prompt"], ids=ids, prompt_ids=pids, text=text, correct=ok,
                         tokens_per_forward=row.tokens_per_forward, p_cache=row.p_cache))
    return dict(method=dc.method, window=dc.window, tau=dc.tau, lam=dc.lam, batch=batch,
                n_items=len(items), n_gen=n_gen, steps=steps, token_slots=slots,
                tokens_per_forward=n_gen / max(steps, 1), p_cache=n_gen / max(slots, 1),
                wall_s=wall, walls=walls, tokens_per_s=n_gen / wall if wall else 0.0,
                accuracy=(sum(correct) / len(correct)) if correct else None, accepted=accepted,
                rejected=rejected, rows=rows)


def decode_side_by_side(params, config, tokenizer, items, kind, dcs: dict, *, repeats: int = 3,
                        batch: int = 1) -> dict:
    """decode_items for several DecodeConfigs ({name: dc}) on the same items, timed side by side:
    each compiled first, then `repeats` rounds of one timed pass per config in turn (A, B, C, A,
    B, C, ...), so a burst of load on this noisy machine hits every config alike. Returns {name:
    result} with wall_s the median of its rounds (walls: every round) and tokens_per_s to match."""
    for dc in dcs.values():
        decode_items(params, config, tokenizer, items, kind, dc, batch=batch)      # compile + one pass
    walls = {name: [] for name in dcs}
    last = {}
    for _ in range(max(1, repeats)):
        for name, dc in dcs.items():
            last[name] = decode_items(params, config, tokenizer, items, kind, dc, batch=batch, warmup=False)
            walls[name].append(last[name]["wall_s"])
    for name, r in last.items():
        r["walls"], r["wall_s"] = walls[name], statistics.median(walls[name])
        r["tokens_per_s"] = r["n_gen"] / r["wall_s"] if r["wall_s"] else 0.0
    return last


def quality(params, config, kind: str, result: dict) -> float:
    """A decode_items result's quality: code, the mean AR-reading NLL per token of its
    continuations; other regimes, the fraction right."""
    if kind == "code":
        nll = ar_nll(params, config, [(r["prompt_ids"], r["ids"]) for r in result["rows"]])
        return sum(nll) / len(nll)
    return result["accuracy"]


def ar_nll(params, config, pairs, length: int = 512) -> list[float]:
    """Mean negative log-likelihood per token of each continuation under the AR reading (one
    causal forward of prompt + continuation: decode.serving.scoring). pairs: [(prompt_ids, continuation_ids)];
    NaN for an empty continuation."""
    from decode.serving.scoring import score
    seqs = []
    for p, c in pairs:
        seq = list(p) + list(c)
        if len(seq) > length:
            raise ValueError(f"prompt + continuation is {len(seq)} tokens, more than {length}")
        seqs.append(seq)
    scored = score(params, config, [s for s, (_, c) in zip(seqs, pairs) if c]) if any(c for _, c in pairs) else []
    out, it = [], iter(scored)
    for p, c in pairs:
        if not c:
            out.append(float("nan"))
            continue
        lps = next(it)["token_logprobs"][len(p):]
        out.append(float(-np.mean(lps)))
    return out
