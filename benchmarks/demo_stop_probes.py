"""Can the demo model be taught where a count ends? Two short continuations of the shipped model
that put the training signal on the stop (issue 20; `benchmarks.demo_stop` reads the result).

    python -m benchmarks.demo_stop_probes tail OUT_DIR       # counts whose loss is on their last numbers
    python -m benchmarks.demo_stop_probes decisions OUT_DIR  # counts whose loss is on the stop decisions only

Each writes OUT_DIR/data (the training data), OUT_DIR/config.yaml (a `wedlm-train` config that
continues demo/model for `--steps`) and prints the commands that train and measure it:

  tail       6,000 training counts as prompt/response records: the response is the count's last r
             numbers (r uniform in 1-4, at most all but two), so every loss token of a count is near
             its end, where only the comparison with the header's b says whether to go on; plus
             2,500 worked-arithmetic documents. Dual stream as in the adaptation, LR 3e-4.
  decisions  8,000 training counts packed into rows (`train.pretokenize`) whose `maskable` flags
             keep only the decision tokens of the count: the separator after each number and the
             end of text after b. Every loss token is a stop-or-go-on decision. AR loss, LR 1e-3.

Counts come from the training generator (demo.tasks.counting_parts) at seeds 5,000,000 + i, past
the training split's; any whose header is a held-out item's is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

import numpy as np

from demo import tasks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SEED0 = 5_000_000


def counts(n: int, heldout_headers: set, seed0: int = SEED0):
    """n ((header, numbers, separator), the count's generator, drawn past it) from the training
    generator, none with a held-out header."""
    i = 0
    while n:
        rng = random.Random(seed0 + i)
        parts = tasks.counting_parts(rng)
        i += 1
        if parts[0].split("\n", 1)[0] not in heldout_headers:
            n -= 1
            yield parts, rng


def tail_record(header: str, xs: list[str], sep: str, r: int) -> dict:
    """The count with its last r numbers as the response (the only loss tokens)."""
    return {"prompt": header + sep.join(xs[:-r]) + sep, "response": sep.join(xs[-r:])}


def decision_flags(tokens: np.ndarray, segment_ids: np.ndarray, *, header_end: int, newline: int,
                   decisions: tuple[int, ...]) -> np.ndarray:
    """bool [rows, L]: True at the decision tokens of each packed count, i.e. in each document
    after its header (`header_end` then `newline`, the first such pair) every token in
    `decisions` (the separators and the end of text)."""
    flags = np.zeros(tokens.shape, bool)
    for r in range(tokens.shape[0]):
        in_count = False
        for t in range(tokens.shape[1]):
            if t > 0 and segment_ids[r, t] != segment_ids[r, t - 1]:
                in_count = False
            x = int(tokens[r, t])
            if in_count and x in decisions:
                flags[r, t] = True
            elif not in_count and x == newline and t > 0 and tokens[r, t - 1] == header_end:
                in_count = True
    return flags


def _token(tok, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False).ids
    if len(ids) != 1:
        raise ValueError(f"{text!r} is {len(ids)} tokens in this tokenizer, expected one")
    return ids[0]


def build(kind: str, out: str, model: str, steps: int) -> list[str]:
    from tokenizers import Tokenizer

    from demo.eval import eval_items
    os.makedirs(out, exist_ok=False)
    heldout = {e["prompt"].split("\n", 1)[0] for e in eval_items(model, "counting")}
    data = os.path.join(out, "data")
    if kind == "tail":
        recs = [tail_record(h, xs, sep, rng.randint(1, min(4, len(xs) - 2)))
                for (h, xs, sep), rng in counts(6000, heldout)]
        skip = {e["prompt"] for e in eval_items(model, "arith")}
        recs += [{"text": tasks.arith_doc(random.Random(7_000_000 + j), skip)} for j in range(2500)]
        random.Random(0).shuffle(recs)
        os.makedirs(data)
        with open(os.path.join(data, "train.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
        source = {"train_files": [os.path.join(data, "train.jsonl")]}
        objective = {"kind": "dual_stream", "block_size": 16, "mask_per_block": True, "ar_weight": 1.0}
        lr = 3e-4
    else:
        raw = os.path.join(out, "counts.jsonl")
        with open(raw, "w") as f:
            f.writelines(json.dumps({"text": h + sep.join(xs)}) + "\n"
                         for (h, xs, sep), _ in counts(8000, heldout))
        subprocess.run([sys.executable, "-m", "train.pretokenize", "--tokenizer", model, "--out",
                        data, "--seq-len", "256", raw], check=True, cwd=ROOT)
        tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        eos = tok.token_to_id("<|endoftext|>")
        meta = json.load(open(os.path.join(data, "meta.json")))
        for shard in meta["shards"]:
            p = lambda k: os.path.join(data, f"{shard['name']}.{k}.npy")
            flags = decision_flags(np.load(p("tokens")), np.load(p("segment_ids")),
                                   header_end=_token(tok, ":"), newline=_token(tok, "\n"),
                                   decisions=(_token(tok, ","), _token(tok, "\n"), eos))
            np.save(p("maskable"), flags)
        source = {"packed_dir": data}
        objective = {"kind": "ar_only"}
        lr = 1e-3
    run = os.path.join(out, "run")
    cfg = {"model": {"from_hf": model},
           "data": dict(source, tokenizer=model, seq_len=256, global_batch_size=16, shuffle_seed=1),
           "objective": objective,
           "optimizer": {"lr": lr, "final_lr": 3e-5, "warmup_steps": 10, "weight_decay": 0.1,
                         "b2": 0.98, "clip": 1.0},
           "mesh": {"data": -1}, "checkpoint": {"dir": run, "every": 100000, "keep": 1,
                                                "export_hf": os.path.join(run, "hf")},
           "steps": steps, "seed": 0, "compute_dtype": "f32", "param_dtype": "f32", "log_every": 20}
    import yaml
    with open(os.path.join(out, "config.yaml"), "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    hf = os.path.join(run, "hf")
    return [f"wedlm-train --config {os.path.join(out, 'config.yaml')}",
            f"cp {model}/eval.jsonl {hf}/ && (cd {hf} && sha256sum config.json eval.jsonl "
            f"model.safetensors tokenizer.json tokenizer_config.json | sed 's/  / /' > MANIFEST.sha256)",
            f"python -m benchmarks.demo_stop --model {hf} --out {os.path.join(out, 'stop.json')}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.demo_stop_probes",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=("tail", "decisions"))
    ap.add_argument("out", help="a new folder")
    ap.add_argument("--model", default="demo/model")
    ap.add_argument("--steps", type=int, default=None, help="default: tail 150, decisions 300")
    a = ap.parse_args(argv)
    if os.path.exists(a.out):
        print(f"demo_stop_probes: {a.out} exists; pass a new folder", file=sys.stderr)
        return 2
    steps = a.steps or (150 if a.kind == "tail" else 300)
    try:
        commands = build(a.kind, a.out, a.model, steps)
    except (OSError, ValueError, subprocess.CalledProcessError) as e:
        print(f"demo_stop_probes: {e}", file=sys.stderr)
        return 1
    print("\n".join(commands))
    return 0


if __name__ == "__main__":
    sys.exit(main())
