"""What `benchmarks.gpu.on_gpu` records beside its parts and how it prints them: the card (name,
driver, the frameworks' versions) and the folder its results go to, the targets the run is read
against, the text table."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import re
import shutil
import subprocess

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "torch",
            "transformers", "triton")
# (name, wanted, the comparison): the card's targets for the served decode step, the admission
# and the train step
TARGETS = (
    ("AR b8 of the floor", 0.80, ">="),
    ("streaming W16 after / AR b8", 1.15, "<="),
    ("AR b1 of the floor", 0.70, ">="),
    ("AR b1 / PyTorch b1", 1.0, "<="),
    ("AR b8 / PyTorch b8", 1.0, "<="),
    ("admission MFU, one 2K prompt", 0.40, ">="),
    ("train MFU, 1B at 4096", 0.35, ">="),
)


def error_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:400] if text else ''}"


def nvidia_smi() -> dict:
    """The first GPU as nvidia-smi names it: name, driver, memory, the SM clock's maximum; {}
    where there is no nvidia-smi or it fails."""
    if shutil.which("nvidia-smi") is None:
        return {}
    fields = ("name", "driver_version", "memory.total", "clocks.max.sm")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    values = [v.strip() for v in line.split(",")]
    return dict(zip(("name", "driver", "memory", "sm_clock_max"), values)) if line else {}


def card_info(smoke: bool) -> dict:
    """The card, its driver, the versions that ran, the date, and the results folder a run on
    it goes to (benchmarks/results/<card>-<date>), read without starting any framework."""
    gpu = nvidia_smi()
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    now = datetime.datetime.now(datetime.timezone.utc)
    name = gpu.get("name") or ("cpu (smoke)" if smoke else "unknown")
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return dict(gpu, name=name, python=platform.python_version(), versions=versions,
                date_utc=now.strftime("%Y-%m-%d %H:%M"),
                results_folder=f"benchmarks/results/{slug}-{now.strftime('%Y-%m-%d')}")


def _steps(report: dict) -> dict:
    return {r["setting"]: r for r in report.get("steps") or [] if "ms_per_step" in r}


def _best_ar(report: dict, slots: int):
    rows = [r for r in _steps(report).values() if r["method"] == "ar" and r["slots"] == slots]
    return min(rows, key=lambda r: r["ms_per_step"], default=None)


def target_values(report: dict) -> dict:
    """Each target's value from the report (None where its parts did not run)."""
    steps, torch = _steps(report), (report.get("torch_baseline") or {}).get("batches") or {}
    ar8, ar1 = _best_ar(report, 8), _best_ar(report, 1)
    mine = lambda r, b: (r["ms_per_step"] / torch[b]["ms_per_step"]
                         if r and "ms_per_step" in torch.get(b, {}) else None)
    admit = next((c for c in (report.get("admit") or {}).get("cases") or []
                  if c["case"] == "1 prompt"), {})
    train = [r.get("mfu_probe") or r.get("mfu_nominal") for r in report.get("train") or []
             if isinstance(r, dict) and "step_s" in r]
    return {
        "AR b8 of the floor": steps.get("ar b8", {}).get("floor_over_step"),
        "streaming W16 after / AR b8": steps.get("streaming W16 after b8", {}).get("step_over_ar"),
        "AR b1 of the floor": steps.get("ar b1", {}).get("floor_over_step"),
        "AR b1 / PyTorch b1": mine(ar1, "1"),
        "AR b8 / PyTorch b8": mine(ar8, "8"),
        "admission MFU, one 2K prompt": admit.get("mfu"),
        "train MFU, 1B at 4096": max(train, default=None),
    }


def targets(report: dict, smoke: bool = False) -> list[dict]:
    """The targets, each met or not (None where not measured, and for a --smoke run: tiny
    shapes on a CPU are held to nothing)."""
    values = target_values(report)
    out = []
    for name, wanted, op in TARGETS:
        v = values[name]
        met = None if v is None or smoke else (v >= wanted if op == ">=" else v <= wanted)
        out.append(dict(target=name, wanted=f"{op} {wanted}", value=v, met=met))
    return out


def _part_lines(report: dict) -> list[str]:
    lines = []
    for r in report.get("kernel") or []:
        lines.append(f"kernel {r['dtype']:>8} S={r['slots']:<3} {r['backend']:<13} "
                     + (f"rel err {r['rel_err']:.2e} nan {r['nan']}" if "rel_err" in r else r.get("failed", "")))
    for r in report.get("kernel_time") or []:
        lines.append(f"kernel time b={r['batch']} live={r['live']} S={r['slots']:<3} {r['kernel']:<30} "
                     + (f"{r['ms_per_layer'] * 1e3:8.1f} us/layer {r['gb_per_s']:7.0f} GB/s"
                        if "ms_per_layer" in r else r.get("failed") or r.get("skipped", "")))
    qm = report.get("qmatmul")
    for r in qm if isinstance(qm, list) else []:
        lines.append(f"grouped int4 matmul {r['rows']}x{r['k']}x{r['n']} "
                     + (f"rel err {r['rel_err']:.2e} nan {r['nan']} {r['us']:8.1f} us "
                        f"{r['gb_per_s']:7.0f} GB/s (XLA, dequantized: {r['xla_dequantized_us']:.1f} us)"
                        if "us" in r else r.get("failed", "")))
    for r in report.get("tokens") or []:
        lines.append(f"tokens {r['method']:<10} {r['layout']:<13} "
                     + (f"{r['equal']}/{r['of']} equal, first differences {r['first_difference']}"
                        if "equal" in r else r.get("failed", "")))
    for r in report.get("steps") or []:
        if "ms_per_step" in r:
            lines.append(f"step {r['setting']:<30} {r['ms_per_step']:8.3f} ms  floor {r['floor_ms']:.3f} ms "
                         f"({100 * r['floor_over_step']:.0f}%)  / AR {r.get('step_over_ar', 1.0):.3f}  "
                         f"[{r.get('attention')}, page {r.get('page_size')}, compile {r['compile_s']} s]")
        else:
            lines.append(f"step {r['setting']:<30} {r.get('failed') or r.get('skipped')}")
    return lines


def _new_part_lines(report: dict) -> list[str]:
    lines = []
    a = report.get("admit") or {}
    for c in a.get("cases") or []:
        mfu = f"MFU {100 * c['mfu']:.1f}% of the {a['rate_from']}" if c.get("mfu") else "MFU -"
        lines.append(f"admit {c['case']:<20} TTFT {1e3 * c['ttft_s']:8.2f} ms  admission "
                     f"{1e3 * c['admission_s']:8.2f} ms  {mfu}  [{a['attention']}, page "
                     f"{a['page_size']}, chunk {a['prefill_chunk']}, {c['first_call_steps']} steps "
                     f"to the first tokens]")
    if "failed" in a or "skipped" in a:
        lines.append(f"admit {a.get('failed') or a.get('skipped')}")
    train = report.get("train")
    for r in train if isinstance(train, list) else [train] if train else []:
        if "step_s" in r:
            lines.append(f"train {r['attention']:<8} L={r['seq_len']} {r['step_s'] * 1e3:.1f} ms "
                         f"{r['tokens_per_s']:.0f} tokens/s MFU {100 * r['mfu_probe']:.1f}% of the "
                         f"{r.get('mfu_against')}")
        else:
            lines.append(f"train {r}")
    t = report.get("torch_baseline") or {}
    for b, r in (t.get("batches") or {}).items():
        if "ms_per_step" not in r:
            lines.append(f"pytorch b{b} {r.get('failed', 'not timed')}")
            continue
        eager = ", EAGER: its compile failed" if "compile_failed" in r else ""
        lines.append(f"pytorch b{b} {r['ms_per_step']:8.3f} ms a step  {r['tokens_per_s']:.0f} "
                     f"tokens/s  [torch {t.get('torch')}, transformers {t.get('transformers')}, "
                     f"{t.get('compile')}, compile {r.get('compile_s')} s{eager}]")
    if "failed" in t or "stopped" in t:
        lines.append(f"pytorch {t.get('failed') or t.get('stopped')}")
    return lines


def table(report: dict) -> str:
    lines = []
    card, p = report.get("card") or {}, report.get("probes") or {}
    if card:
        lines.append(f"{card['name']}, driver {card.get('driver')}, jax "
                     f"{card['versions'].get('jax')}: results go to {card['results_folder']}/")
    if "hbm_bytes_per_s" in p:
        lines.append(f"copy {p['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
                     f"{p['bf16_flops'] / 1e12:.0f} TFLOP/s")
    lines += _part_lines(report) + _new_part_lines(report)
    for t in report.get("targets") or []:
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        lines.append(f"target {t['target']:<32} {t['wanted']:<8} {value:>8}  met {t['met']}")
    return "\n".join(lines)
