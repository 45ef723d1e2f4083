"""The compile report's renderings (benchmarks.compiled.compile_for): the markdown table and the plot of a
report's rows."""

from __future__ import annotations

from wedlm_jax.runtime.targets import GIB


def ms_text(x) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def program_name(r: dict) -> str:
    """A decode row's program as the report names it: method, window, refill, cache."""
    name = r["method"] if r["method"] == "ar" else f"{r['method']} W{r['window']} {r['refill']}"
    return (name + ("" if r["cache"] == "dense" else f", {r['cache']}")
            + (f", LoRA {r['lora_rows']} x r{r['lora_rank']}" if r.get("lora_rows") else ""))


def plot(report: dict, path: str) -> str | None:
    """Per target, the decode programs' bytes over the floor and their roofline step time beside
    libtpu's estimate (PNG; None without matplotlib, the `plot` extra)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    targets = [t for t in report["targets"] if any(r["kind"] == "decode" for r in t["rows"])]
    if not targets:
        return None
    n = max(sum(r["kind"] == "decode" for r in t["rows"]) for t in targets)
    fig, axes = plt.subplots(len(targets), 2, figsize=(12, 0.28 * n + 1.6), squeeze=False, dpi=100)
    for (ax_b, ax_t), t in zip(axes, targets):
        rows = [r for r in t["rows"] if r["kind"] == "decode" and r.get("bytes_over_floor")]
        names = [f"{program_name(r)}, b{r['slots']}" for r in rows]
        y = range(len(rows))
        ax_b.barh(y, [r["bytes_over_floor"] for r in rows], color="tab:blue")
        ax_b.axvline(1.0, color="k", lw=0.8)
        ax_b.axvline(1.15, color="tab:red", ls="--", lw=0.8, label="1.15")
        ax_b.set_yticks(list(y), names, fontsize=7)
        ax_b.invert_yaxis()
        ax_b.set_xlabel("bytes per step / floor")
        ax_b.set_title(f"{t['target']}: bytes moved", fontsize=9)
        ax_b.legend(fontsize=7)
        ax_t.barh([i - 0.2 for i in y], [1e3 * r["roofline_s"] for r in rows], height=0.4,
                  label="roofline", color="tab:green")
        ax_t.barh([i + 0.2 for i in y], [1e3 * (r.get("cost") or {}).get("optimal_seconds", 0)
                                         for r in rows], height=0.4, label="libtpu optimal",
                  color="tab:orange")
        ax_t.set_yticks(list(y), [""] * len(rows))
        ax_t.invert_yaxis()
        ax_t.set_xlabel("ms per step")
        ax_t.set_title(f"{t['target']}: step time", fontsize=9)
        ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def step_options_line(target: dict) -> list:
    """The compiler options the target's decode steps were compiled with (the Decoder's own,
    `decode.engine.planning.layouts.STEP_OPTIONS`), as a line and a blank one; none when there were none."""
    seen = {", ".join(f"{k}={v}" for k, v in sorted(r["compiler_options"].items()))
            for r in target["rows"] if r.get("kind") == "decode" and r.get("compiler_options")}
    if not seen:
        return []
    return ["Decode steps compiled with the Decoder's libtpu options (decode.engine.planning.layouts.STEP_OPTIONS): "
            + "; ".join(sorted(seen)) + ".", ""]


def markdown(report: dict) -> str:
    out = [f"# Compiled for the target, on this CPU ({report['command']})", "",
           f"jax {report['jax']}, libtpu {report['libtpu']}, jax-cuda12-plugin "
           f"{report.get('cuda_plugin')}; decode shape {report['model']} "
           f"bf16; streaming tokens per forward assumed {report['tokens_per_forward']} for the "
           "tokens/s estimate; time = roofline max(flops / peak, bytes / bandwidth) per chip from "
           "the layer-scaled compiled cost.", ""]
    if any(r.get("cost", {}).get("from") == "hlo" for t in report["targets"] for r in t["rows"]):
        out += ["Rows of targets whose compiler reports no cost (XLA:GPU): bytes estimated from the "
                "whole-depth program's instructions (operands and results of every top-level "
                "instruction, in-place updates as their update; the attention kernels' live K/V, "
                "queries and output added), flops analytic (2 x weights x rows).", ""]
    if any(r.get("cost", {}).get("optimal_from") for t in report["targets"] for r in t["rows"]):
        out += ["\\* libtpu gave the program as compiled no time (optimal_seconds <= 0); the time "
                "is that of the same program compiled with `wedlm_jax.runtime.compiled.estimate_options` "
                "(no SparseCore offloads, no sliced prefetches); its bytes and flops are the "
                "program's as compiled.", ""]
    for t in report["targets"]:
        out += [f"## {t['target']} ({t['chips']} chips, {t['hbm_gib']:.0f} GiB HBM, "
                f"{t['peak_tflops']:.0f} TFLOP/s, {t['bandwidth_gbs']:.0f} GB/s per chip)", "",
                *step_options_line(t),
                "| program | batch | chips | memory GiB/chip | fits | bytes / floor | roofline ms | "
                "libtpu optimal ms | floor ms | step / AR: roofline (libtpu) | tokens/s (est.) |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in t["rows"]:
            if r["kind"] == "decode":
                name, batch = program_name(r), r["slots"]
            elif r["kind"] == "prefill":
                name, batch = f"prefill {r['prompt_len']} tokens", 1
            else:
                name = (f"train {r['params'] / 1e9:.2f}B"
                        + (f" LoRA r{r['lora_rank']}" if r.get("lora_rank") else "")
                        + f", {r['seq_len']}-token row, {r['attention']}")
                batch = r["rows_per_chip"]
            if "oom" in r:
                out.append(f"| {name} | {batch} | {r.get('chips_used', t['chips'])} | - | "
                           f"**no**: {r['oom'][:80]} | | | | | | |")
                continue
            c = r.get("cost", {})
            fmt = lambda v, f: "-" if v is None else format(v, f)
            if r["kind"] == "train":
                extra = (f"step {ms_text(r.get('step_s'))} ms (libtpu + attention kernel "
                         f"{ms_text(r.get('kernel_s'))} ms at peak)"
                         + ("" if r.get("lora_rank") else f": MFU {fmt(r.get('mfu'), '.0%')}")
                         + (f" ({r['mfu_note']})" if r.get("mfu_note") else "")
                         + ("" if r.get("lora_rank") else
                            f"; roofline bound {fmt(r.get('mfu_bound'), '.0%')}")
                         + (f" ({r['mfu_bound_note']})" if r.get("mfu_bound_note") else ""))
            else:
                extra = fmt(r.get("tokens_per_s"), ".0f")
            cells = [name, batch, r.get("chips_used", t["chips"]),
                     f"{r['memory']['total'] / GIB:.2f}", "yes" if r["fits"] else "**no**",
                     fmt(r.get("bytes_over_floor"), ".2f"), ms_text(r.get("roofline_s")),
                     ms_text(c.get("optimal_seconds")) + ("*" if c.get("optimal_from") else ""),
                     ms_text(r.get("floor_s")),
                     fmt(r.get("step_over_ar"), ".2f") + (
                         f" ({r['libtpu_step_over_ar']:.2f})" if "libtpu_step_over_ar" in r
                         else ""), extra]
            out.append("| " + " | ".join(str(x) for x in cells) + " |")
        out.append("")
    return "\n".join(out)
