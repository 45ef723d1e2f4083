"""Structured outputs end to end through wedlm-serve: MaskBench's real-world schemas (by default
its Glaiveai2K files) sent as `response_format` json_schema requests to a server on the demo
model (or any checkpoint), with the official openai client. Every 200 must validate under its
schema with `jsonschema` (format checks on) unless it finished at max_tokens; a schema the
server cannot enforce must be a 400 naming a field; nothing may be a 5xx.

    python -m benchmarks.structured.serve_schemas ../shared/data/maskbench-dev.tar.xz [--checkpoint DIR]
        [--prefix Glaiveai2K] [--limit N] [--seed 0] [--max-tokens 96] [--out FILE.json]

Prints the counts (valid 200s, 200s cut at max_tokens, 400s, 5xx, invalid 200s: the last two
must be 0), the backends that served, and the seconds per request.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics
import sys
import time

PROMPT = "Answer with one JSON value that matches the schema.\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.structured.serve_schemas")
    ap.add_argument("inputs", nargs="+", help="MaskBench folders or archives")
    ap.add_argument("--checkpoint", default="demo/model")
    ap.add_argument("--prefix", default="Glaiveai2K", help="file-name prefix of the schemas to send")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def start_server(checkpoint: str):
    """(openai client, the server): `wedlm-serve` on a free 127.0.0.1 port, once ready."""
    import openai
    from benchmarks.doors.serve import Server
    server = Server(checkpoint, ["--slots", "4", "--window", "8", "--capacity", "1024",
                                 "--lazy-compile", "--metrics-public"]).wait_ready(900)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    return client, server


def backends_served(url: str) -> dict:
    """wedlm:constrained_requests_total by backend, from the server's /metrics."""
    import httpx
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("wedlm:constrained_requests_total{"):
            out[line.split('backend="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def one(client, schema, max_tokens: int) -> dict:
    """One request's outcome: status (valid, cut, refused, server_error, invalid), seconds."""
    import jsonschema
    import openai
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    t0 = time.perf_counter()
    try:
        out = client.completions.create(model="demo", prompt=PROMPT + json.dumps(schema)[:600] + "\n",
                                        max_tokens=max_tokens, temperature=0,
                                        extra_body={"response_format": rf})
    except openai.BadRequestError as e:
        return dict(status="refused", param=(e.body or {}).get("param"),
                    seconds=time.perf_counter() - t0)
    except openai.APIStatusError as e:
        return dict(status="server_error", code=e.status_code, seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    choice = out.choices[0]
    if choice.finish_reason == "length":
        return dict(status="cut", seconds=seconds)
    try:
        jsonschema.validate(json.loads(choice.text), schema,
                            format_checker=jsonschema.FormatChecker())
        return dict(status="valid", seconds=seconds)
    except (ValueError, jsonschema.ValidationError) as e:
        return dict(status="invalid", text=choice.text[:300], error=str(e)[:300],
                    seconds=seconds)


def main(argv=None) -> int:
    from benchmarks.structured.maskbench import BadInput, load_inputs
    args = parse_args(argv)
    try:
        docs = [(n, d) for n, d in load_inputs(args.inputs) if n.split("/")[-1].startswith(
            args.prefix)]
    except BadInput as e:
        print(f"serve_schemas: error: {e}", file=sys.stderr)
        return 2
    if args.limit:
        import random
        docs = random.Random(args.seed).sample(docs, min(args.limit, len(docs)))
    client, server = start_server(args.checkpoint)
    rows, t0 = [], time.perf_counter()
    try:
        for name, doc in docs:
            rows.append(dict(file=name, **one(client, doc["schema"], args.max_tokens)))
        backends = backends_served(server.url)
    finally:
        server.stop()
    counts = collections.Counter(r["status"] for r in rows)
    secs = [r["seconds"] for r in rows]
    print(f"{len(rows)} {args.prefix} schemas through wedlm-serve ({args.checkpoint}), "
          f"max_tokens {args.max_tokens}, {time.perf_counter() - t0:.0f} s")
    for k in ("valid", "cut", "refused", "server_error", "invalid"):
        print(f"  {k:<13}{counts.get(k, 0):>6}  {100 * counts.get(k, 0) / max(1, len(rows)):5.1f}%")
    print(f"  backends: {backends}; seconds per request p50 {statistics.median(secs):.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command="python -m benchmarks.structured.serve_schemas " + " ".join(
                argv if argv is not None else sys.argv[1:]), date=str(datetime.date.today()),
                counts=dict(counts), backends=backends, rows=rows), f, indent=1)
    return 1 if counts.get("server_error") or counts.get("invalid") else 0


if __name__ == "__main__":
    raise SystemExit(main())
