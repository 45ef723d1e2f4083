"""Offline batch decoding of a prompt file through the continuous batcher (issue 13 item 4).

    wedlm-decode --checkpoint DIR --input prompts.jsonl --output results.jsonl [--slots 16]

Input: one JSON object per line with `prompt` (a string or a list of token ids) or `messages` (a
chat: the checkpoint's chat template), an optional `id` (string or int; default: the line number)
and optional per-line settings overriding the command line's: max_new_tokens (or max_tokens), tau,
lam, temperature, top_k, top_p, stop (a string or a list of strings), seed. Blank lines are skipped.
Every line is checked (JSON, fields, settings, prompt length against the capacity) before the
checkpoint is read; a bad line is named by its line number and field.

Output: one JSON line per request, written (flushed and fsynced) as the request finishes, in finish
order: id, text, token_ids, finish_reason ('stop' | 'length'), prompt_tokens, completion_tokens,
cached_tokens (prompt rows reused from earlier requests: --page-size), steps (forwards while the
request was live), n_fwd (token slots those forwards processed). A
request the engine fails on is written with finish_reason 'error' and the error, the job goes on
with the others and exits 1 at the end naming how many failed (a rerun does not retry them:
delete their lines to). A stop
string ends the request (host-side: its text is cut before the string, its token_ids end with the
token that completed it, finish_reason 'stop'), as in the OpenAI API.

Resuming: when the output file exists, the ids already in it are skipped, so rerunning the same
command after a crash decodes only what was in flight or not yet started. A torn last line (a crash
mid-write: no newline at the end) is dropped from the file first; any other unreadable line stops
the job without touching the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from decode.config import DecodeConfig, DecodeConfigError, Placement

SETTINGS = ("max_new_tokens", "tau", "lam", "temperature", "top_k", "top_p", "seed",
            "sampling_order")
FIELDS = ("id", "prompt", "messages", "max_tokens", "stop") + SETTINGS


@dataclasses.dataclass
class Item:
    """One validated input line."""
    id: object
    line: int
    prompt_ids: list
    settings: dict          # Request fields except prompt and stop_token_ids
    stop_ids: tuple         # default stops + single-token stop strings (the device stops there)
    stop_strings: tuple     # every stop string of the line (checked on the host, text cut before it)


# ----------------------------------------------------------------------------------- input

def _id_key(value) -> str:
    return json.dumps(value)


def read_input(path: str, tokenizer, defaults: dict, base_stop_ids: list, base_stop_strings: list,
               chat: bool, method: str, window: int, capacity: int | None,
               vocab_size: int | None = None) -> list[Item]:
    """Parse and validate every line; raises DecodeConfigError naming `path:line` and the field."""
    from decode.text import split_stop_strings
    if not os.path.isfile(path):
        raise DecodeConfigError(f"--input {path}: no such file")
    items, seen = [], {}
    with open(path, "rb") as f:
        for lineno, raw_bytes in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                raw = raw_bytes.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DecodeConfigError(f"{where}: not UTF-8 ({e.reason} at byte {e.start + 1} of "
                                        f"the line)") from None
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise DecodeConfigError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise DecodeConfigError(f"{where}: expected a JSON object with 'prompt' or 'messages', "
                                        f"got {type(obj).__name__}")
            unknown = sorted(set(obj) - set(FIELDS))
            if unknown:
                raise DecodeConfigError(f"{where}: field {unknown[0]!r} is unknown; allowed: {', '.join(FIELDS)}")
            rid = obj.get("id", lineno)
            if isinstance(rid, bool) or not isinstance(rid, (str, int)):
                raise DecodeConfigError(f"{where}: field 'id' must be a string or an int, got {rid!r}")
            if _id_key(rid) in seen:
                raise DecodeConfigError(f"{where}: field 'id' {rid!r} repeats line {seen[_id_key(rid)]}")
            seen[_id_key(rid)] = lineno
            ids = _prompt_ids(obj, tokenizer, chat, where)
            if vocab_size is not None and max(ids) >= vocab_size:
                raise DecodeConfigError(f"{where}: field 'prompt' has token id {max(ids)} outside the "
                                        f"vocabulary [0, {vocab_size})")
            settings = dict(defaults)
            if "max_tokens" in obj and "max_new_tokens" in obj:
                raise DecodeConfigError(f"{where}: give one of 'max_tokens' and 'max_new_tokens', not both")
            for k in SETTINGS:
                if k in obj:
                    settings[k] = obj[k]
            if "max_tokens" in obj:
                settings["max_new_tokens"] = obj["max_tokens"]
            stops = obj.get("stop", [])
            if isinstance(stops, str):
                stops = [stops]
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise DecodeConfigError(f"{where}: field 'stop' must be a non-empty string or a list of them, "
                                        f"got {obj.get('stop')!r}")
            try:
                one_token, _ = split_stop_strings(tokenizer, stops)
                stop_ids = tuple(dict.fromkeys(list(base_stop_ids) + one_token))
                DecodeConfig(method=method, window=window, stop_token_ids=stop_ids, **settings)
            except DecodeConfigError as e:
                field = "stop" if "stop" in str(e) else str(e).split()[0]
                if field == "max_new_tokens" and "max_tokens" in obj:
                    field = "max_tokens"
                raise DecodeConfigError(f"{where}: field {field!r}: {e}") from None
            if capacity is not None and len(ids) > capacity:
                raise DecodeConfigError(f"{where}: field 'prompt' has {len(ids)} tokens, longer than the "
                                        f"capacity {capacity}")
            items.append(Item(id=rid, line=lineno, prompt_ids=ids, settings=settings, stop_ids=stop_ids,
                              stop_strings=tuple(dict.fromkeys(list(base_stop_strings) + stops))))
    if not items:
        raise DecodeConfigError(f"--input {path}: no prompts (every line is blank)")
    return items


def _prompt_ids(obj: dict, tokenizer, chat: bool, where: str) -> list:
    if ("prompt" in obj) == ("messages" in obj):
        raise DecodeConfigError(f"{where}: give exactly one of the fields 'prompt' and 'messages'")
    if "messages" in obj:
        msgs = obj["messages"]
        if (not isinstance(msgs, list) or not msgs
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                           and isinstance(m.get("content"), str) for m in msgs)):
            raise DecodeConfigError(f"{where}: field 'messages' must be a non-empty list of "
                                    "{'role': str, 'content': str} objects")
        ids = tokenizer.encode(_render(tokenizer, msgs, where, "messages"))
    else:
        p = obj["prompt"]
        if isinstance(p, str):
            text = _render(tokenizer, [{"role": "user", "content": p}], where, "prompt") if chat else p
            ids = tokenizer.encode(text)
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            ids = list(p)
        else:
            raise DecodeConfigError(f"{where}: field 'prompt' must be a string or a list of token ids, got {p!r}")
    if not ids:
        raise DecodeConfigError(f"{where}: field {'messages' if 'messages' in obj else 'prompt'!r} "
                                "encodes to no tokens")
    return ids


def _render(tokenizer, messages, where, field) -> str:
    try:
        return tokenizer.apply_chat_template(messages)
    except ValueError as e:   # no template, or it fails on these messages (ChatTemplateError)
        raise DecodeConfigError(f"{where}: field {field!r}: {e}") from None


# ----------------------------------------------------------------------------------- output

def check_output(path: str, input_path: str) -> None:
    """The output must be a file we can append to, and not the input."""
    if os.path.isdir(path):
        raise DecodeConfigError(f"--output {path} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise DecodeConfigError(f"--output {path}: folder {parent} does not exist")
    if os.path.exists(path) and os.path.samefile(path, input_path):
        raise DecodeConfigError(f"--output {path} is the input file")
    if os.path.exists(path) and not os.access(path, os.W_OK) or not os.access(parent, os.W_OK):
        raise DecodeConfigError(f"--output {path} is not writable")


def scan_output(path: str) -> tuple[set, int]:
    """(id keys already written, bytes of a torn last line). Raises on an unreadable complete line."""
    if not os.path.exists(path):
        return set(), 0
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1          # everything after the last newline is a torn write
    done = set()
    for lineno, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            done.add(_id_key(obj["id"]))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise DecodeConfigError(f"--output {path}:{lineno} is not a result line of this tool "
                                    "(a JSON object with 'id'); refusing to append to it") from None
    return done, len(data) - end


def drop_torn_tail(path: str, torn: int) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - torn)
        f.flush()
        os.fsync(f.fileno())


def _append(f, record: dict) -> None:
    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


# ----------------------------------------------------------------------------------- the job

def run_job(args) -> int:
    """The `--input/--output` path of wedlm-decode. Returns the exit code."""
    from decode.checkpoint import OpenCheckpoint
    from decode.text import split_stop_strings

    if args.output is None:
        raise DecodeConfigError("--input needs --output (the results file; rerunning resumes it)")
    for flag, on in (("--json", args.json), ("--stream", args.stream), ("--trace", args.trace)):
        if on:
            raise DecodeConfigError(f"{flag} does not apply to --input (results go to --output)")
    defaults = dict(max_new_tokens=args.max_new_tokens, tau=args.tau, lam=args.lam,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    sampling_order=args.sampling_order)
    DecodeConfig(method=args.method, window=args.window, refill=args.refill,
                 prefill_chunk=args.prefill_chunk, **defaults)
    for name in ("slots", "steps_per_call"):
        v = getattr(args, name)
        if v < 1:
            raise DecodeConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    placement = Placement.from_args(args)
    if args.slots % placement.batch_shards:
        raise DecodeConfigError(f"--slots {args.slots} must be a multiple of the mesh's data x "
                                f"fsdp = {placement.batch_shards}")
    ckpt = OpenCheckpoint.open(args.checkpoint, placement, method=args.method,   # no weights yet
                               mask_token_id=args.mask_token_id, default_stops=not args.no_default_stops)
    model_config, tokenizer = ckpt.config, ckpt.tokenizer
    args.mask_token_id = ckpt.mask_token_id
    cli_stop_ids, _ = split_stop_strings(tokenizer, args.stop)
    base_ids = list(ckpt.default_stop_ids) + list(args.stop_id) + cli_stop_ids
    items = read_input(args.input, tokenizer, defaults, list(dict.fromkeys(base_ids)), list(args.stop),
                       args.chat, args.method, args.window, args.capacity, model_config.vocab_size)
    check_output(args.output, args.input)
    done, torn = scan_output(args.output)
    todo = [it for it in items if _id_key(it.id) not in done]
    skipped = len(items) - len(todo)
    if torn:
        drop_torn_tail(args.output, torn)
        print(f"wedlm-decode: dropped a torn last line ({torn} bytes) from {args.output}", file=sys.stderr)
    if skipped:
        print(f"wedlm-decode: {skipped} of {len(items)} requests already in {args.output}; "
              f"decoding the other {len(todo)}", file=sys.stderr)
    if not todo:
        print("wedlm-decode: nothing to do", file=sys.stderr)
        return 0
    # from every line, not only those left: a rerun compiles the same programs and decodes alike
    capacity = args.capacity or max(len(it.prompt_ids) + it.settings["max_new_tokens"] for it in items)

    from decode.batching import Batcher
    from decode.decoder import Decoder, Request
    config, params, mesh = ckpt.load()
    decoder = Decoder(params, config, method=args.method, window=args.window, slots=args.slots,
                      capacity=capacity, steps_per_call=args.steps_per_call, refill=args.refill,
                      prefill_chunk=args.prefill_chunk, allow_long=args.allow_long,
                      page_size=placement.page_size, num_pages=placement.num_pages,
                      mask_token_id=args.mask_token_id, mesh=mesh, dtype=placement.dtype,
                      attention=placement.attention, kv_tile=placement.kv_tile)
    requests = []
    for it in todo:
        req = Request(prompt=tuple(it.prompt_ids), stop_token_ids=it.stop_ids, **it.settings)
        try:
            requests.append(decoder.check_request(req))
        except DecodeConfigError as e:
            raise DecodeConfigError(f"{args.input}:{it.line}: {e}") from None
    with open(args.output, "a", encoding="utf-8") as out:
        stats = _decode_all(Batcher(decoder), todo, requests, tokenizer, out)
    _summary(stats, args, skipped)
    if stats["errors"]:
        print(f"wedlm-decode: {stats['errors']} request(s) failed in the engine (finish_reason "
              f"'error' in {args.output}); the others were written", file=sys.stderr)
        return 1
    return 0


def _decode_all(batcher, todo, requests, tokenizer, out) -> dict:
    from tqdm import tqdm

    from decode.text import TextStream, stop_at_strings
    live = {}   # request id -> (item, TextStream of its completion)
    stats = dict(requests=0, tokens=0, steps=0, n_fwd=0, tokens_counted=0, wall_s=0.0, errors=0)
    bar = tqdm(total=len(todo), unit="req", desc="wedlm-decode", file=sys.stderr, dynamic_ncols=True)

    def on_tokens(rid, new):
        item, text = live[rid]
        if not text.stopped:
            text.add(new)
            if text.stopped:
                batcher.cancel(rid)

    def on_finish(fin):
        item, text = live.pop(fin.request_id)
        if fin.finish == "error":       # this request alone; the job goes on
            _append(out, dict(id=item.id, text="", token_ids=[], finish_reason="error",
                              error=fin.error, prompt_tokens=len(item.prompt_ids),
                              completion_tokens=0, steps=fin.steps, n_fwd=fin.n_fwd))
            stats["errors"] += 1
            bar.update(1)
            return
        ids, text, stopped = stop_at_strings(tokenizer, list(fin.tokens), item.stop_strings)
        finish = "stop" if stopped else fin.finish
        if finish == "cancelled":
            raise RuntimeError(f"request {item.id!r} was cancelled without a stop string")
        _append(out, dict(id=item.id, text=text, token_ids=ids, finish_reason=finish,
                          prompt_tokens=len(item.prompt_ids), completion_tokens=len(ids),
                          cached_tokens=fin.cached_tokens, steps=fin.steps, n_fwd=fin.n_fwd))
        stats["requests"] += 1
        stats["tokens"] += len(ids)
        if fin.steps:   # a slot cancelled at a stop string may come back without its counts
            stats["steps"] += fin.steps
            stats["n_fwd"] += fin.n_fwd
            stats["tokens_counted"] += len(fin.tokens)
        bar.update(1)
        bar.set_postfix_str(f"{stats['tokens'] / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")

    for item, req in zip(todo, requests):
        rid = batcher.submit(req, on_tokens=on_tokens, on_finish=on_finish)
        live[rid] = (item, TextStream(tokenizer, item.stop_strings))
    t0 = time.perf_counter()
    try:
        while batcher.step():
            pass
    finally:
        bar.close()
    stats["wall_s"] = time.perf_counter() - t0
    if live:
        raise RuntimeError(f"the batcher went idle with {len(live)} requests unfinished")
    return stats


def _summary(stats: dict, args, skipped: int) -> None:
    n, tok, wall = stats["requests"], stats["tokens"], stats["wall_s"]
    counted = stats["tokens_counted"]   # the tokens of the requests whose forwards are known
    tpf = counted / stats["steps"] if stats["steps"] else 0.0
    pc = counted / stats["n_fwd"] if stats["n_fwd"] else 0.0
    print(f"[{args.method}] {n} requests ({skipped} skipped), {tok} tokens in {wall:.1f} s (compile "
          f"included): {tok / max(wall, 1e-9):.1f} tokens/s, {tpf:.2f} tokens/forward, p_cache {pc:.3f} "
          f"-> {args.output}", file=sys.stderr)
