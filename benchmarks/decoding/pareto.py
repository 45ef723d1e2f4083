"""Accuracy against speed on one checkpoint (the paper's Figure 5a): a task set decoded by
AR greedy and by streaming at every point of a (W, tau, lambda) grid, through the same Decoder,
each point timed beside AR in interleaved rounds (median wall time), so every ratio is measured in
one run.

    python -m benchmarks.decoding.pareto [--checkpoint demo/model] [--tasks FILE.jsonl] [--kinds counting,arith]
                                [--windows 4,8,16] [--taus 0.2,0.4,0.6,0.9] [--lams 0.02]
                                [--items 16] [--repeats 3] [--batch 1] [--out benchmarks/results/pareto]

Tasks: a jsonl of held-out items, one per line, `{"kind": K, "prompt": ..., ...}`; K is one of the
demo's regimes (counting: "target"; arith, lists, records: "answer"; demo/eval.py scores them) or
"answer" (any checkpoint: `{"kind": "answer", "prompt": ..., "answer": ...}`, right when the text
before the first newline, stripped, equals the answer). Default: the checkpoint folder's eval.jsonl
(the demo model ships one).

Writes OUT.json (every point: accuracy, tokens per forward, tokens/s, ratio over AR, per kind and
pooled), prints the table, and OUT.png (accuracy against speed-up over AR, one line per W across
tau, like Figure 5a) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time

from decode.config import DecodeConfig
from demo.eval import REGIMES, decode_side_by_side, eval_items, load_model

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
ROOT = os.path.dirname(HERE)


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"pareto: --{name} takes comma-separated numbers, got {text!r}") from None
    if not values:
        raise SystemExit(f"pareto: --{name} is empty")
    return values


def grid(windows, taus, lams) -> dict:
    """{point name: DecodeConfig}: AR first, then streaming at every (W, tau, lambda)."""
    points = {"ar": DecodeConfig(method="ar")}
    for w, t, lam in itertools.product(windows, taus, lams):
        points[f"W{int(w)} tau{t:g} lam{lam:g}"] = DecodeConfig(method="streaming", window=int(w),
                                                                 tau=t, lam=lam)
    return points


def pooled(per_kind: dict, name: str) -> dict:
    """One point over every kind: items right / items, tokens / forwards, tokens / wall time."""
    rs = [res[name] for res in per_kind.values()]
    right = sum((r["accuracy"] or 0.0) * r["n_items"] for r in rs)
    n_gen, steps, wall = (sum(r[k] for r in rs) for k in ("n_gen", "steps", "wall_s"))
    return dict(accuracy=right / sum(r["n_items"] for r in rs), tokens_per_forward=n_gen / max(steps, 1),
                tokens_per_s=n_gen / wall if wall else 0.0, n_gen=n_gen, wall_s=wall)


def run(args) -> dict:
    config, params, tok = load_model(args.checkpoint, check=False)
    points = grid(args.windows, args.taus, args.lams)
    per_kind = {}
    for kind in args.kinds:
        items = eval_items(args.tasks, kind, args.items)
        per_kind[kind] = decode_side_by_side(params, config, tok, items, kind, points,
                                             repeats=args.repeats, batch=args.batch)
    table = {}
    for name, dc in points.items():
        row = pooled(per_kind, name)
        row.update(method=dc.method, window=dc.window, tau=dc.tau, lam=dc.lam,
                   kinds={k: {f: res[name][f] for f in ("accuracy", "tokens_per_forward", "tokens_per_s")}
                          for k, res in per_kind.items()})
        table[name] = row
    ar = table["ar"]["tokens_per_s"]
    for row in table.values():
        row["speedup"] = row["tokens_per_s"] / ar if ar else 0.0
    return table


def markdown(table: dict, kinds) -> str:
    head = ("| point | accuracy | " + " | ".join(f"{k} acc" for k in kinds) +
            " | tokens / forward | tokens / s | over AR |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in table.items():
        accs = " | ".join(f"{r['kinds'][k]['accuracy']:.0%}" for k in kinds)
        lines.append(f"| {name} | {r['accuracy']:.0%} | {accs} | {r['tokens_per_forward']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def plot(table: dict, path: str, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ar = table["ar"]
    ax.scatter([1.0], [ar["accuracy"]], marker="*", s=150, color="k", label="AR", zorder=3)
    windows = sorted({r["window"] for r in table.values() if r["method"] == "streaming"})
    for w in windows:
        rows = sorted((r for r in table.values() if r["method"] == "streaming" and r["window"] == w),
                      key=lambda r: (r["tau"], r["lam"]))
        ax.plot([r["speedup"] for r in rows], [r["accuracy"] for r in rows], "o-", label=f"streaming W={w}")
        for r in rows:
            ax.annotate(f"{r['tau']:g}", (r["speedup"], r["accuracy"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("tokens/s over AR (same weights, same run)")
    ax.set_ylabel("accuracy (held-out, exact)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decoding.pareto", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", default=os.path.join(ROOT, "demo", "model"))
    p.add_argument("--tasks", default=None, help="jsonl of items (default: CHECKPOINT/eval.jsonl)")
    p.add_argument("--kinds", default="counting,arith", help="which items' kinds to run")
    p.add_argument("--windows", default="4,8,16")
    p.add_argument("--taus", default="0.2,0.4,0.6,0.9")
    p.add_argument("--lams", default="0.02")
    p.add_argument("--items", type=int, default=16, help="items per kind")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (median kept)")
    p.add_argument("--batch", type=int, default=1, help="prompts per generate call")
    p.add_argument("--out", default=os.path.join(HERE, "results", "pareto"))
    args = p.parse_args(argv)
    args.tasks = args.tasks or os.path.join(args.checkpoint, "eval.jsonl")
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in args.kinds if k not in REGIMES]
    if unknown:
        print(f"pareto: error: --kinds {','.join(unknown)}: known kinds are {', '.join(REGIMES)}",
              file=sys.stderr)
        return 2
    if not os.path.exists(args.tasks):
        print(f"pareto: error: {args.tasks}: no such task file (--tasks)", file=sys.stderr)
        return 2
    args.windows, args.taus, args.lams = (_floats(getattr(args, n), n) for n in ("windows", "taus", "lams"))
    for name in ("items", "repeats", "batch"):
        if getattr(args, name) < 1:
            print(f"pareto: error: --{name} must be >= 1", file=sys.stderr)
            return 2
    t0 = time.time()
    try:
        table = run(args)
    except (ValueError, OSError) as e:
        print(f"pareto: error: {e}", file=sys.stderr)
        return 2
    meta = dict(command="python -m benchmarks.decoding.pareto " + " ".join(argv if argv is not None else sys.argv[1:]),
                checkpoint=args.checkpoint, tasks=args.tasks, kinds=args.kinds, items=args.items,
                repeats=args.repeats, batch=args.batch, machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
                seconds=round(time.time() - t0, 1))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta=meta, points=table), f, indent=1)
    print(markdown(table, args.kinds))
    title = f"{os.path.basename(os.path.normpath(args.checkpoint))}: {', '.join(args.kinds)}, {args.items} items each"
    drew = plot(table, args.out + ".png", title)
    print(f"{args.out}.json" + (f", {args.out}.png" if drew else "") + f" ({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
