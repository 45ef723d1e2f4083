"""wedlm-decode: decode text prompts with a checkpoint folder (Orbax or Hugging Face).

    wedlm-decode --checkpoint DIR --prompt "Count: 1, 2, 3," --method streaming --window 16 --json
    wedlm-decode --checkpoint DIR --prompts-file prompts.jsonl --chat --method ar --stream

prompts.jsonl: one prompt per line, either a JSON string or an object with "prompt" (or "text")
or "messages" (a chat; implies the chat template; an optional "tools" list goes to the template,
rendered by `wedlm_jax.tokenizer` as in training). `--json` prints one JSON document with, per
prompt, the ids, the text and the statistics, and the totals. `--stream` prints text as it is
committed (a host callback from the decode loop); the result is the same as without it.
`--trace FILE.html|FILE.png` also runs the same steps one at a time (`decode.static.static_batch.trace_steps`)
and draws each step's window (`decode.static.trace`): at most 4 prompts in HTML, 1 in PNG (matplotlib).
`--input/--output` is the batch job (`decode.jobs.batch_job`, also on several hosts; with
`--ray [ADDRESS|local] --replicas N`, replicas on a Ray cluster: `decode.jobs.ray_job`); `--dry-run
--topology T` compiles the door's programs for a TPU topology from config.json alone (`decode.compile.aot`).
"""

from __future__ import annotations

import argparse
import json
import sys

from wedlm_jax.runtime import interrupts
interrupts.early("wedlm-decode", __name__)   # Ctrl-C during the imports below: one line, 130

from decode.options import HelpFormatter  # noqa: E402
from decode.lora_options import LoraOptions  # noqa: E402
from decode.config import (DecodeConfigError, DoorOptions, EngineOptions, Placement,  # noqa: E402
                           add_decoding_arguments)
from decode.checkpoint import OpenCheckpoint  # noqa: E402
from decode.text import (ChatTemplateError, json_lines, load_tokenizer,  # noqa: E402
                         split_stop_strings, stop_at_strings)
from wedlm_jax.tokenizer import TextError  # noqa: E402
from wedlm_jax.runtime import compile_cache, distributed  # noqa: E402
from decode.tools.formats import FORMATS  # noqa: E402 (a jax-free table)
from decode.jobs import ray_job  # noqa: E402 (its arguments only: ray is imported when --ray runs)


EPILOG = """a constrained prompt: --json-schema row.json | --json-object | --regex RE | --choice A --choice B
a constrained line of an --input file (the server's fields: response_format, structured_outputs,
guided_json / guided_regex / guided_choice):
  {"id": 7, "prompt": "Table:\\n...JSON lines:\\n", "guided_json": {"type": "object", ...}}"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wedlm-decode", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter, epilog=EPILOG)
    p.add_argument("--checkpoint", required=True, help="Orbax or Hugging Face checkpoint folder")
    src = p.add_mutually_exclusive_group()   # one is required, except with --dry-run
    src.add_argument("--prompt", help="one text prompt")
    src.add_argument("--prompts-file", help="JSONL: strings or objects with prompt/text/messages")
    src.add_argument("--input", help="batch job (decode.jobs.batch_job): JSONL of prompt/messages objects "
                                     "with optional id and settings; results go to --output")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template")
    add_decoding_arguments(p, "wedlm-decode")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    p.add_argument("--json", action="store_true", help="print ids, text and statistics as JSON")
    con = p.add_argument_group("structured output (one of; --input lines carry their own "
                               "response_format / structured_outputs / guided_* fields)")
    con.add_argument("--json-schema", metavar="FILE", help="the output is JSON matching this schema")
    con.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    con.add_argument("--regex", help="the output matches this regular expression")
    con.add_argument("--choice", action="append", help="the output is one of these strings "
                     "(repeatable)")
    p.add_argument("--stream", action="store_true", help="print text as it is committed")
    p.add_argument("--trace", default=None, metavar="FILE.html|FILE.png",
                   help="draw each decoding step's window into this file (streaming, block, ar)")
    p.add_argument("--output", help="--input's results (JSONL, one line per request as it finishes; "
                                    "a rerun skips the ids already there)")
    p.add_argument("--model-name", default=None,
                   help="--input: the base model's name a line's `model` may give (default: the "
                        "checkpoint folder's name), as wedlm-serve's --model-name")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(FORMATS),
                   help="--input: lines with `tools` read their calls in this format (hermes: "
                        "Qwen, WeDLM-8B-Instruct); the output line gains tool_calls")
    p.add_argument("--metrics-file", default=None, metavar="PATH",
                   help="--input: write the job's counters and histograms here as JSON at the end "
                        "(decode/metrics.py's names; the summary line prints them too)")
    LoraOptions.add_arguments(p, "wedlm-decode")
    Placement.add_arguments(p)
    Placement.add_dry_run_arguments(p, "wedlm-decode (--slots x --capacity, default capacity 2048)")
    distributed.add_arguments(p)     # --input on several hosts: each decodes its share of the lines
    ray_job.add_arguments(p)         # --input on a Ray cluster: replicas take blocks as they free up
    compile_cache.add_arguments(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """wedlm-decode's arguments, as the command line would give them (for calling from Python,
    e.g. `decode.jobs.ray_job.run_ray_job(parse_args([...]))`)."""
    return _parser().parse_args(argv)


PROMPT_KEYS = frozenset({"prompt", "text", "messages", "tools"})


def _read_prompts(args, tokenizer) -> list[tuple[str, list[int]]]:
    """[(prompt text as fed, ids)]; a bad --prompts-file line is named FILE:LINE (1-based)."""
    items = []   # (where, item)
    if args.prompt is not None:
        items.append(("--prompt", args.prompt))
    else:
        items += [(f"{args.prompts_file}:{n}", obj) for n, obj in json_lines(args.prompts_file)]
    out = []
    for where, item in items:
        messages = None
        if isinstance(item, dict):
            unknown = sorted(set(item) - PROMPT_KEYS)
            if unknown:
                raise DecodeConfigError(
                    f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a --prompts-file "
                    f"line holds {', '.join(sorted(PROMPT_KEYS))} (per-request settings go in an "
                    "--input file)")
            if "messages" in item:
                messages = item["messages"]
            else:
                item = item.get("prompt", item.get("text"))
        if messages is None and not isinstance(item, str):
            raise DecodeConfigError(f"{where}: expected a string or an object with 'prompt', 'text' "
                                    f"or 'messages', got {item!r}")
        try:
            if messages is not None:
                text = tokenizer.apply_chat_template(messages, tools=item.get("tools"))
            elif args.chat:
                text = tokenizer.apply_chat_template([{"role": "user", "content": item}])
            else:
                text = item
            ids = tokenizer.encode(text)
        except (ChatTemplateError, TextError) as e:
            raise DecodeConfigError(f"{where}: {e}") from None
        out.append((text, ids))
    return out


def constraint_of(args):
    """The constraint the flags ask for (decode.constraints.spec), or None."""
    from decode.constraints.spec import Constraint
    given = [f for f in ("json_schema", "json_object", "regex", "choice") if getattr(args, f)]
    if len(given) > 1:
        raise DecodeConfigError(f"--{given[0].replace('_', '-')} and --{given[1].replace('_', '-')}: "
                                "give one constraint")
    if given and args.input is not None:
        raise DecodeConfigError(f"--{given[0].replace('_', '-')} goes with --prompt / --prompts-file; "
                                "--input lines carry their own response_format or guided_* field")
    if args.json_schema:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise DecodeConfigError(f"--json-schema {args.json_schema}: {e.strerror}") from None
        return Constraint.json_schema(text, f"--json-schema {args.json_schema}")
    if args.json_object:
        return Constraint.json_object("--json-object")
    if args.regex is not None:
        return Constraint.regex(args.regex, "--regex")
    if args.choice:
        return Constraint.choice(args.choice, "--choice")
    return None


def run(args) -> dict:
    from decode.static.static_batch import generate

    opts = DoorOptions.from_args(args)   # every setting checked before the checkpoint is read
    base, placement = opts.decode_config, opts.placement
    batching_only = [f"--{n.replace('_', '-')}" for n in ("slots", "steps_per_call", "window_policy")
                     if getattr(opts.engine, n) != getattr(EngineOptions(), n)]
    if placement.page_size:
        batching_only.append("--page-size")
    if batching_only:
        raise DecodeConfigError(f"{batching_only[0]} applies to continuous batching: --input and "
                                "wedlm-serve (--prompt / --prompts-file decode one static batch)")
    read = {}

    def read_inputs(tokenizer):
        try:
            read["stops"] = split_stop_strings(tokenizer, args.stop)
        except DecodeConfigError as e:
            raise DecodeConfigError(f"--stop: {e}") from None
        read["prompts"] = _read_prompts(args, tokenizer)
        constraint = constraint_of(args)
        if constraint is not None:
            from decode.constraints.backends import compile_for
            read["automaton"] = compile_for(constraint, tokenizer, None,
                                            opts.engine.constraint_backend)
        if args.trace is not None:
            from decode.static.trace import check_request
            check_request(args.trace, args.method, len(read["prompts"]))
            if placement != Placement(attention=placement.attention, kv_tile=placement.kv_tile):
                raise DecodeConfigError("--trace steps through the decode on one device in "
                                        "float32; leave --dtype, --mesh, --quantize and "
                                        "--kv-dtype at their defaults with it")
    tokenizer = load_tokenizer(args.checkpoint, args.chat_template)
    read_inputs(tokenizer)          # the prompts and stops, refused before config.json is read
    ckpt = OpenCheckpoint.from_args(args, placement, tokenizer=tokenizer)
    prompts = read["prompts"]
    stop_ids, cut_strings = read["stops"]
    config, params, _ = ckpt.load()
    stop_ids = list(dict.fromkeys(list(ckpt.default_stop_ids) + stop_ids + list(args.stop_id)))
    dc = base.replace(stop_token_ids=tuple(stop_ids))

    on_commit = None
    if args.stream:
        seen: dict = {}
        shown: dict = {}

        def on_commit(row, ids):
            seen[row] = seen.get(row, []) + ids
            text = tokenizer.decode(seen[row])
            delta = text[len(shown.get(row, "")):]
            shown[row] = text
            if delta:
                prefix = f"[{row}] " if len(prompts) > 1 else ""
                sys.stderr.write(prefix + delta + ("\n" if prefix else ""))
                sys.stderr.flush()

    res = generate(params, config, [ids for _, ids in prompts], dc, capacity=args.capacity,
                   mask_token_id=ckpt.mask_token_id, on_commit=on_commit,
                   allow_long=args.allow_long, placement=placement,
                   automata=([read["automaton"]] * len(prompts) if "automaton" in read else None))
    if args.stream:
        sys.stderr.write("\n")
    rows = []
    for (text, pids), ids, st in zip(prompts, res.tokens, res.rows):
        ids, out_text, cut = stop_at_strings(tokenizer, ids, cut_strings)
        rows.append(dict(prompt=text, prompt_ids=pids, ids=ids, text=out_text,
                         finish="stop" if cut else st.finish,
                         stats=dict(steps=st.steps, n_gen=st.n_gen, token_slots=st.token_slots,
                                    tokens_per_forward=st.tokens_per_forward, p_cache=st.p_cache)))
    total = dict(method=res.method, steps=res.steps, n_gen=res.n_gen, token_slots=res.token_slots,
                 tokens_per_forward=res.tokens_per_forward, p_cache=res.p_cache,
                 loop_iterations=res.loop_iterations, wall_s=res.wall_s,
                 tokens_per_s=res.tokens_per_s, compile_s=res.compile_s, stop_token_ids=stop_ids,
                 interrupted=res.interrupted)
    out = dict(results=rows, total=total)
    if args.trace is not None and not res.interrupted:
        out["trace"] = _write_trace(args, tokenizer, prompts, config, params, dc, res,
                                    ckpt.mask_token_id)
    return out


def _write_trace(args, tokenizer, prompts, config, params, dc, res, mask_token_id) -> dict:
    """Run the same decode step by step and draw it; the trace's commits must equal the result."""
    from decode.static.static_batch import trace_steps
    from decode.static.trace import committed_ids, trace_view, write_trace
    trace, final = trace_steps(params, config, [ids for _, ids in prompts], dc, capacity=args.capacity,
                               mask_token_id=mask_token_id)
    settings = (f"method {dc.method}, W = {dc.window}, tau = {dc.tau}, lambda = {dc.lam}, "
                f"temperature = {dc.temperature}, max_new_tokens = {dc.max_new_tokens}")
    views = []
    for r, (text, _) in enumerate(prompts):
        steps = trace_view(trace, final, r, dc.method)
        if committed_ids(steps) != list(res.tokens[r]):
            raise RuntimeError(f"trace of prompt {r} commits other tokens than the decode "
                               f"(a step-by-step / compiled-loop mismatch)")
        views.append(dict(prompt=text, steps=steps, settings=settings))
    path = write_trace(args.trace, views, tokenizer)
    print(f"wrote trace {path} ({sum(len(v['steps']) for v in views)} steps)", file=sys.stderr)
    return dict(path=path, steps=[len(v["steps"]) for v in views])


def print_texts(results: list, shown: bool) -> None:
    """Each prompt's text on stdout, after a "=== [i] ===" line when there are several; not again
    when --stream already showed it on this terminal (stderr and stdout both the screen)."""
    if shown:
        return
    for i, r in enumerate(results):
        if len(results) > 1:
            print(f"=== [{i}] ===")
        print(r["text"])


LOADING = "wedlm-decode: interrupted (Ctrl-C) while loading or compiling; nothing was decoded"


def main(argv=None) -> int:
    """The command; Ctrl-C at any moment ends it with 130 and one line (wedlm_jax.runtime.interrupts)."""
    with interrupts.guard("wedlm-decode", LOADING):
        return _main(argv)


def _main(argv=None) -> int:
    from wedlm_jax.runtime import platforms
    platforms.choose()      # no backend whose hardware is absent (a libtpu lock, a CUDA error)
    from wedlm_jax.runtime.failures import disk_full, out_of_memory
    parser = _parser()
    args = parser.parse_args(argv)
    if args.prompt is None and args.prompts_file is None and args.input is None and not args.dry_run:
        parser.error("one of the arguments --prompt --prompts-file --input is required")
    try:
        ray_job.check_ray_flags(args)         # a flag that needs another: refused without it
        Placement.check_dry_run_flags(args)
        if args.dry_run:
            from decode.compile.aot import dry_run_door
            return dry_run_door(args, "wedlm-decode")
        if args.ray is not None:     # the replicas compile (each with --compile-cache), not this driver
            stats = ray_job.run_ray_job(args)
            return 1 if stats["errors"] else 0
        compile_cache.enable(args.compile_cache)
        constraint_of(args)             # a bad constraint flag: one line, before any loading
        if args.input is not None:
            from decode.jobs.batch_job import run_job
            return run_job(args)
        for flag, given in (("--output", args.output), ("--metrics-file", args.metrics_file),
                            ("--tool-call-parser", args.tool_call_parser),
                            ("--model-name", args.model_name),
                            ("--enable-lora", args.enable_lora or None)):
            if given is not None:
                raise DecodeConfigError(f"{flag} goes with --input (the batch job)")
        if distributed.settings(args, "wedlm-decode") is not None:
            raise DecodeConfigError("several processes decode a file: --input (--prompt and "
                                    "--prompts-file run in one process)")
        out = run(args)
    except (DecodeConfigError, ValueError, FileNotFoundError) as e:  # TraceError is a ValueError
        print(f"wedlm-decode: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # once decoding runs, Ctrl-C ends it with the output kept (below)
        print("\n" + LOADING, file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a full disk or memory is one line; anything else a bug
        oom = out_of_memory(e)
        if oom is not None:
            print(f"wedlm-decode: error: out of device memory: {oom}; lower --capacity, "
                  "--slots or --window, or use --dtype bfloat16 / a --mesh", file=sys.stderr)
            return 1
        full = disk_full(e)
        if full is None:
            raise
        kept = (f"every result line already in {args.output} is complete and kept (a torn last "
                "line is dropped on the rerun); free space and rerun the same command to go on"
                if args.input is not None else "nothing was written")
        print(f"wedlm-decode: error: disk full: {full}; {kept}", file=sys.stderr)
        return 1
    interrupts.say("wedlm-decode: interrupted (Ctrl-C) while printing the results")
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print_texts(out["results"], shown=args.stream and sys.stdout.isatty() and sys.stderr.isatty())
        t = out["total"]
        print(f"[{t['method']}] {t['n_gen']} tokens, {t['steps']} forwards, "
              f"{t['tokens_per_forward']:.2f} tokens/forward, p_cache {t['p_cache']:.3f}, "
              f"{t['tokens_per_s']:.1f} tokens/s (compile {t['compile_s']:.1f} s)", file=sys.stderr)
    if out["total"]["interrupted"]:
        print("wedlm-decode: interrupted (Ctrl-C): the text above is what was decoded so far",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
