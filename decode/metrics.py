"""Prometheus metrics of wedlm-serve (`GET /metrics`) and the batch job (its summary and
--metrics-file), in a registry of their own (`prometheus_client.CollectorRegistry`, never the
process-wide one), plus the one INFO line logged per finished request.

vLLM's names where the meaning is the same, so its dashboards work (labelled `model_name`):

    vllm:num_requests_running, vllm:num_requests_waiting      gauges, read at scrape time
    vllm:kv_cache_usage_perc      paged cache: pages held by live requests / the pool; a dense
                                  cache: live slots / slots (each slot holds its rows)
    vllm:prompt_tokens_total, vllm:generation_tokens_total    counters (prompt: once prefilled)
    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total   prompt tokens looked up / reused
                                  (a paged cache with prefix reuse; zero otherwise)
    vllm:num_preemptions_total    requests sent back to the queue to free pages
    vllm:request_success_total{finished_reason}   stop | length | abort (cancelled) | error
    vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds,
    vllm:time_per_output_token_seconds (per request: its first to its last ids handed out / the
                                  tokens after the first chunk; none when one chunk held them all),
    vllm:request_prompt_tokens, vllm:request_generation_tokens       histograms

and WeDLM's own (labelled `method`):

    wedlm:tokens_per_forward      histogram per request: generated tokens / forwards
    wedlm:p_cache                 histogram per request: generated tokens / token slots processed
    wedlm:forwards_per_request    histogram per request: forwards while it was live
    wedlm:verified_drafted_tokens_total, wedlm:verified_accepted_tokens_total   (method verified)
    wedlm:window_calls{window}    device calls run at each rung of the window ladder (with
                                  --window-policy load)
    wedlm:constrained_requests_total   requests decoded under a structured-output constraint,
                                  labelled `backend` too (device: the automaton's tables in the
                                  decode loop; host: llguidance's parser)

Everything is recorded on the thread that runs the Batcher from what its callbacks already carry
(the ids handed out, `Finished`'s counts read in the host copy the Batcher makes anyway): no
device read of its own. The gauges read host state only, when scraped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

from decode.config import DecodeConfigError
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

log = logging.getLogger("wedlm-serve")

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
COUNT_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PER_FORWARD_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
P_CACHE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
FORWARD_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# the Batcher's finishes in vLLM's words (a request cancelled at a stop string is named 'stop'
# by whoever cancelled it)
REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@dataclasses.dataclass
class Track:
    """One request, as the metrics follow it (touched by the Batcher's thread only, once made)."""
    n_prompt: int
    submitted: float
    prompt: tuple | None = None     # its ids, kept only to log its text (--log-prompts)
    first: float | None = None      # when its first ids were handed out
    last: float = 0.0               # when its latest ids were
    n_out: int = 0                  # ids handed out so far
    n_first: int = 0                # ids in its first chunk


class ServerMetrics:
    """The metrics of one Batcher (a server's or a batch job's). `track(request)` when it is
    submitted, `counting(track, on_tokens)` around its token callback, `finished(track, fin)` when
    it ends; `exposition()` is the Prometheus text, `snapshot()` the same as a JSON-able dict."""

    def __init__(self, batcher, model_name: str, method: str, log_prompts: bool = False,
                 tokenizer=None):
        self.batcher, self.log_prompts, self.tokenizer = batcher, log_prompts, tokenizer
        self.registry = r = CollectorRegistry()
        m, w = ["model_name"], ["method"]

        def gauge(name, doc, read):
            Gauge(name, doc, m, registry=r).labels(model_name).set_function(read)
        running, waiting, usage = GAUGES
        gauge(running, "Requests in a slot", lambda: batcher.num_active)
        gauge(waiting, "Requests waiting for a slot", lambda: batcher.num_waiting)
        gauge(usage, "KV-cache in use, 0 to 1 (paged: pages held by live requests; dense: live "
              "slots)", self.cache_usage)
        c = lambda name, doc, labels=m: Counter(name, doc, labels, registry=r)  # noqa: E731
        h = lambda name, doc, buckets, labels=m: Histogram(name, doc, labels, registry=r,  # noqa: E731
                                                           buckets=buckets)
        self.prompt_tokens = c("vllm:prompt_tokens", "Prompt tokens prefilled").labels(model_name)
        self.generation_tokens = c("vllm:generation_tokens", "Tokens generated").labels(model_name)
        self.prefix_queries = c("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                "cache").labels(model_name)
        self.prefix_hits = c("vllm:prefix_cache_hits", "Prompt tokens reused from the prefix "
                             "cache").labels(model_name)
        self.preemptions = c("vllm:num_preemptions", "Requests preempted to free pages").labels(
            model_name)
        self.success = c("vllm:request_success", "Requests finished, by reason",
                         ["model_name", "finished_reason"])
        self.model_name = model_name
        self.ttft = h("vllm:time_to_first_token_seconds", "Submit to first tokens",
                      LATENCY_BUCKETS).labels(model_name)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Submit to finish",
                     LATENCY_BUCKETS).labels(model_name)
        self.tpot = h("vllm:time_per_output_token_seconds", "First to last chunk / tokens after the "
                      "first chunk, per request", TOKEN_TIME_BUCKETS).labels(model_name)
        self.request_prompt = h("vllm:request_prompt_tokens", "Prompt tokens per request",
                                COUNT_BUCKETS).labels(model_name)
        self.request_generation = h("vllm:request_generation_tokens", "Generated tokens per request",
                                    COUNT_BUCKETS).labels(model_name)
        self.tokens_per_forward = h("wedlm:tokens_per_forward", "Generated tokens / forwards, per "
                                    "request", PER_FORWARD_BUCKETS, w).labels(method)
        self.p_cache = h("wedlm:p_cache", "Generated tokens / token slots processed, per request",
                         P_CACHE_BUCKETS, w).labels(method)
        self.forwards = h("wedlm:forwards_per_request", "Forwards while the request was live",
                          FORWARD_BUCKETS, w).labels(method)
        self.drafted = c("wedlm:verified_drafted_tokens", "Verified decoding: drafted tokens checked",
                         w).labels(method)
        self.accepted = c("wedlm:verified_accepted_tokens", "Verified decoding: drafted tokens accepted",
                          w).labels(method)
        self.constrained = c("wedlm:constrained_requests", "Requests decoded under a structured-output "
                             "constraint, by backend (device tables or the host parser)",
                             list(w) + ["backend"])
        self.method = method
        policy = getattr(batcher, "window_policy", None)
        if policy is not None:      # --window-policy load: the device calls run at each rung
            calls = Gauge("wedlm:window_calls", "Device calls at each window of the ladder "
                          "(--window-policy load)", ["method", "window"], registry=r)
            for rung in batcher.decoder.rungs():
                calls.labels(method, str(rung)).set_function(
                    lambda rung=rung: getattr(policy, "chosen", {}).get(rung, 0))

    # --------------------------------------------------------------------------- recording

    def cache_usage(self) -> float:
        b = self.batcher
        pool = getattr(b, "pool", None)
        if pool is not None:
            return pool.num_held / pool.num_pages
        slots = b.decoder.slots
        return b.num_active / slots if slots else 0.0

    @property
    def prefix_cache(self) -> bool:
        return getattr(self.batcher, "pool", None) is not None and self.batcher.prefix_reuse

    def track(self, request) -> Track:
        return Track(len(request.prompt), time.perf_counter(),
                     tuple(request.prompt) if self.log_prompts else None)

    def count_constrained(self, backend: str, n: int = 1) -> None:
        """Count a request admitted under a constraint on `backend` (device or host)."""
        self.constrained.labels(self.method, backend).inc(n)

    def counting(self, track: Track, on_tokens):
        """`on_tokens` with the request's ids counted first (first ids: its prompt and TTFT)."""
        def call(rid, new):
            now = time.perf_counter()
            if track.first is None:
                track.first, track.n_first = now, len(new)
                self.prompt_tokens.inc(track.n_prompt)
                self.ttft.observe(now - track.submitted)
            track.last = now
            track.n_out += len(new)
            self.generation_tokens.inc(len(new))
            if on_tokens is not None:
                on_tokens(rid, new)
        return call

    def finished(self, track: Track, fin, reason: str | None = None) -> None:
        """Record a request's end from its `Finished`; `reason` names a cancel's cause ('stop':
        a stop string), else the Batcher's finish is used (REASONS)."""
        reason = reason if reason and fin.finish == "cancelled" else REASONS.get(fin.finish, fin.finish)
        n = len(fin.tokens)
        self.success.labels(self.model_name, reason).inc()
        e2e = time.perf_counter() - track.submitted
        self.e2e.observe(e2e)
        self.request_prompt.observe(track.n_prompt)
        self.request_generation.observe(n)
        if track.n_out > track.n_first:
            self.tpot.observe((track.last - track.first) / (track.n_out - track.n_first))
        if track.first is not None and self.prefix_cache:
            self.prefix_queries.inc(track.n_prompt)
            self.prefix_hits.inc(fin.cached_tokens)
        if fin.preempted:
            self.preemptions.inc(fin.preempted)
        if fin.steps:
            self.tokens_per_forward.observe(n / fin.steps)
            self.forwards.observe(fin.steps)
        if fin.n_fwd:
            self.p_cache.observe(n / fin.n_fwd)
        if fin.accepted or fin.rejected:
            self.drafted.inc(fin.accepted + fin.rejected)
            self.accepted.inc(fin.accepted)
        if log.isEnabledFor(logging.INFO):
            log.info("%s", self.request_line(track, fin, reason, e2e))

    def request_line(self, track: Track, fin, reason: str, e2e: float) -> str:
        """The request's log line: never its prompt's text unless log_prompts."""
        ttft = f"{track.first - track.submitted:.3f} s" if track.first is not None else "-"
        tpf = f"{len(fin.tokens) / fin.steps:.2f}" if fin.steps else "-"
        line = (f"request {fin.request_id} finished: {reason}, prompt {track.n_prompt} tokens "
                f"({fin.cached_tokens} cached), completion {len(fin.tokens)} tokens, ttft {ttft}, "
                f"{tpf} tokens/forward, {e2e:.3f} s")
        if fin.error:
            line += f", error: {fin.error}"
        if self.log_prompts and track.prompt is not None and self.tokenizer is not None:
            line += f", prompt {self.tokenizer.decode(list(track.prompt))!r}"
        return line

    # --------------------------------------------------------------------------- reading

    def exposition(self) -> bytes:
        """The Prometheus text format (what GET /metrics answers)."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict:
        return snapshot(self.registry)


def snapshot(registry) -> dict:
    """The registry's values as a JSON-able dict: a counter or gauge by its sample name (a value,
    or {label value: value} for finished_reason), a histogram as {count, sum, mean, buckets};
    the constant labels (model_name, method) left out."""
    out: dict = {}
    for family in registry.collect():
        if family.type == "histogram":
            buckets, total, count = {}, 0.0, 0.0
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    buckets[s.labels["le"]] = s.value
                elif s.name.endswith("_sum"):
                    total = s.value
                elif s.name.endswith("_count"):
                    count = s.value
            out[family.name] = {"count": count, "sum": total,
                                "mean": total / count if count else 0.0, "buckets": buckets}
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "method")}
            if extra:
                out.setdefault(s.name, {})[",".join(extra.values())] = s.value
            else:
                out[s.name] = s.value
    return out


def summary_line(values: dict) -> str:
    """A snapshot in one line: counters as name=value, histograms as name mean (count); the gauges
    (what is running now) left out."""
    parts = []
    for name, v in values.items():
        if name in GAUGES:
            continue
        if isinstance(v, dict) and "buckets" in v:
            parts.append(f"{name} mean {v['mean']:.3g} (n={v['count']:g})")
        elif isinstance(v, dict):
            parts.append(f"{name} " + " ".join(f"{k}={x:g}" for k, x in v.items()))
        else:
            parts.append(f"{name}={v:g}")
    return ", ".join(parts)


def check_metrics_file(path: str) -> None:
    """DecodeConfigError naming --metrics-file when it cannot be written (before any work)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise DecodeConfigError(f"--metrics-file {path} is a directory")
    if not os.path.isdir(parent):
        raise DecodeConfigError(f"--metrics-file {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise DecodeConfigError(f"--metrics-file {path}: folder {parent} is not writable")


def write_metrics_file(path: str, values: dict) -> None:
    """The snapshot as JSON, written beside `path` and renamed into place (never half-written)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(values, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
