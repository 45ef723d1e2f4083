"""The paper's speed experiments at small scale, on the shipped demo model.

    python -m benchmarks.demo_model.demo_experiments NAME [--items N] [--repeats R] [--model DIR]
                                               [--kinds counting,arith,records,code]

NAME (or `all`, in this order):
  accuracy      the held-out targets: every held-out counting and arithmetic prompt (fresh numbers),
                AR greedy and streaming at the defaults side by side (batch 16): exact accuracy,
                tokens per forward against the cap W
  mixed         a static batch of 16 mixed prompts (4 per regime): streaming vs AR tokens/s
  regimes       counting / arithmetic / records / code: streaming vs block vs AR at the demo defaults, and the
                cost of one forward at W = 1, 4, 8, 16, 32 beside them        (paper Figures 6-8)
  tau           tau sweep, streaming and block at each tau: quality vs speed  (Figures 4a, 4c)
  lam           lambda sweep at the default tau                               (Figure 5a)
  window        W = 4, 8, 16, 32, 64 (streaming), with the forward cost of each W
  batch         batch 1, 8, 32: streaming vs AR tokens/s
  verified      verified streaming (output = AR greedy) beside plain streaming and AR
  refill        refill 'before' (the official order, up to 2W slots a forward) against
                'after' (W slots) at equal forward size: before at W vs after at 2W
  transformers  transformers `generate` (greedy) on the same HF folder vs our AR and our streaming
  report        print the saved results as the Markdown tables of BENCHMARKS.md

Every figure is measured in one run, methods interleaved per setting, AR measured beside them so
ratios do not cross runs. Results: benchmarks/results/demo_NAME.json; plots:
benchmarks/figures/demo_NAME.png. Quality: counting exact, arithmetic accuracy, code the AR-reading
NLL per token of the generated continuation (AR greedy's beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from benchmarks.demo_model.demo_figures import KINDS, plot
from demo.run import LAM, TAU, WINDOW
from demo.eval import (DEMO_MODEL, REGIMES, decode_items, decode_side_by_side, eval_items,
                       load_model, quality)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
RESULTS = os.path.join(HERE, "results")
FIGURES = os.path.join(HERE, "figures")
TAUS = (0.1, 0.3, 0.6, 0.9, 1.5, 2.5)
LAMS = (0.0, 0.02, 0.1, 0.3)
WINDOWS = (4, 8, 16, 32, 64)
BATCHES = (1, 8, 32)


class Ctx:
    def __init__(self, args):
        self.args = args
        self.config, self.params, self.tok = load_model(args.model)
        self.kinds = tuple(args.kinds.split(","))
        self.items = {k: eval_items(args.model, k, args.items) for k in self.kinds}

    @staticmethod
    def config_for(kind, method, **kw):
        """The regime's DecodeConfig: the demo's defaults, overridden by `kw`."""
        from decode.config import DecodeConfig
        kw = dict(dict(window=WINDOW, tau=TAU, lam=LAM), **kw)
        return DecodeConfig(method=method, max_new_tokens=REGIMES[kind].max_new_tokens, **kw)

    def run(self, kind, method, items=None, warmup=True, batch=1, **kw):
        r = decode_items(self.params, self.config, self.tok, items or self.items[kind], kind,
                         self.config_for(kind, method, **kw), repeats=self.args.repeats,
                         warmup=warmup, batch=batch)
        return self._score(kind, r)

    def _score(self, kind, r):
        r["quality"] = float(quality(self.params, self.config, kind, r))
        return r

    def side_by_side(self, kind, methods, dcs=None):
        """The methods (or named DecodeConfigs `dcs`) on the regime's items, interleaved
        (demo.eval.decode_side_by_side)."""
        dcs = dcs or {m: self.config_for(kind, m) for m in methods}
        runs = decode_side_by_side(self.params, self.config, self.tok, self.items[kind], kind, dcs,
                                   repeats=self.args.repeats)
        for r in runs.values():
            self._score(kind, r)
        return runs


def brief(r, ar=None) -> dict:
    out = {k: r[k] for k in ("method", "window", "tau", "lam", "batch", "n_items", "n_gen", "steps",
                             "token_slots", "tokens_per_forward", "p_cache", "wall_s", "tokens_per_s",
                             "quality")}
    if ar is not None:
        out["speedup_vs_ar"] = ar["wall_s"] / r["wall_s"] * (r["n_gen"] / ar["n_gen"] if ar["n_gen"] else 1.0)
    return out


def qual(kind, q):
    return f"NLL {q:.3f}" if kind == "code" else f"acc {100 * q:.0f}%"


def line(kind, r):
    s = r.get("speedup_vs_ar")
    return (f"  {kind:<9}{r['method']:<10}W={r['window']:<3} tau={r['tau']:<5} lam={r['lam']:<5} "
            f"b={r['batch']:<3} tok/fwd {r['tokens_per_forward']:5.2f}  p_cache {r['p_cache']:.3f}  "
            f"{r['tokens_per_s']:7.0f} tok/s" + (f"  {s:5.2f}x AR" if s is not None else "")
            + f"  {qual(kind, r['quality'])}")


# ----------------------------------------------------------------------------- experiments

def through_end(target: str, text: str) -> bool:
    """The count's text holds every number of the target, up to and including the end value b
    (a count that runs on past b passes this and fails the exact score)."""
    target, text = target.strip(), text.strip()
    return text.startswith(target) and not text[len(target):len(target) + 1].isdigit()


def exp_accuracy(ctx):
    """AR greedy and streaming (defaults) on every held-out counting and arithmetic prompt, 16
    rows per call (rows decode independently: a batch gives each row the tokens it gets alone)."""
    out = {}
    for kind in ("counting", "arith"):
        items = eval_items(ctx.args.model, kind)
        rows = {}
        for m in ("ar", "streaming"):
            r = ctx.run(kind, m, items=items, batch=16)
            rows[m] = dict(brief(r), right=sum(bool(x["correct"]) for x in r["rows"]),
                           cap_fraction=r["tokens_per_forward"] / (1 if m == "ar" else WINDOW))
            extra = ""
            if kind == "counting":     # every number right up to b, whether or not it stopped there
                rows[m]["through_end"] = sum(through_end(it["target"], x["text"])
                                             for it, x in zip(items, r["rows"]))
                extra = f", {rows[m]['through_end']} right through the end value"
            print(line(kind, rows[m]) + f"  {rows[m]['right']}/{len(items)} right{extra}", flush=True)
        rows["examples"] = [dict(prompt=x["prompt"], text=x["text"], correct=x["correct"])
                            for x in r["rows"][:3]]
        out[kind] = rows
    return out


def exp_mixed(ctx):
    """A static batch of 16 mixed prompts, 4 per regime, one generate call per method."""
    from decode.config import DecodeConfig
    from demo.eval import stop_ids
    from decode.static.static_batch import generate
    items = [(k, it) for k in ctx.kinds for it in eval_items(ctx.args.model, k, 4)]
    prompts = [ctx.tok.encode(it["prompt"]) for _, it in items]
    budget = max(REGIMES[k].max_new_tokens for k in ctx.kinds)
    stops = tuple(dict.fromkeys(i for k in ctx.kinds for i in stop_ids(ctx.tok, ctx.config,
                                                                       REGIMES[k])))
    out = {}
    dcs = {m: DecodeConfig(method=m, window=WINDOW, tau=TAU, lam=LAM, max_new_tokens=budget,
                           stop_token_ids=stops) for m in ("ar", "streaming")}
    walls = {m: [] for m in dcs}
    for m, dc in dcs.items():
        generate(ctx.params, ctx.config, prompts, dc, capacity=512)          # compile
    for _ in range(max(1, ctx.args.repeats)):
        for m, dc in dcs.items():
            res = generate(ctx.params, ctx.config, prompts, dc, capacity=512)
            walls[m].append(res.wall_s)
            out[m] = dict(n_gen=res.n_gen, steps=res.steps)
    for m in dcs:
        wall = float(np.median(walls[m]))
        out[m].update(wall_s=wall, tokens_per_s=out[m]["n_gen"] / wall, walls=walls[m])
    out["streaming_vs_ar"] = out["streaming"]["tokens_per_s"] / out["ar"]["tokens_per_s"]
    print(f"  16 mixed prompts, one batch: AR {out['ar']['tokens_per_s']:.0f} tok/s, streaming "
          f"{out['streaming']['tokens_per_s']:.0f} tok/s ({out['streaming_vs_ar']:.2f}x)", flush=True)
    return out


def exp_regimes(ctx):
    from benchmarks.decoding.window_cost import measure
    out = {}
    for kind in ctx.kinds:
        runs = ctx.side_by_side(kind, ("ar", "streaming", "block"))
        res = {m: brief(r, runs["ar"]) for m, r in runs.items()}
        out[kind] = res
        for r in res.values():
            print(line(kind, r), flush=True)
    cost = measure(ctx.config, ctx.params, [1, 4, 8, 16, 32], repeats=30)
    out["forward_ms"] = {str(w): 1e3 * t for w, t in cost.items()}
    print("  one forward:", ", ".join(f"W={w} {1e3 * t:.2f} ms" for w, t in cost.items()))
    return out


def sweep(ctx, key, values, methods, recompiles=False):
    """For each regime: AR once, then each method at each value of `key` (interleaved, so every
    method sees the same machine state). `recompiles`: the key is static (W), so every value pays
    a compile pass; tau and lambda are runtime values of one compiled program."""
    out = {}
    for kind in ctx.kinds:
        ar = ctx.run(kind, "ar")
        rows = {"ar": brief(ar, ar), **{m: [] for m in methods}}
        for i, v in enumerate(values):
            for m in methods:
                r = brief(ctx.run(kind, m, warmup=recompiles or i == 0, **{key: v}), ar)
                rows[m].append(r)
                print(line(kind, r), flush=True)
        out[kind] = rows
    return out


def exp_tau(ctx):
    return sweep(ctx, "tau", TAUS, ("streaming", "block"))


def exp_lam(ctx):
    return sweep(ctx, "lam", LAMS, ("streaming",))


def exp_window(ctx):
    from benchmarks.decoding.window_cost import measure
    cost = measure(ctx.config, ctx.params, [1, *WINDOWS], repeats=30)
    print("  one forward:", ", ".join(f"W={w} {1e3 * t:.2f} ms" for w, t in cost.items()))
    out = sweep(ctx, "window", WINDOWS, ("streaming",), recompiles=True)
    out["forward_ms"] = {str(w): 1e3 * t for w, t in cost.items()}
    return out


def exp_batch(ctx):
    out = {}
    for kind in ("counting", "arith"):
        items = eval_items(ctx.args.model, kind, max(BATCHES))
        rows = {}
        for b in BATCHES:
            ar = ctx.run(kind, "ar", items=items, batch=b)
            st = ctx.run(kind, "streaming", items=items, batch=b)
            rows[str(b)] = {"ar": brief(ar, ar), "streaming": brief(st, ar)}
            for r in rows[str(b)].values():
                print(line(kind, r), flush=True)
        out[kind] = rows
    return out


def exp_verified(ctx):
    """On the trained model: verified streaming beside plain streaming and AR."""
    out = {}
    for kind in ctx.kinds:
        runs = ctx.side_by_side(kind, ("ar", "streaming", "verified"))
        ar = runs["ar"]
        rows = {"ar": brief(ar, ar)}
        for m in ("streaming", "verified"):
            r = runs[m]
            rows[m] = brief(r, ar)
            rows[m]["same_as_ar"] = sum(x["ids"] == y["ids"] for x, y in zip(r["rows"], ar["rows"]))
            rows[m]["accepted"], rows[m]["rejected"] = r.get("accepted"), r.get("rejected")
            print(line(kind, rows[m]) + f"  same as AR {rows[m]['same_as_ar']}/{len(ar['rows'])}", flush=True)
        out[kind] = rows
    return out


REFILL_RUNS = (("ar", "ar", "after", 1), ("after W=8", "streaming", "after", 8),
               ("before W=4", "streaming", "before", 4), ("after W=16", "streaming", "after", 16),
               ("before W=8", "streaming", "before", 8))


def exp_refill(ctx):
    """The two refill orders at equal forward size (before at W holds up to 2W slots)."""
    out = {}
    for kind in ctx.kinds:
        dcs = {name: ctx.config_for(kind, m, refill=refill, window=w)
               for name, m, refill, w in REFILL_RUNS}
        runs = ctx.side_by_side(kind, None, dcs)
        ar = runs["ar"]
        rows = {}
        for name, _, refill, _ in REFILL_RUNS:
            rows[name] = dict(brief(runs[name], ar), refill=refill)
            print(line(kind, rows[name]) + f"  refill {refill}", flush=True)
        out[kind] = rows
    return out


def exp_transformers(ctx):
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(ctx.args.model, dtype=torch.float32).eval()
    out = {"torch_threads": torch.get_num_threads()}
    for kind in ctx.kinds:
        items = ctx.items[kind]
        new = REGIMES[kind].max_new_tokens
        ar = ctx.run(kind, "ar")
        st = ctx.run(kind, "streaming")
        eos = ctx.config.eos_token_id
        walls, same, n_tok = [], 0, 0
        for _ in range(1 + ctx.args.repeats):  # first pass warms up
            t_all, outs = 0.0, []
            for row in ar["rows"]:
                ids = torch.tensor([row["prompt_ids"]])
                t0 = time.perf_counter()
                with torch.no_grad():
                    g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                    do_sample=False, eos_token_id=eos, pad_token_id=eos)
                t_all += time.perf_counter() - t0
                outs.append(g[0, ids.shape[1]:].tolist())
            walls.append(t_all)
        for row, g in zip(ar["rows"], outs):
            ours = row["ids"]
            same += int(g[:len(ours)] == ours)
            n_tok += len(g)
        t_hf = float(np.median(walls[1:]))
        out[kind] = dict(items=len(items), transformers_wall_s=t_hf, transformers_tokens=n_tok,
                         transformers_tokens_per_s=n_tok / t_hf, ar_same_tokens=same,
                         ours_ar=brief(ar), ours_streaming=brief(st),
                         ar_vs_transformers=t_hf / ar["wall_s"] * ar["n_gen"] / max(n_tok, 1),
                         streaming_vs_transformers=t_hf / st["wall_s"] * st["n_gen"] / max(n_tok, 1))
        print(f"  {kind:<9}transformers {n_tok / t_hf:6.0f} tok/s | our AR {ar['tokens_per_s']:6.0f} tok/s "
              f"({out[kind]['ar_vs_transformers']:.2f}x), same tokens in {same}/{len(items)} | "
              f"our streaming {st['tokens_per_s']:6.0f} tok/s ({out[kind]['streaming_vs_transformers']:.2f}x)",
              flush=True)
    return out


EXPERIMENTS = {"accuracy": exp_accuracy, "mixed": exp_mixed, "refill": exp_refill, "regimes": exp_regimes, "tau": exp_tau, "lam": exp_lam, "window": exp_window,
               "batch": exp_batch, "verified": exp_verified, "transformers": exp_transformers}


def kinds_arg(text: str) -> str:
    bad = [k for k in text.split(",") if k not in KINDS]
    if bad:
        raise argparse.ArgumentTypeError(f"{','.join(bad)}: the regimes are {', '.join(KINDS)}")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.demo_model.demo_experiments",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("name", choices=(*EXPERIMENTS, "all", "report"))
    ap.add_argument("--model", default=DEMO_MODEL)
    ap.add_argument("--items", type=int, default=8, help="held-out prompts per regime (default 8)")
    ap.add_argument("--kinds", default=",".join(KINDS), type=kinds_arg,
                    help=f"the regimes (default all: {','.join(KINDS)})")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per setting; median (default 2)")
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--figures", default=FIGURES)
    args = ap.parse_args(argv)
    if args.name == "report":
        print(report(args.results))
        return 0
    ctx = Ctx(args)
    names = list(EXPERIMENTS) if args.name == "all" else [args.name]
    os.makedirs(args.results, exist_ok=True)
    os.makedirs(args.figures, exist_ok=True)
    for name in names:
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        res = EXPERIMENTS[name](ctx)
        kinds = "" if ctx.kinds == KINDS else f" --kinds {args.kinds}"
        model = "" if args.model == DEMO_MODEL else f" --model {args.model}"
        meta = dict(command=f"python -m benchmarks.demo_model.demo_experiments {name} --items {args.items} "
                            f"--repeats {args.repeats}{kinds}{model}",
                    machine=f"{platform.machine()}, {os.cpu_count()} CPUs", loadavg=os.getloadavg(),
                    seconds=round(time.perf_counter() - t0, 1), defaults=dict(window=WINDOW, tau=TAU, lam=LAM))
        with open(os.path.join(args.results, f"demo_{name}.json"), "w") as f:
            json.dump(dict(meta=meta, results=_strip(res)), f, indent=1)
        p = plot(name, res, os.path.join(args.figures, f"demo_{name}.png"))
        print(f"== {name}: {meta['seconds']} s; {args.results}/demo_{name}.json" + (f", {p}" if p else ""))
    return 0


def step_ms(r) -> str:
    """Wall milliseconds per decoding step (one forward) at batch 1; blank for batched runs, whose
    `steps` sum over rows."""
    return f"{1e3 * r['wall_s'] / r['steps']:.2f}" if r["batch"] == 1 and r["steps"] else ""


def ceiling(forward_ms: dict, w) -> float | None:
    """The best wall-clock ratio over AR that streaming at window W (refill 'before') can reach on
    this machine: W tokens per forward over the cost of its forward of 2W slots (decode.compile.cost);
    None when that forward was not timed."""
    from decode.compile.cost import ceiling as cost_ceiling, forward_slots
    if str(forward_slots(int(w), "before")) not in forward_ms:
        return None
    return cost_ceiling(int(w), "before", {int(k): v for k, v in forward_ms.items()})


def report(results_dir: str = RESULTS) -> str:
    """Markdown tables of every saved result (what BENCHMARKS.md shows)."""
    out = []
    head = ("| regime | method | W | tau | lambda | batch | tok/fwd | p_cache | ms/step | tok/s | x AR | quality |\n|"
            + "---|" * 12)
    for name in EXPERIMENTS:
        path = os.path.join(results_dir, f"demo_{name}.json")
        if not os.path.exists(path):
            continue
        d = json.load(open(path))
        m = d["meta"]
        out.append(f"### {name}: `{m['command']}`\n\n({m['machine']}, load {m['loadavg'][0]:.1f}, "
                   f"{m['seconds']} s)\n")
        res = d["results"]
        if name == "accuracy":
            out.append("| regime | method | right | tok/fwd | of the cap W |\n|---|---|---|---|---|")
            for k, rows in res.items():
                for m in ("ar", "streaming"):
                    r = rows[m]
                    out.append(f"| {k} | {m} | {r['right']}/{r['n_items']} ({100 * r['quality']:.1f}%) | "
                               f"{r['tokens_per_forward']:.2f} | {100 * r['cap_fraction']:.0f}% |")
            out.append("")
            continue
        if name == "mixed":
            out.append("| method | tokens | forwards | tok/s |\n|---|---|---|---|")
            for m in ("ar", "streaming"):
                r = res[m]
                out.append(f"| {m} | {r['n_gen']} | {r['steps']} | {r['tokens_per_s']:.0f} |")
            out.append(f"\nstreaming / AR: {res['streaming_vs_ar']:.2f}x\n")
            continue
        if name == "transformers":
            out.append("| regime | transformers tok/s | our AR tok/s | AR same tokens | our streaming tok/s | AR / transformers | streaming / transformers |\n|" + "---|" * 7)
            for k in (k for k in KINDS if k in res):      # results older than a kind lack it
                r = res[k]
                out.append(f"| {k} | {r['transformers_tokens_per_s']:.0f} | {r['ours_ar']['tokens_per_s']:.0f} | "
                           f"{r['ar_same_tokens']}/{r['items']} | {r['ours_streaming']['tokens_per_s']:.0f} | "
                           f"{r['ar_vs_transformers']:.2f}x | {r['streaming_vs_transformers']:.2f}x |")
            out.append("")
            continue
        out.append(head)
        for kind, rows in res.items():
            if kind == "forward_ms":
                continue
            flat = []
            for v in (rows.values() if name != "batch" else [x for b in rows.values() for x in b.values()]):
                flat.extend(v if isinstance(v, list) else [v])
            for r in flat:
                q = r["quality"]
                q = "" if q is None else (f"NLL {q:.3f}" if kind == "code" else f"{100 * q:.0f}% right")
                extra = f" (same as AR {r['same_as_ar']}/{r['n_items']})" if "same_as_ar" in r else ""
                out.append(f"| {kind} | {r['method']} | {r['window']} | {r['tau']} | {r['lam']} | {r['batch']} | "
                           f"{r['tokens_per_forward']:.2f} | {r['p_cache']:.3f} | {step_ms(r)} | {r['tokens_per_s']:.0f} | "
                           f"{r.get('speedup_vs_ar', 1.0):.2f}x | {q}{extra} |")
        if "forward_ms" in res:
            fm = res["forward_ms"]
            out.append("\nOne forward in the decode loop (ms): "
                       + ", ".join(f"W={w} {v:.2f} ({v / fm['1']:.2f}x)" for w, v in fm.items())
                       + ". Ceiling over AR at refill 'before' (W tokens per forward of 2W slots): "
                       + ", ".join(f"W={w} {ceiling(fm, w):.2f}x" for w in fm
                                   if w != "1" and ceiling(fm, w) is not None))
        out.append("")
    return "\n".join(out)


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k != "rows"}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


if __name__ == "__main__":
    sys.exit(main())
