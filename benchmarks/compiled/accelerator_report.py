"""The accelerator suite's renderings (benchmarks.compiled.accelerator): the targets, accelerator.md and
the plots of a report."""

from __future__ import annotations

import os

import numpy as np

from wedlm_jax.runtime.failures import format_bytes

TARGETS = {"ar_roofline_pct_b1": 80.0, "w16_over_ar": 1.3, "train_mfu_l4096": 0.40}


def gib(x: float) -> str:
    return format_bytes(x, "GiB")


def count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def targets(report: dict) -> dict:
    """The issue's targets, met or not (None where not measured)."""
    dec = [r for r in report.get("decode", []) if r["batch"] == 1 and "step_s" in r]
    ar = max((r["roofline_pct"] for r in dec), default=None)
    win = report.get("window") or {}
    win = {} if "failed" in win else win
    w16 = win.get("after", {}).get("16")
    mfu = [r.get("mfu_nominal") or r.get("mfu_probe") for r in report.get("train", [])
           if r.get("seq_len") == max(report["plan"]["train_lengths"]) and "step_s" in r]
    mfu = max(mfu, default=None)
    if report["plan"]["smoke"]:                 # tiny shapes on CPU: nothing to hold to a target
        ar = w16 = mfu = None
    return {"ar_roofline_pct_b1": {"target": f">= {TARGETS['ar_roofline_pct_b1']}",
                                   "value": ar, "met": None if ar is None else ar >= TARGETS["ar_roofline_pct_b1"]},
            "w16_over_ar": {"target": f"<= {TARGETS['w16_over_ar']}", "value": w16,
                            "met": None if w16 is None else w16 <= TARGETS["w16_over_ar"]},
            "train_mfu_longest_L": {"target": f">= {TARGETS['train_mfu_l4096']}", "value": mfu,
                                    "met": None if mfu is None else mfu >= TARGETS["train_mfu_l4096"]}}


def _header(report: dict) -> list[str]:
    d, p = report["device"], report["plan"]
    lines = [f"# Accelerator suite: {d['device_kind']} ({d['platform']}), {d['date_utc']} UTC", ""]
    if p["smoke"]:
        lines += ["**--smoke**: tiny shapes on CPU, a check of the code paths; these figures say "
                  "nothing about any hardware.", ""]
    lines += [f"Command: `{report['command']}`", "",
              f"jax {d['jax']}, {d['device_count']} device(s), memory {gib(d['memory_bytes'])}; "
              f"decode shape `{p['model']}` ({count(report['decode_params'])} params), "
              f"train shape {count(report['train_params'])} params.", ""]
    pr = report.get("probes", {})
    if pr:
        nom_f, nom_b = d.get("nominal_bf16_flops"), d.get("nominal_hbm_bytes_per_s")
        lines += ["| probe | measured | nominal |", "|---|---|---|",
                  f"| copy bandwidth | {pr['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s | "
                  f"{fmt(nom_b and nom_b / 1e9, '.0f')} GB/s |",
                  f"| bf16 matmul (n={p['matmul_n']}) | {pr['matmul_flops'] / 1e12:.2f} TFLOP/s | "
                  f"{fmt(nom_f and nom_f / 1e12, '.0f')} TFLOP/s |", ""]
    return lines


def _decode_and_window(report: dict) -> list[str]:
    p, lines = report["plan"], []
    if report.get("decode"):
        lines += [f"## AR decode step (1 slot per row, {p['prefix']} committed tokens, bf16)", "",
                  "| attention | batch | step ms | roofline ms | % of roofline | tokens/s |",
                  "|---|---|---|---|---|---|"]
        for r in report["decode"]:
            if "failed" in r:
                lines.append(f"| {r['attention']} | {r['batch']} | failed: {r['failed']} | | | |")
                continue
            lines.append(f"| {r['attention']} | {r['batch']} | {r['step_s'] * 1e3:.3f} | "
                         f"{r['roofline_s'] * 1e3:.3f} | {r['roofline_pct']:.1f} | "
                         f"{r['tokens_per_s']:.1f} |")
        lines.append("")
    if "failed" in (report.get("window") or {}):
        lines += [f"## W-slot step cost: failed ({report['window']['failed']})", ""]
    elif report.get("window"):
        w = report["window"]
        lines += [f"## W-slot step cost / AR step (batch 1, attention `{w['attention']}`)", "",
                  "| W | after (W slots) | before (2W slots) |", "|---|---|---|"]
        for k in map(str, p["windows"]):
            lines.append(f"| {k} | {w['after'][k]:.2f} | {w['before'][k]:.2f} |")
        lines.append("")
    return lines


def _why_not(r: dict) -> str:
    return "refused: " + r["refused"] if "refused" in r else "failed: " + r["failed"]


def _prefill_and_train(report: dict) -> list[str]:
    p, lines = report["plan"], []
    if report.get("prefill"):
        lines += [f"## Prefill ({p['prefill']} tokens, batch 1)", "",
                  "| attention | ms | tokens/s | MFU (probe) | MFU (nominal) |",
                  "|---|---|---|---|---|"]
        for r in report["prefill"]:
            if "refused" in r or "failed" in r:
                lines.append(f"| {r['attention']} | {_why_not(r)} | | | |")
            else:
                lines.append(f"| {r['attention']} | {r['step_s'] * 1e3:.2f} | "
                             f"{r['tokens_per_s']:.0f} | {r['mfu_probe']:.3f} | "
                             f"{fmt(r['mfu_nominal'], '.3f')} |")
        lines.append("")
    if report.get("train"):
        lines += [f"## Train step (dual stream, bf16{', remat' if p['remat'] else ''})", "",
                  "| attention | L | step s | tokens/s | MFU (probe) | MFU (nominal) |",
                  "|---|---|---|---|---|---|"]
        for r in report["train"]:
            if "skipped" in r:
                lines.append(f"| {r['attention']} | - | not available: {r['skipped']} | | | |")
            elif "refused" in r or "failed" in r:
                lines.append(f"| {r['attention']} | {r['seq_len']} | {_why_not(r)} | | | |")
            else:
                lines.append(f"| {r['attention']} | {r['seq_len']} | {r['step_s']:.3f} | "
                             f"{r['tokens_per_s']:.0f} | {r['mfu_probe']:.3f} | "
                             f"{fmt(r['mfu_nominal'], '.3f')} |")
        lines.append("")
    return lines


def _convert_and_targets(report: dict) -> list[str]:
    lines = []
    if "failed" in (report.get("convert") or {}):
        lines += [f"## Conversion: failed ({report['convert']['failed']})", ""]
    elif report.get("convert"):
        cv = report["convert"]
        lines += [f"## Conversion ({cv['checkpoint_bytes'] / 1e6:.1f} MB bf16 checkpoint, "
                  f"{count(cv['params'])} params)", "", "| path | s | GB/s |", "|---|---|---|"]
        for k, v in cv["seconds"].items():
            lines.append(f"| {k} | {v:.3f} | {cv['gb_per_s'][k]:.3f} |")
        lines.append("")
    lines += ["## Targets", "", "| target | wanted | value | met |", "|---|---|---|---|"]
    for k, t in report["targets"].items():
        lines.append(f"| {k} | {t['target']} | {fmt(t['value'], '.3f')} | {t['met']} |")
    lines += ["", f"Plots: {report['plots']}", ""]
    if report.get("failures"):
        lines += ["Failed entries (the rest of the report stands):", ""]
        lines += [f"- {f}" for f in report["failures"]] + [""]
    return lines


def markdown(report: dict) -> str:
    """accelerator.md: the device and probes, then one table per section, then the targets."""
    return "\n".join(_header(report) + _decode_and_window(report) + _prefill_and_train(report)
                     + _convert_and_targets(report))


def plots(report: dict, folder: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed (pip install '.[plot]')"
    made = []
    title = f"{report['device']['device_kind']}{' (smoke)' if report['plan']['smoke'] else ''}"
    if any("step_s" in r for r in report.get("decode", [])):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ok = [r for r in report["decode"] if "step_s" in r]
        impls = sorted({r["attention"] for r in ok})
        batches = report["plan"]["batches"]
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = [next((r["roofline_pct"] for r in ok
                          if r["attention"] == impl and r["batch"] == b), 0.0) for b in batches]
            ax.bar(np.arange(len(batches)) + i * width, vals, width, label=impl)
        ax.set_xticks(np.arange(len(batches)) + 0.4 - width / 2, [str(b) for b in batches])
        ax.axhline(TARGETS["ar_roofline_pct_b1"], ls="--", c="k", lw=0.8)
        ax.set(xlabel="batch", ylabel="% of HBM roofline", title=f"AR decode step: {title}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(folder, "decode_roofline.png"), dpi=120)
        plt.close(fig)
        made.append("decode_roofline.png")
    if report.get("window") and "failed" not in report["window"]:
        w = report["window"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ws = report["plan"]["windows"]
        for order in ("after", "before"):
            ax.plot(ws, [w[order][str(k)] for k in ws], "o-", label=order)
        ax.axhline(TARGETS["w16_over_ar"], ls="--", c="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="window W", ylabel="step cost / AR step",
               title=f"W-slot step cost ({w['attention']}): {title}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(folder, "window_curve.png"), dpi=120)
        plt.close(fig)
        made.append("window_curve.png")
    runs = [r for r in report.get("train", []) if "step_s" in r]
    if runs:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels = [f"{r['attention']}\nL={r['seq_len']}" for r in runs]
        ax.bar(labels, [100 * (r["mfu_nominal"] or r["mfu_probe"]) for r in runs])
        ax.axhline(100 * TARGETS["train_mfu_l4096"], ls="--", c="k", lw=0.8)
        ax.set(ylabel="MFU %", title=f"train step: {title}")
        fig.tight_layout()
        fig.savefig(os.path.join(folder, "train_mfu.png"), dpi=120)
        plt.close(fig)
        made.append("train_mfu.png")
    return ", ".join(made) or "none (no section produced data)"
