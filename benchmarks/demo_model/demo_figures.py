"""The figures of `benchmarks.demo_model.demo_experiments` (benchmarks/figures/demo_NAME.png): the regimes'
speed-ups and tokens per forward, the tau / lambda / W sweeps as quality against speed (the paper's
Figures 4-8 at small scale), tokens/s by batch."""

from __future__ import annotations

import numpy as np

KINDS = ("counting", "arith", "records", "code")


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(name: str, res: dict, path: str) -> str | None:
    """Draw experiment `name`'s results `res` to `path` (a PNG); its path, or None when the
    experiment has no figure. The tau sweep draws a second figure beside it (_stream_vs_block)."""
    plt = pyplot()
    kinds = [k for k in KINDS if k in res]      # the regimes the run had (--kinds)
    if name == "regimes":
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=110)
        x = np.arange(len(kinds))
        for i, m in enumerate(("streaming", "block", "ar")):
            axes[0].bar(x + (i - 1) * 0.27, [res[k][m]["speedup_vs_ar"] for k in kinds], 0.27, label=m)
            axes[1].bar(x + (i - 1) * 0.27, [res[k][m]["tokens_per_forward"] for k in kinds], 0.27, label=m)
        for ax, t in zip(axes, ("wall-clock speed-up over AR", "tokens per forward")):
            ax.set_xticks(x, kinds)
            ax.set_title(t)
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend()
    elif name in ("tau", "lam", "window"):
        fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 3.6), dpi=110,
                                 squeeze=False)
        axes = axes[0]
        key = name  # the swept field of each row
        for ax, kind in zip(axes, kinds):
            for m in ("streaming", "block"):
                rows = res[kind].get(m)
                if not rows:
                    continue
                xs = [r["speedup_vs_ar"] for r in rows]
                ys = [r["quality"] for r in rows]
                ax.plot(xs, ys, "o-", label=m)
                for r, xx, yy in zip(rows, xs, ys):
                    ax.annotate(f"{r[key]:g}", (xx, yy), fontsize=7, xytext=(3, 3), textcoords="offset points")
            ar = res[kind]["ar"]
            ax.plot([1.0], [ar["quality"]], "k*", ms=10, label="AR")
            ax.set_xlabel("wall-clock speed-up over AR")
            ax.set_ylabel("NLL per token (lower is better)" if kind == "code" else "accuracy")
            ax.set_title(f"{kind}: {key} sweep")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    elif name == "batch":
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        for kind in res:
            bs = sorted(res[kind], key=int)
            for m, style in (("streaming", "o-"), ("ar", "s--")):
                ax.plot([int(b) for b in bs], [res[kind][b][m]["tokens_per_s"] for b in bs], style,
                        label=f"{kind} {m}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens / s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    else:
        return None
    if name == "tau":  # Figure 4c beside it: tokens/s of streaming and block across tau
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 3.4), dpi=110,
                                 squeeze=False)
        axes = axes[0]
        for ax, kind in zip(axes, kinds):
            for m in ("streaming", "block"):
                rows = res[kind][m]
                ax.plot([r["tau"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", label=m)
            ax.axhline(res[kind]["ar"]["tokens_per_s"], color="k", ls=":", label="AR")
            ax.set_xlabel("tau")
            ax.set_ylabel("tokens / s")
            ax.set_title(f"{kind}: streaming vs block")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        path = path.replace(".png", "_stream_vs_block.png")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
