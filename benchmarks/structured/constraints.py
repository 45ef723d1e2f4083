"""Structured outputs on the demo model (BENCHMARKS.md "Constrained decoding"): the records
regime decoded with a JSON-lines schema of each table's columns beside the same prompts
unconstrained, per method at `make demo`'s settings (W 8, tau 0.6, lambda 0.02, greedy, one prompt
per call), the schema enforced by each backend (device: the automaton's tables in the loop;
host: llguidance's parser asked once a step); the step at 8 slots (the 8 prompts in one static
batch) free, device and host; then the constraint compiler's build time and table bytes on the
demo vocabulary and on a synthetic 151,936-token byte-level vocabulary with a 10-field schema.

    python -m benchmarks.structured.constraints [--items 8] [--rounds 3] [--batch-only]
        [--out benchmarks/results/constraints.json]

Timing: every (method, output) pair once a round, the pairs in turn, `--rounds` rounds; wall time
and ms per step are the medians over rounds (greedy: the outputs are the same every round).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

METHODS = ("streaming", "verified", "block", "ar")
OUTPUTS = ("free", "device", "host")


def run_method(params, config, tok, items, method, autos, settings):
    from decode.config import DecodeConfig
    from demo.structured import decode_records
    return decode_records(params, config, tok, items,
                          DecodeConfig(method=method, max_new_tokens=192, **settings), autos)


def synthetic_vocab(size: int, seed: int = 0) -> dict:
    """A byte-level vocabulary of `size` entries: the 256 bytes, then distinct random pieces of
    2-8 printable ASCII characters (some with a leading space), as BPE vocabularies hold."""
    rng = random.Random(seed)
    vocab = {bytes([b]): [b] for b in range(256)}
    chars = [chr(c) for c in range(33, 127)]
    while len(vocab) < size:
        piece = "".join(rng.choice(chars) for _ in range(rng.randint(2, 8)))
        piece = (" " + piece) if rng.random() < 0.4 else piece
        vocab.setdefault(piece.encode(), [len(vocab)])
    return vocab


TEN_FIELDS = {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string"},
    "age": {"type": "integer", "minimum": 0}, "score": {"type": "number"},
    "active": {"type": "boolean"}, "city": {"enum": ["Paris", "Oslo", "Lima", "Tokyo"]},
    "tags": {"type": "array", "items": {"type": "string"}}, "note": {"type": ["string", "null"]},
    "created": {"type": "string", "format": "date"}},
    "required": ["id", "name", "email", "age", "score", "active", "city", "tags", "note", "created"],
    "additionalProperties": False}


def table_sizes(tok) -> list[dict]:
    from decode.constraints.automaton import compile_constraint
    from decode.constraints.spec import Constraint
    from decode.constraints.vocab import vocabulary_bytes
    from decode.config import DEVICE_TABLE
    demo_vocab, demo_size = vocabulary_bytes(tok)
    big = synthetic_vocab(151_936)
    rows = []
    for name, vocab, size in (("demo (512)", demo_vocab, demo_size),
                              ("synthetic byte-level (151,936)", big, 151_936)):
        t0 = time.perf_counter()
        a = compile_constraint(Constraint.json_schema(TEN_FIELDS), vocab, size)
        n, c = DEVICE_TABLE
        rows.append(dict(vocabulary=name, build_s=time.perf_counter() - t0, states=a.num_states,
                         classes=a.num_classes, table_bytes=a.nbytes,
                         device_bytes_per_slot=4 * (size + n * c)))
    return rows


def disagreeing(tok, items, backend: str) -> list:
    """Each item's row schema with its columns in reverse order and every string column an enum
    of one value the table never holds: a constraint the model's drafts keep breaking."""
    from decode.constraints.backends import compile_for
    from decode.constraints.spec import Constraint
    from demo.structured import row_schema
    out = []
    for it in items:
        s = row_schema(it)
        cols = list(s["properties"])[::-1]
        s["properties"] = {c: ({"enum": ["Atlantis"]} if s["properties"][c]["type"] == "string"
                               else s["properties"][c]) for c in cols}
        s["required"] = cols
        out.append(compile_for(Constraint.json_schema(s), tok, None, backend))
    return out


def batch_step(params, config, tok, items, autos, settings) -> dict:
    """Streaming over every item in one static batch (8 slots): ms per step, tokens/forward."""
    from decode.config import DecodeConfig
    from decode.static.static_batch import generate
    from demo.eval import REGIMES, stop_ids
    dc = DecodeConfig(method="streaming", max_new_tokens=192, **settings,
                      stop_token_ids=stop_ids(tok, config, REGIMES["records"]))
    prompts = [tok.encode(it["prompt"]) for it in items]
    kw = dict(automata=list(autos)) if autos else {}
    generate(params, config, prompts, dc, **kw)                         # compile
    res = generate(params, config, prompts, dc, **kw)
    return dict(tokens_per_forward=res.tokens_per_forward, wall_s=res.wall_s,
                step_ms=1e3 * res.wall_s / max(1, res.loop_iterations), steps=res.loop_iterations)


def median_run(runs: list[dict]) -> dict:
    """One pair's rounds: the first round's counts (the same every round), wall seconds and ms
    per step as medians over the rounds."""
    out = dict(runs[0])
    for key in ("wall_s", "step_ms"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def batch_only(params, config, tok, items, autos, settings, args) -> int:
    """The 8-slot step alone: free, device and host in turn each round; medians."""
    slots8 = {k: [] for k in OUTPUTS}
    for _ in range(args.rounds):
        for k in OUTPUTS:
            slots8[k].append(batch_step(params, config, tok, items, autos[k], settings))
    batch = {k: median_run(slots8[k]) for k in OUTPUTS}
    with open(args.out, "w") as f:
        json.dump(dict(settings=settings, items=len(items), rounds=args.rounds, batch8=batch,
                       step_ms_rounds={k: [r["step_ms"] for r in v] for k, v in slots8.items()}),
                  f, indent=1)
    for k, x in batch.items():
        print(f"| {k} | {x['tokens_per_forward']:.2f} | {x['step_ms']:.2f} | "
              f"{x['step_ms'] / batch['free']['step_ms']:.3f} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.structured.constraints")
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/constraints.json")
    ap.add_argument("--batch-only", action="store_true",
                    help="only the 8-slot step (free, device, host), `--rounds` interleaved rounds")
    args = ap.parse_args(argv)
    from demo.eval import DEMO_MODEL, eval_items, load_model
    from demo.run import LAM, TAU, WINDOW
    from demo.structured import records_automata
    config, params, tok = load_model(DEMO_MODEL)
    items = eval_items(DEMO_MODEL, "records", args.items)
    autos = {"free": None, "device": records_automata(tok, items, "device"),
             "host": records_automata(tok, items, "host")}
    settings = dict(window=WINDOW, tau=TAU, lam=LAM)
    if args.batch_only:
        return batch_only(params, config, tok, items, autos, settings, args)
    rounds = {(m, k): [] for m in METHODS for k in OUTPUTS}
    slots8 = {k: [] for k in OUTPUTS}
    for _ in range(args.rounds):                  # interleaved: every pair once a round
        for m, k in rounds:
            if (m, k) == ("block", "host"):       # refused: block takes device tables only
                continue
            rounds[m, k].append(run_method(params, config, tok, items, m, autos[k], settings))
        for k in OUTPUTS:
            slots8[k].append(batch_step(params, config, tok, items, autos[k], settings))
    broken = {k: disagreeing(tok, items, k) for k in ("device", "host")}
    against = {(m, k): [] for m in ("streaming", "ar") for k in broken}
    for _ in range(args.rounds):
        for m, k in against:
            against[m, k].append(run_method(params, config, tok, items, m, broken[k], settings))
    runs = {m: {k: median_run(rounds[m, k]) for k in OUTPUTS if rounds[m, k]} for m in METHODS}
    disagree = {f"{m} {k}": median_run(v) for (m, k), v in against.items()}
    batch = {k: median_run(slots8[k]) for k in OUTPUTS}
    result = dict(settings=settings, items=len(items), rounds=args.rounds, runs=runs,
                  batch8=batch, disagree=disagree, tables=table_sizes(tok))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"records, {len(items)} held-out prompts, W={WINDOW} tau={TAU} lambda={LAM}, greedy, batch 1, "
          f"medians of {args.rounds} interleaved rounds")
    print("| method | output | valid % | exact % | tokens/forward | step ms | wall s |")
    print("|---|---|---|---|---|---|---|")
    for m, r in runs.items():
        for k, x in r.items():
            print(f"| {m} | {k} | {x['valid_pct']:.0f} | {x['exact_pct']:.0f} | "
                  f"{x['tokens_per_forward']:.2f} | {x['step_ms']:.1f} | {x['wall_s']:.2f} |")
    print("\na schema the drafts keep breaking (columns reversed, strings an unseen enum):")
    print("| method backend | valid % | tokens/forward | wall s |")
    print("|---|---|---|---|")
    for k, x in disagree.items():
        print(f"| {k} | {x['valid_pct']:.0f} | {x['tokens_per_forward']:.2f} | {x['wall_s']:.2f} |")
    print(f"\nstreaming, the {len(items)} prompts in one batch of 8 slots:")
    print("| output | tokens/forward | step ms | step / free |")
    print("|---|---|---|---|")
    for k, x in batch.items():
        print(f"| {k} | {x['tokens_per_forward']:.2f} | {x['step_ms']:.2f} | "
              f"{x['step_ms'] / batch['free']['step_ms']:.3f} |")
    print("\n| vocabulary | build s | states | token classes | table bytes | device bytes per slot |")
    print("|---|---|---|---|---|---|")
    for t in result["tables"]:
        print(f"| {t['vocabulary']} | {t['build_s']:.2f} | {t['states']} | {t['classes']} | "
              f"{t['table_bytes']:,} | {t['device_bytes_per_slot']:,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
