"""A picture of decoding: each step's window, slot by slot, in logical order.

    steps = trace_view(trace, final, row, method)   # from decode.static.static_batch.trace_steps
    write_trace("trace.html", [view], tokenizer, title=...)  # or "trace.png" (needs matplotlib)

Per step and window slot (logical positions n, n+1, ...) the state is one of
  committed  filled before the step and in the leading filled run: final after this forward, emitted;
  filled     filled before the step (fed as a token), not yet committed;
  new        fed as [MASK], filled by this step's entropy rule (its token shown);
  masked     fed as [MASK] and still masked after the step.
The slot's physical index (its place in the forward, filled slots first) and the entropy of its
prediction are shown with it. The ids of the committed slots, step after step, are the generated
ids. Methods `streaming` and `block` have a window; `ar` draws one committed slot per step (the
token predicted at position n + 1). `verified` is not drawn.

The "filled before" flags are carried from step to step (step 0: none; then the previous step's
`filled_after` slid by its commit count), so a filled token that happens to equal the mask id is
still drawn as filled. A newly filled slot's token is read from where it is fed next: the next
step's window, or the final state after the row's last step.
"""

from __future__ import annotations

import html
import os
from typing import Sequence

import numpy as np

STATES = ("committed", "filled", "new", "masked")
COLORS = {"committed": "#8fd19e", "filled": "#9ec5fe", "new": "#ffe08a", "masked": "#d9d9d9"}
DRAWN_METHODS = ("streaming", "block", "ar")
MAX_HTML_PROMPTS = 4
MAX_PNG_PROMPTS = 1
FORMATS = (".html", ".htm", ".png")


class TraceError(ValueError):
    """A trace request that cannot be drawn (method, batch, file type)."""


def check_request(path: str, method: str, num_prompts: int) -> str:
    """Validate a trace request before anything expensive runs; returns 'html' or 'png'."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise TraceError(f"trace file {path!r}: unknown extension {ext or '(none)'!r}; "
                         f"use .html or .png")
    kind = "png" if ext == ".png" else "html"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise TraceError(f"trace file {path!r}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise TraceError(f"trace file {path!r}: the folder {folder} is not writable")
    if os.path.isdir(path):
        raise TraceError(f"trace file {path!r} is a folder")
    if method not in DRAWN_METHODS:
        raise TraceError(f"the trace draws methods {', '.join(DRAWN_METHODS)}, not {method!r}")
    limit = MAX_PNG_PROMPTS if kind == "png" else MAX_HTML_PROMPTS
    if num_prompts > limit:
        raise TraceError(f"the {kind.upper()} trace draws at most {limit} prompt"
                         f"{'s' if limit > 1 else ''}, got {num_prompts}; trace fewer prompts")
    if kind == "png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise TraceError("a PNG trace needs matplotlib (pip install -e '.[plot]' in the repository); "
                             "an .html trace does not") from None
    return kind


def _entropy(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    z = e.sum(axis=-1)
    return np.log(z) - (e * x).sum(axis=-1) / z


def trace_view(trace: Sequence[dict], final: dict, row: int, method: str) -> list[dict]:
    """The steps of one batch row as dicts: step, n, commit, slots (logical order) with pos, state,
    token (None where masked), phys (index in the forward) and entropy (nats)."""
    if method not in DRAWN_METHODS:
        raise TraceError(f"the trace draws methods {', '.join(DRAWN_METHODS)}, not {method!r}")
    live = [k for k, a in enumerate(trace) if bool(np.asarray(a["live"])[row])]
    out_ids = np.asarray(final["out"])[row]
    steps = []
    if method == "ar":
        for j, k in enumerate(live):
            a = trace[k]
            n = int(np.asarray(a["n"])[row])
            ent = float(_entropy(np.asarray(a["logits"])[row, 0]))
            steps.append(dict(step=k, n=n, commit=1, slots=[dict(
                pos=n + 1, state="committed", token=int(out_ids[j]), phys=0, entropy=ent)]))
        return steps
    filled_before = None
    for j, k in enumerate(live):
        a = trace[k]
        n = int(np.asarray(a["n"])[row])
        wlen = int(np.asarray(a["wlen"])[row])
        c = int(np.asarray(a["commit"])[row])
        pos = np.asarray(a["positions"])[row]
        fed = np.asarray(a["tokens"])[row]
        ent_phys = _entropy(np.asarray(a["logits"])[row])
        w = len(fed)
        if filled_before is None:
            filled_before = np.zeros(w, bool)
        logical_tok = np.full(w, -1, np.int64)
        phys_of = np.full(w, -1, np.int64)
        ent = np.zeros(w)
        for p in range(wlen):
            i = int(pos[p]) - n
            logical_tok[i], phys_of[i], ent[i] = int(fed[p]), p, ent_phys[p]
        after = np.asarray(a["filled_after"])[row]
        # where this step's window is fed next: slot i (i >= c) sits at i - c
        if j + 1 < len(live):
            nxt = trace[live[j + 1]]
            npos, nfed = np.asarray(nxt["positions"])[row], np.asarray(nxt["tokens"])[row]
            nn_ = int(np.asarray(nxt["n"])[row])
            next_tok = {int(npos[p]) - nn_: int(nfed[p]) for p in range(int(np.asarray(nxt["wlen"])[row]))}
        else:
            next_tok = {i: int(t) for i, t in enumerate(np.asarray(final["tok"])[row])}
        slots = []
        for i in range(wlen):
            if filled_before[i]:
                state, token = ("committed" if i < c else "filled"), int(logical_tok[i])
            elif after[i]:
                state, token = "new", next_tok.get(i - c)
            else:
                state, token = "masked", None
            slots.append(dict(pos=n + i, state=state, token=token, phys=int(phys_of[i]),
                              entropy=float(ent[i])))
        steps.append(dict(step=k, n=n, commit=c, slots=slots))
        # the next step's "filled before": this step's filled_after slid by the commit count
        slid = np.zeros(w, bool)
        slid[:w - c] = after[c:]
        filled_before = slid
    return steps


def committed_ids(steps: list[dict]) -> list[int]:
    return [s["token"] for st in steps for s in st["slots"] if s["state"] == "committed"]


def token_text(tokenizer, tid: int | None) -> str:
    """A token as text: decoded alone, else its vocabulary string (special tokens), else #id."""
    if tid is None:
        return "[MASK]"
    text = ""
    if tokenizer is not None:
        text = tokenizer.decode([tid])
        if not text and hasattr(tokenizer, "tokenizer"):
            text = tokenizer.tokenizer.id_to_token(tid) or ""
    return text if text else f"#{tid}"


def _visible(text: str) -> str:
    """Whitespace made visible: space as a middle dot, newline and tab as arrows."""
    return text.replace(" ", "\u00b7").replace("\n", "\u21b5").replace("\t", "\u21e5")


_CSS = """
body { font-family: sans-serif; margin: 1.5em; }
table.win { border-collapse: collapse; margin: 0.3em 0 1em 0; }
table.win td, table.win th { border: 1px solid #999; padding: 2px 6px; text-align: center;
  font-family: monospace; white-space: pre; font-size: 13px; }
table.win th { background: #f4f4f4; font-weight: normal; color: #555; }
.committed { background: %(committed)s; } .filled { background: %(filled)s; }
.new { background: %(new)s; } .masked { background: %(masked)s; color: #666; }
.legend span { padding: 2px 8px; margin-right: 6px; font-family: monospace; }
pre.text { background: #f8f8f8; padding: 0.6em; border: 1px solid #ddd; white-space: pre-wrap; }
h3 { margin: 0.6em 0 0.1em 0; font-size: 15px; }
""" % COLORS


def render_html(views: list[dict], tokenizer=None, title: str = "WeDLM decoding trace") -> str:
    """views: [{"prompt": text, "steps": trace_view(...), "settings": str}] -> an HTML document with
    one <section class="step"> per step and prompt."""
    e = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{e(title)}</h1>",
             "<p class='legend'>" + "".join(f"<span class='{s}'>{s}</span>" for s in STATES) +
             " &mdash; columns: window slots in logical order; <i>phys</i>: the slot's place in "
             "the forward (filled slots first); <i>H</i>: entropy of its prediction (nats)</p>"]
    for r, v in enumerate(views):
        steps = v["steps"]
        ids = committed_ids(steps)
        parts.append(f"<div class='prompt' id='prompt-{r}'><h2>Prompt {r}</h2>")
        if v.get("settings"):
            parts.append(f"<p>{e(v['settings'])}</p>")
        parts.append(f"<pre class='text'>{e(v.get('prompt', ''))}</pre>")
        parts.append(f"<p>{len(steps)} steps, {len(ids)} tokens committed, "
                     f"{len(ids) / max(len(steps), 1):.2f} tokens per forward</p>")
        for st in steps:
            n_new = sum(s["state"] == "new" for s in st["slots"])
            parts.append(f"<section class='step' data-step='{st['step']}' data-commit='{st['commit']}'>"
                         f"<h3>step {st['step']}: n = {st['n']}, committed {st['commit']}, "
                         f"newly filled {n_new}</h3><table class='win'>")
            parts.append("<tr><th>pos</th>" + "".join(f"<th>{s['pos']}</th>" for s in st["slots"]) + "</tr>")
            cells = []
            for s in st["slots"]:
                tid = "" if s["token"] is None else f" data-id='{s['token']}'"
                cells.append(f"<td class='{s['state']}'{tid} title='{s['state']}, H = {s['entropy']:.3f}'>"
                             f"{e(_visible(token_text(tokenizer, s['token'])))}</td>")
            parts.append("<tr><th>token</th>" + "".join(cells) + "</tr>")
            parts.append("<tr><th>phys</th>" + "".join(f"<td>{s['phys']}</td>" for s in st["slots"]) + "</tr>")
            parts.append("<tr><th>H</th>" + "".join(f"<td>{s['entropy']:.2f}</td>" for s in st["slots"])
                         + "</tr></table></section>")
        text = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
        parts.append(f"<h3>generated</h3><pre class='text generated'>{e(text)}</pre></div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def render_png(path: str, view: dict, tokenizer=None, title: str = "WeDLM decoding trace") -> str:
    """One prompt's steps as a grid (rows: steps, columns: window slots), coloured by state."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle
    steps = view["steps"]
    width = max((len(st["slots"]) for st in steps), default=1)
    fig_w = min(2.0 + 0.9 * width, 40)
    fig_h = min(1.5 + 0.32 * len(steps), 200)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    for r, st in enumerate(steps):
        for i, s in enumerate(st["slots"]):
            ax.add_patch(Rectangle((i, r), 1, 1, facecolor=COLORS[s["state"]], edgecolor="#777", lw=0.5))
            txt = _visible(token_text(tokenizer, s["token"]))
            ax.text(i + 0.5, r + 0.5, txt[:8], ha="center", va="center", fontsize=7, family="monospace")
    ax.set_xlim(0, width)
    ax.set_ylim(len(steps), 0)
    ax.set_yticks([r + 0.5 for r in range(len(steps))])
    ax.set_yticklabels([f"{st['step']} (n={st['n']}, +{st['commit']})" for st in steps], fontsize=7)
    ax.set_xticks([i + 0.5 for i in range(width)])
    ax.set_xticklabels([f"n+{i}" for i in range(width)], fontsize=7)
    ax.set_xlabel("window slot (logical order)")
    ax.set_ylabel("step (committed length n, +committed)")
    ax.set_title(title + (f"\n{view['settings']}" if view.get("settings") else ""), fontsize=9)
    ax.legend(handles=[Patch(facecolor=COLORS[s], label=s) for s in STATES], loc="upper center",
              bbox_to_anchor=(0.5, -0.4 / max(fig_h, 1)), ncol=4, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_trace(path: str, views: list[dict], tokenizer=None, title: str = "WeDLM decoding trace") -> str:
    """Write views (see render_html) to `path` (.html/.htm, or .png for a single prompt)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise TraceError(f"trace file {path!r}: unknown extension {ext or '(none)'!r}; use .html or .png")
    if ext == ".png":
        if len(views) > MAX_PNG_PROMPTS:
            raise TraceError(f"the PNG trace draws at most {MAX_PNG_PROMPTS} prompt, got {len(views)}")
        return render_png(path, views[0], tokenizer, title)
    if len(views) > MAX_HTML_PROMPTS:
        raise TraceError(f"the HTML trace draws at most {MAX_HTML_PROMPTS} prompts, got {len(views)}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(views, tokenizer, title))
    return path
