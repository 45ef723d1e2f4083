"""BFCL v4 (the Berkeley Function-Calling Leaderboard's AST categories) on a checkpoint, through
the tool-calling path the server uses: each example's question rendered with its functions as
tools by the chat template, decoded under the tool grammar of `tool_choice` (decode.tools), the
calls read back with `split_calls`. Per set it measures

    valid %        of the outputs not cut (below), those that are a well-formed answer: under
                   required, at least one complete call (exactly one unless the set is
                   parallel), every call naming an offered function with arguments valid under
                   its converted schema (jsonschema); under auto (irrelevance), every call made
                   is such a call. `answered %`: valid outputs of all examples
    malformed      calls that fail that (name not offered, arguments not JSON or not valid)
    cut            outputs under required that hit the token budget inside their first call
                   (the grammar kept them in its language; they are not scored as valid)
    AST %          BFCL's AST match against the possible answers (`ast_match`); irrelevance:
                   outputs with no call (the right answer there), decoded under auto
    tok/fwd        tokens per forward of the constrained outputs and of the same prompts decoded
                   without the constraint (`free`), with the share of free outputs that are valid
    wall s         the set's decoding time (constrained + free, compiles included)

The data is BFCL's own files, read from the `bfcl-eval` wheel (not installed: it pins old
packages) or a folder holding them:

    pip download --no-deps bfcl-eval -d ~/.cache/bfcl
    python -m benchmarks.structured.bfcl --checkpoint demo/model --limit 20 --method verified --window 8 \\
        --out benchmarks/results/bfcl-2026-11-29/demo.json

A checkpoint without a chat template (the demo model) gets a small hermes-style one (TEMPLATE);
`--chat-template FILE` overrides the checkpoint's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import sys
import time
import zipfile

SETS = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
CACHE = os.path.expanduser(os.environ.get("BFCL_CACHE", "~/.cache/bfcl"))
GET_DATA = f"pip download --no-deps bfcl-eval -d {CACHE} (or pass --data WHEEL_OR_DIR)"
TEMPLATE = (
    "{%- if tools %}<|system|>Functions:\n{%- for t in tools %}\n{{ t.function | tojson }}"
    "{%- endfor %}\nCall one as <tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call>\n"
    "{%- endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}")
TYPES = {"dict": "object", "float": "number", "tuple": "array", "integer": "integer",
         "string": "string", "boolean": "boolean", "array": "array", "object": "object",
         "number": "number"}
KEEP = ("enum", "description", "default")
# BFCL's value types for the AST match ("any" is compared as a string, as BFCL does)
PY_TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list,
            "tuple": list, "dict": dict, "any": str}


class InputError(Exception):
    """Bad input: one line on stderr, exit 2."""


# ------------------------------------------------------------------------------ schemas

def to_schema(node) -> dict:
    """A BFCL parameter doc as JSON Schema: dict -> object, float -> number, tuple -> array,
    any -> no type; enum, description, default, items, properties and required kept. An object
    with properties allows no other keys (BFCL counts an unexpected parameter as wrong)."""
    if not isinstance(node, dict):
        return {}
    out = {k: node[k] for k in KEEP if k in node}
    kind = node.get("type")
    if kind in TYPES:
        out["type"] = TYPES[kind]
    elif kind not in (None, "any"):
        raise InputError(f"unknown BFCL type {kind!r}")
    if isinstance(node.get("items"), dict):
        out["items"] = to_schema(node["items"])
    if isinstance(node.get("properties"), dict):
        out["properties"] = {k: to_schema(v) for k, v in node["properties"].items()}
        out["additionalProperties"] = False
    if isinstance(node.get("required"), list):
        out["required"] = list(node["required"])
    return out


# ------------------------------------------------------------------------------ data

def data_reader(where: str | None):
    """read(relative path under bfcl_eval/data) -> text or None, from a wheel or a folder."""
    if where is None:
        wheels = sorted(glob.glob(os.path.join(CACHE, "bfcl_eval-*.whl")))
        if not wheels:
            raise InputError(f"no BFCL data in {CACHE}: {GET_DATA}")
        where = wheels[-1]
    if os.path.isfile(where) and zipfile.is_zipfile(where):
        zf = zipfile.ZipFile(where)
        names = set(zf.namelist())

        def from_wheel(rel):
            name = f"bfcl_eval/data/{rel}"
            return zf.read(name).decode("utf-8") if name in names else None
        return from_wheel
    if not os.path.isdir(where):
        raise InputError(f"--data {where}: neither the bfcl-eval wheel nor a folder; {GET_DATA}")

    def from_dir(rel):
        for root in (where, os.path.join(where, "bfcl_eval", "data"), os.path.join(where, "data")):
            path = os.path.join(root, rel)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    return f.read()
        return None
    return from_dir


def _lines(text: str) -> list:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_set(read, name: str, limit: int | None) -> list:
    """The set's first `limit` examples: {id, messages, functions, answer (None: irrelevance)}."""
    text = read(f"BFCL_v4_{name}.json")
    if text is None:
        raise InputError(f"BFCL_v4_{name}.json is not in the data; {GET_DATA}")
    examples = _lines(text)[:limit] if limit else _lines(text)
    answers = {}
    if name != "irrelevance":
        found = read(f"possible_answer/BFCL_v4_{name}.json")
        if found is None:
            raise InputError(f"possible_answer/BFCL_v4_{name}.json is not in the data")
        answers = {a["id"]: a["ground_truth"] for a in _lines(found)}
    return [{"id": e["id"], "messages": [m for turn in e["question"] for m in turn],
             "functions": e["function"], "answer": answers.get(e["id"])} for e in examples]


# ------------------------------------------------------------------------------ AST match

def _norm(s: str) -> str:
    """BFCL's string standardization: no spaces or ,./-_*^, lower case, ' as "."""
    return re.sub(r"[ ,./\-_*^]", "", s).lower().replace("'", '"')


def _std(v):
    return _norm(v) if isinstance(v, str) else v


def _dict_ok(value: dict, options: list) -> bool:
    for opt in options:
        if opt == "" or not isinstance(opt, dict):
            continue
        if all(k in opt and _std(v) in [_std(o) for o in opt[k]] for k, v in value.items()) \
                and all(k in value or "" in vals for k, vals in opt.items()):
            return True
    return False


def _value_ok(doc: dict, value, options: list) -> bool:
    """One parameter's value against its possible answers, by BFCL's rules: its declared type
    (an int is a float; a value of the answers' own type passes), strings and lists of strings
    compared standardized, dicts key by key (missing keys only if optional)."""
    kind = doc.get("type", "any")
    want = PY_TYPES.get(kind, str)
    if kind == "float" and type(value) is int:
        value = float(value)
    typed = [o for o in options if o != ""]
    if type(value) is not want and not (typed and type(value) is type(typed[0])):
        return False
    item = PY_TYPES.get((doc.get("items") or {}).get("type")) if want is list else None
    if want is list and item is not None and type(value) is list:
        kinds = {type(x) for o in typed if isinstance(o, list) for x in o}
        if any(type(x) is not item and type(x) not in kinds for x in value):
            return False
    if type(value) is dict:
        return _dict_ok(value, options)
    if type(value) is list and item is dict:
        return any(isinstance(o, list) and len(o) == len(value)
                   and all(_dict_ok(v, [d]) for v, d in zip(value, o)) for o in options)
    if type(value) is list:
        return [_std(v) for v in value] in [[_std(x) for x in o] for o in typed
                                            if isinstance(o, list)]
    if type(value) is str:
        return _norm(value) in [_norm(o) for o in typed if isinstance(o, str)]
    return value in typed


def call_ok(doc: dict, call: tuple, expected: dict) -> bool:
    """One call (name, arguments) against one ground-truth entry {name: {param: [answers]}}:
    the name equal, the required parameters given, every given parameter declared and among the
    answers, every answer's parameter given unless "" (optional) is among its answers."""
    (name, answers), = expected.items()
    got_name, args = call
    params = doc["parameters"].get("properties", {})
    if got_name != name or not isinstance(args, dict):
        return False
    if any(p not in args for p in doc["parameters"].get("required", [])):
        return False
    for p, v in args.items():
        if p not in params or p not in answers or not _value_ok(params[p], v, answers[p]):
            return False
    return all(p in args or "" in vals for p, vals in answers.items())


def ast_match(functions: list, calls: list, truth: list, parallel: bool) -> bool:
    """BFCL's AST check: as many calls as answers; one call (simple, multiple) or, parallel,
    each answer matched by a distinct call in any order (greedily, answer by answer)."""
    docs = {f["name"]: f for f in functions}
    if len(calls) != len(truth):
        return False
    if not parallel:
        return call_ok(docs[next(iter(truth[0]))], calls[0], truth[0])
    free = list(range(len(calls)))
    for expected in truth:
        doc = docs[next(iter(expected))]
        hit = next((i for i in free if call_ok(doc, calls[i], expected)), None)
        if hit is None:
            return False
        free.remove(hit)
    return True


# ------------------------------------------------------------------------------ decoding

def tool_request(example: dict, parser: str, choice: str, parallel: bool, template: str):
    """The example's ToolRequest, its functions' parameters converted to JSON Schema."""
    from decode.tools.request import parse_tools
    tools = [{"type": "function", "function": {
        "name": f["name"], "description": f.get("description", ""),
        "parameters": to_schema(f.get("parameters", {"type": "dict", "properties": {}}))}}
        for f in example["functions"]]
    body = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}
    return parse_tools(body, parser, True, template)


def prepare(examples: list, model: dict, choice: str, parallel: bool) -> tuple:
    """(kept: [(example, request, prompt ids, automaton)], refused: [{id, message}]): an example
    whose schemas the tool request or the grammar compiler refuses is listed with the words, and
    one whose prompt fills the capacity (or the model's positions)."""
    from decode.constraints.backends import compile_for
    from wedlm_jax.tokenizer import render_chat
    tok, kept, refused = model["tok"], [], []
    for ex in examples:
        try:
            req = tool_request(ex, model["parser"], choice, parallel, model["template"])
            text = render_chat(model["template"], ex["messages"], add_generation_prompt=True,
                               tools=req.template_tools(), special=tok.special)
            automaton = compile_for(req.constraint(), tok, model["config"].vocab_size)
        except Exception as e:  # noqa: BLE001 (the words are the measurement)
            refused.append({"id": ex["id"], "message": f"{type(e).__name__}: {e}"})
            continue
        ids = tok.encode(text)
        if len(ids) >= model["room"]:
            refused.append({"id": ex["id"], "message": f"the prompt's {len(ids)} tokens leave "
                                                       f"no room under {model['room']}"})
            continue
        kept.append((ex, req, ids, automaton))
    return kept, refused


def decode(model: dict, prompts: list, automata: list | None, args) -> tuple:
    """(texts, finishes, n_gen, steps, wall s) of the prompts, `--batch` at a time (with
    `--capacity`, one program for every batch)."""
    from decode.static.static_batch import generate
    dc, batch = model["dc"], args.batch
    texts, finishes, n_gen, steps, t0 = [], [], 0, 0, time.perf_counter()
    stops = set(dc.stop_token_ids)
    for i in range(0, len(prompts), batch):
        part = automata[i:i + batch] if automata is not None else None
        res = generate(model["params"], model["config"], prompts[i:i + batch], dc,
                       automata=part, capacity=args.capacity)
        for ids, row in zip(res.tokens, res.rows):
            texts.append(model["tok"].decode([t for t in ids if t not in stops]))
            finishes.append(row.finish)
            n_gen, steps = n_gen + row.n_gen, steps + row.steps
    return texts, finishes, n_gen, steps, time.perf_counter() - t0


def read_calls(req, text: str) -> tuple:
    """(content, [(name, arguments or None)], malformed count) of one output."""
    import jsonschema

    from decode.tools.calls import split_calls
    content, calls = split_calls(req.fmt, text)
    schemas = {f["name"]: f["parameters"] for f in req.functions}
    parsed, bad = [], 0
    for c in calls:
        name = c["function"]["name"]
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            args = None
        ok = name in schemas and isinstance(args, dict)
        if ok:
            try:
                jsonschema.validate(args, schemas[name])
            except jsonschema.ValidationError:
                ok = False
        bad += not ok
        parsed.append((name, args))
    return content, parsed, bad


def score(ex: dict, req, text: str, finish: str, parallel: bool) -> dict:
    """One output's validity (under the request's choice), malformed calls and AST match."""
    content, calls, bad = read_calls(req, text)
    if req.choice == "auto":
        valid = bad == 0
    else:
        valid = bool(calls) and content is None and bad == 0 and (parallel or len(calls) == 1)
    if ex["answer"] is None:
        ast = not calls
    else:
        ast = bad == 0 and ast_match(ex["functions"], calls, ex["answer"], parallel)
    cut = finish == "length" and not calls and req.choice != "auto"
    return {"id": ex["id"], "valid": valid, "malformed": bad, "ast": ast, "calls": len(calls),
            "cut": cut, "finish": finish, "text": text}


def _pct(n: int, d: int) -> float | None:
    return round(100.0 * n / d, 1) if d else None


def run_set(model: dict, name: str, examples: list, args) -> dict:
    """One set decoded under its tool choice and without the constraint, scored."""
    choice = "auto" if name == "irrelevance" else args.tool_choice
    parallel = name.startswith("parallel")
    kept, refused = prepare(examples, model, choice, parallel)
    prompts = [k[2] for k in kept]
    t0 = time.perf_counter()
    texts, fins, n_gen, steps, _ = decode(model, prompts, [k[3] for k in kept], args)
    free, free_fins, free_gen, free_steps, _ = decode(model, prompts, None, args)
    wall = time.perf_counter() - t0
    rows = [score(ex, req, t, f, parallel) for (ex, req, _, _), t, f in zip(kept, texts, fins)]
    free_rows = [score(ex, req, t, f, parallel)
                 for (ex, req, _, _), t, f in zip(kept, free, free_fins)]
    n = len(rows)
    return {"set": name, "tool_choice": choice, "parallel_tool_calls": parallel,
            "examples": n, "refused": refused,
            "valid_pct": _pct(sum(r["valid"] for r in rows if not r["cut"]),
                              sum(not r["cut"] for r in rows)),
            "answered_pct": _pct(sum(r["valid"] for r in rows), n),
            "malformed": sum(r["malformed"] for r in rows),
            "cut": sum(r["cut"] for r in rows),
            "ast_pct": _pct(sum(r["ast"] for r in rows), n),
            "tokens_per_forward": round(n_gen / steps, 3) if steps else 0.0,
            "tokens_per_forward_free": round(free_gen / free_steps, 3) if free_steps else 0.0,
            "free_valid_pct": _pct(sum(r["valid"] for r in free_rows), n),
            "free_ast_pct": _pct(sum(r["ast"] for r in free_rows), n),
            "prompt_tokens_mean": round(sum(map(len, prompts)) / n, 1) if n else 0.0,
            "wall_s": round(wall, 1), "outputs": rows}


COLUMNS = (("set", "set", 18), ("n", "examples", 4), ("refused", "refused", 7),
           ("valid %", "valid_pct", 7), ("answered %", "answered_pct", 10),
           ("malformed", "malformed", 9), ("cut", "cut", 4),
           ("AST %", "ast_pct", 6), ("tok/fwd", "tokens_per_forward", 7),
           ("free tok/fwd", "tokens_per_forward_free", 12), ("free valid %", "free_valid_pct", 12),
           ("wall s", "wall_s", 7))


def table(results: list) -> str:
    lines = ["  ".join(f"{h:>{w}}" for h, _, w in COLUMNS)]
    for r in results:
        cells = [len(r[k]) if k == "refused" else "-" if r[k] is None else r[k]
                 for _, k, _ in COLUMNS]
        lines.append("  ".join(f"{c:>{w}}" for c, (_, _, w) in zip(cells, COLUMNS)))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the command

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured.bfcl", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", help="the bfcl-eval wheel or a folder with its data files "
                                  f"(default: the newest wheel in {CACHE})")
    p.add_argument("--sets", default=",".join(SETS))
    p.add_argument("--limit", type=int, help="the first N examples of each set")
    p.add_argument("--method", default="verified", choices=("streaming", "verified", "ar"))
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--tool-choice", default="required", choices=("required", "auto"))
    p.add_argument("--parser", default="hermes")
    p.add_argument("--chat-template",
                   help="a Jinja chat template file (overrides the checkpoint's)")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--capacity", type=int, help="tokens a row holds (default: per batch)")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def check_args(args) -> list:
    """The sets asked for; InputError on what cannot run."""
    from decode.tools.formats import FORMATS
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in sets if s not in SETS]
    if unknown or not sets:
        raise InputError(f"--sets: unknown set {', '.join(unknown) or '(none)'} "
                         f"(known: {', '.join(SETS)})")
    if args.parser not in FORMATS:
        raise InputError(f"--parser {args.parser!r}: known: {', '.join(FORMATS)}")
    if not os.path.isdir(args.checkpoint):
        raise InputError(f"--checkpoint {args.checkpoint}: no such folder")
    if args.chat_template and not os.path.isfile(args.chat_template):
        raise InputError(f"--chat-template {args.chat_template}: no such file")
    for flag in ("limit", "window", "max_new_tokens", "batch", "capacity"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    return sets


def load(args) -> dict:
    """The checkpoint, its template and the decode config."""
    from decode.checkpoint import OpenCheckpoint
    from decode.config import DecodeConfig
    try:
        ckpt = OpenCheckpoint.open(args.checkpoint, method=args.method, prog="benchmarks.structured.bfcl")
        config, params, _ = ckpt.load()
    except Exception as e:  # noqa: BLE001
        raise InputError(f"--checkpoint {args.checkpoint}: {e}".splitlines()[0]) from None
    template, source = ckpt.tokenizer.chat_template, "checkpoint"
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            template, source = f.read(), args.chat_template
    elif not template:
        template, source = TEMPLATE, "benchmarks.structured.bfcl.TEMPLATE"
    window = 1 if args.method == "ar" else args.window
    dc = DecodeConfig(method=args.method, window=window, max_new_tokens=args.max_new_tokens,
                      stop_token_ids=tuple(ckpt.default_stop_ids))
    room = args.capacity or config.max_position_embeddings or 1 << 30
    return {"config": config, "params": params, "tok": ckpt.tokenizer, "template": template,
            "template_source": source, "parser": args.parser, "dc": dc, "room": room}


def machine() -> dict:
    import jax
    dev = jax.devices()[0]
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "device": f"{dev.platform}:{dev.device_kind}",
            "jax": jax.__version__, "python": platform.python_version()}


def run(args) -> dict:
    sets = check_args(args)
    read = data_reader(args.data)
    data = {s: load_set(read, s, args.limit) for s in sets}
    model = load(args)
    results, t0 = [], time.perf_counter()
    for s in sets:
        results.append(run_set(model, s, data[s], args))
        print(f"{s}: done in {results[-1]['wall_s']} s", file=sys.stderr, flush=True)
    dc = model["dc"]
    return {"command": "python -m benchmarks.structured.bfcl " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
            "checkpoint": args.checkpoint, "chat_template": model["template_source"],
            "method": dc.method, "window": dc.window, "max_new_tokens": dc.max_new_tokens,
            "parser": args.parser, "tool_choice": args.tool_choice, "limit": args.limit,
            "wall_s": round(time.perf_counter() - t0, 1), "sets": results}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except InputError as e:
        print(f"benchmarks.structured.bfcl: {e}", file=sys.stderr)
        return 2
    print(table(report["sets"]))
    print(f"{report['method']} W={report['window']}, wall {report['wall_s']} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
