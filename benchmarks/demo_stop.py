"""Does the demo model know where a count ends? (issue 20)

    python -m benchmarks.demo_stop [--model demo/model] [--out benchmarks/results/demo_stop.json]

The demo's counts fail mostly at the stop: the numbers are right up to the end value b and the
model runs on. This measures the stop decision itself, teacher-forced: one causal forward over
each held-out count written out in full (header, every number, EOS), and at the end of each
number the model's probability that the document ends there. A model that compares the number
it just wrote with the header's b gives a high P(end) after b and a low one before; a model that
only learned how long counts tend to be gives the same modest hazard everywhere.

Per held-out counting item (the eval set's items regenerated from their seeds, demo.tasks):
  p_end        P(EOS) right after b (the true end)
  end_argmax   EOS is the likeliest next token there (greedy stops)
  p_before     mean P(EOS) after the earlier numbers (where the count must go on)
  false_stops  how many earlier numbers have EOS as the likeliest next token
Summaries per count format (by, down, from, lines, words) and over all items.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def count_format(header: str) -> str:
    if header.startswith("Count in words"):
        return "words"
    if header.startswith("Count down"):
        return "down"
    if header.startswith("Count from"):
        return "from"
    return "lines" if "one per line" in header else "by"


def number_ends(tok, header: str, xs: list[str], sep: str) -> tuple[list[int], list[int]]:
    """(token ids of header + the whole count, the index of the last token of each number in
    it). Prefixes are tokenized on their own and must be prefixes of the whole (the demo
    tokenizer splits digits and separators apart, so they are); ValueError otherwise."""
    ids = tok.encode(header + sep.join(xs))
    ends = []
    for k in range(1, len(xs) + 1):
        pre = tok.encode(header + sep.join(xs[:k]))
        if ids[:len(pre)] != pre:
            raise ValueError(f"{header.strip()!r}: the tokens of the first {k} numbers are not a "
                             f"prefix of the whole count's")
        ends.append(len(pre) - 1)
    return ids, ends


@functools.lru_cache(maxsize=None)
def _eos_reader(config):
    import jax
    import jax.numpy as jnp

    from wedlm_jax import model as model_lib

    @jax.jit
    def read(params, tokens):
        """tokens [B, L] -> (log P(eos | tokens <= t) [B, L], eos is the argmax [B, L])."""
        m = model_lib.Transformer(config, dtype=jnp.float32, attention="auto")
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits = m.apply({"params": params}, tokens, pos).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits, axis=-1)[..., config.eos_token_id]
        return lp, jnp.argmax(logits, axis=-1) == config.eos_token_id
    return read


def measure(config, params, tok, items: list[dict]) -> list[dict]:
    """One row per counting item (see the module docstring)."""
    from demo.tasks import counting_parts
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else config.eos_token_id[0]
    config = config.replace(eos_token_id=eos)
    seqs = []
    for it in items:
        header, xs, sep = counting_parts(random.Random(it["seed"]))
        if not it["prompt"].startswith(header):
            raise ValueError(f"eval item seed {it['seed']}: its prompt is not the count "
                             f"demo.tasks draws from that seed (another generator version?)")
        ids, ends = number_ends(tok, header, xs, sep)
        seqs.append((it, header, ids + [eos], ends))
    length = max(len(s[2]) for s in seqs)
    length = 1 << (length - 1).bit_length()
    tokens = np.zeros((len(seqs), length), np.int32)
    for i, (_, _, ids, _) in enumerate(seqs):
        tokens[i, :len(ids)] = ids
    lp, top = (np.asarray(a) for a in _eos_reader(config)(params, tokens))
    rows = []
    for i, (it, header, _, ends) in enumerate(seqs):
        p = np.exp(lp[i, ends])
        rows.append(dict(seed=it["seed"], header=header.strip(), format=count_format(header),
                         numbers=len(ends), p_end=float(p[-1]), end_argmax=bool(top[i, ends[-1]]),
                         p_before=float(p[:-1].mean()) if len(p) > 1 else float("nan"),
                         false_stops=int(top[i, ends[:-1]].sum())))
    return rows


def summarize(rows: list[dict]) -> dict:
    def agg(rs):
        return dict(items=len(rs), p_end_median=float(np.median([r["p_end"] for r in rs])),
                    p_end_mean=float(np.mean([r["p_end"] for r in rs])),
                    end_argmax=sum(r["end_argmax"] for r in rs),
                    p_before_mean=float(np.nanmean([r["p_before"] for r in rs])),
                    items_with_false_stops=sum(r["false_stops"] > 0 for r in rs))
    out = {"all": agg(rows)}
    for fmt in sorted({r["format"] for r in rows}):
        out[fmt] = agg([r for r in rows if r["format"] == fmt])
    return out


def table(summary: dict) -> str:
    lines = ["| counts | items | P(end) after b, median | mean | greedy stops at b | mean P(end) "
             "before b | items with an early stop |", "|---|---|---|---|---|---|---|"]
    for k, s in summary.items():
        lines.append(f"| {k} | {s['items']} | {s['p_end_median']:.3f} | {s['p_end_mean']:.3f} | "
                     f"{s['end_argmax']} | {s['p_before_mean']:.3f} | {s['items_with_false_stops']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.demo_stop", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo/model")
    ap.add_argument("--out", default=None, help="JSON with every row and the summary")
    a = ap.parse_args(argv)
    from demo.eval import DemoModelError, eval_items, load_model
    try:
        config, params, tok = load_model(a.model)
        rows = measure(config, params, tok, eval_items(a.model, "counting"))
    except (OSError, ValueError, DemoModelError) as e:
        print(f"demo_stop: {e}", file=sys.stderr)
        return 1
    s = summarize(rows)
    print(table(s))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(command="python -m benchmarks.demo_stop --model " + a.model,
                           summary=s, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
