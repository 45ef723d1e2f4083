"""The records regime with its schema (`make demo`, benchmarks/structured/constraints.py): each held-out
table's JSON lines constrained to its columns (docs/algorithm.md §7), beside the same prompts
unconstrained."""

from __future__ import annotations

import json

TYPES = {"name": "string", "city": "string", "color": "string", "age": "integer",
         "id": "integer", "score": "integer"}    # demo.tasks.FIELDS' values


def row_schema(item) -> dict:
    """The JSON schema of one row of a records item's table (its columns, in order)."""
    cols = item["prompt"].split("\n")[1].split(" | ")
    return {"type": "object", "properties": {c: {"type": TYPES[c]} for c in cols},
            "required": cols, "additionalProperties": False}


def lines_regex(schema) -> str:
    """1 to 5 JSON lines of `schema` (a records answer), as a regular expression."""
    from decode.constraints.spec import Constraint
    row = Constraint.json_schema(schema).to_regex()
    return f"{row}(\\n{row}){{0,4}}"


def valid(text: str, schema) -> bool:
    import jsonschema
    try:
        for line in text.split("\n"):
            jsonschema.validate(json.loads(line), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def records_automata(tokenizer, items, backend: str = "device") -> list:
    """Each item's JSON-lines constraint compiled for `backend` (device or host)."""
    from decode.constraints.backends import compile_for
    from decode.constraints.spec import Constraint
    return [compile_for(Constraint.regex(lines_regex(row_schema(it))), tokenizer, None, backend)
            for it in items]


def decode_records(params, config, tok, items, dc, automata=None) -> dict:
    """Each item alone (compiled first, then one timed pass): valid %, exact %, tokens per
    forward, wall seconds, tokens, forwards."""
    from decode.static.static_batch import generate
    from demo.eval import REGIMES, cut, stop_ids
    regime = REGIMES["records"]
    dc = dc.replace(stop_token_ids=stop_ids(tok, config, regime))
    out = dict(valid=0, exact=0, tokens=0, steps=0, wall_s=0.0)
    for i, it in enumerate(items):
        kw = dict(automata=[automata[i]]) if automata else {}
        prompt = [tok.encode(it["prompt"])]
        generate(params, config, prompt, dc, **kw)                       # compile
        res = generate(params, config, prompt, dc, **kw)
        text, _ = cut(tok.decode(res.tokens[0]), regime.stop_strings)
        out["valid"] += valid(text.strip(), row_schema(it))
        out["exact"] += text.strip() == it["answer"].strip()
        out["tokens"] += res.n_gen
        out["steps"] += res.steps
        out["wall_s"] += res.wall_s
    n = len(items)
    return dict(valid_pct=100 * out["valid"] / n, exact_pct=100 * out["exact"] / n,
                tokens_per_forward=out["tokens"] / max(1, out["steps"]), wall_s=out["wall_s"],
                step_ms=1e3 * out["wall_s"] / max(1, out["steps"]), tokens=out["tokens"],
                forwards=out["steps"])


def print_records_with_schema(params, config, tok, items, base_dc,
                              methods=("streaming", "verified", "ar")) -> dict:
    """`make demo`'s table: records unconstrained and with their schema, per method."""
    autos = records_automata(tok, items)
    runs = {m: {"free": decode_records(params, config, tok, items, base_dc.replace(method=m)),
                "schema": decode_records(params, config, tok, items, base_dc.replace(method=m),
                                         autos)} for m in methods}
    print(f"\n[records with their schema] {len(items)} prompts, each table's columns as a JSON-lines "
          f"constraint (docs/algorithm.md §7), beside the same prompts unconstrained:")
    print(f"{'method':<11}{'output':<8}{'valid':>7}{'exact':>7}{'tok/fwd':>9}{'tok/s':>8}{'vs AR':>8}")
    ar = runs.get("ar")
    for m, r in runs.items():
        for k in ("free", "schema"):
            x = r[k]
            tps = x["tokens"] / x["wall_s"] if x["wall_s"] else 0.0
            base = ar[k]["tokens"] / ar[k]["wall_s"] if ar and ar[k]["wall_s"] else 0.0
            ratio = f"{tps / base:.2f}x" if base else "-"
            print(f"{m:<11}{k:<8}{x['valid_pct']:>6.0f}%{x['exact_pct']:>6.0f}%"
                  f"{x['tokens_per_forward']:>9.2f}{tps:>8.0f}{ratio:>8}")
    return runs
