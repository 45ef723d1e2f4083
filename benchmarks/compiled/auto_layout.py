"""The decode step with the weights in the layouts the TPU compiler picks: bytes per step
against the floor, the compiler's own layouts (`Layout.AUTO` for every weight) beside the default
row-major ones, the layer scan unrolled so the whole step is counted.

    PYTHONPATH=.:.venv/tpu-compiler JAX_PLATFORMS=cpu python -m benchmarks.compiled.auto_layout \
        [--topology v5p:1x1x1] [--methods ar,streaming] [--page-size 64] [--out FILE.json] \
        [--compiler-option KEY=VALUE ...] [--layers N]

`--compiler-option` sets a libtpu option over the Decoder's own (`decode.engine.planning.layouts.step_options`;
VALUE "default" leaves the option to libtpu), e.g. `xla_tpu_scoped_vmem_limit_kib=default`.

The default layouts make XLA copy weights into its tile order inside every step (the "relayout
copies" of BENCHMARKS.md); with AUTO the copies go. The Decoder does this on TPU by default
(`weight_layout` "compiler", decode/engine/planning/layouts.py): the "auto" rows are the Decoder's own program. Shapes: 8B (configs/arch/qwen3-8b),
bf16, 8 slots (`--slots`), capacity 4096, 2048 live rows, W 16 (`--window`) refill before. Bytes: libtpu's cost analysis
plus the live K/V its tile loop does not count (`decode.compile.aot.kv_not_counted`), or, with a paged
cache, the ragged kernel's operands (`benchmarks.compiled.step_bytes.kernel_not_counted`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

ROOT_ARCH = "configs/arch/qwen3-8b"


def measure(config, dev, chip, method: str, page_size: int | None, layout: str,
            refill: str = "before", compiler_options: dict | None = None, window: int = 16,
            slots: int = 8) -> dict:
    from benchmarks.compiled.step_bytes import kernel_not_counted
    from decode.compile import aot
    from decode.config import EngineOptions, Placement
    from wedlm_jax.runtime.compiled import figures
    t0 = time.time()
    dec, compiled = aot.generate_program(
        config, [dev], EngineOptions(method=method, window=window, refill=refill, slots=slots,
                                     capacity=4096),
        Placement(dtype="bfloat16", attention="tiled", page_size=page_size or 0,
                  weight_layout="compiler" if layout == "auto" else "default"),
        scan_unroll=config.num_layers, compiler_options=compiler_options)
    cost = figures(compiled).get("cost") or {}
    live = 2048
    extra = (kernel_not_counted(slots, dec.static.span, config, live, "bfloat16") if page_size
             else aot.kv_not_counted(slots, config, live, dec.static.kv_tile, "bfloat16"))
    floor = aot.step_floor(dec.static, live)["total"]
    moved = cost.get("bytes accessed", float("nan")) + extra
    return dict(method=method, window=window if method != "ar" else 1, slots=slots,
                refill=refill if method != "ar" else None, page_size=page_size,
                layout=layout, compiler_options=compiler_options, bytes=moved, floor=floor,
                flops=cost.get("flops"),
                bytes_over_floor=round(moved / floor, 3),
                optimal_ms=round(1e3 * cost.get("optimal_seconds", float("nan")), 3),
                floor_ms=round(1e3 * floor / chip.bandwidth, 3),
                flops_ms=round(1e3 * cost.get("flops", float("nan")) / chip.flops, 3),
                compile_s=round(time.time() - t0, 1))


def option(text: str) -> tuple[str, object]:
    """'KEY=VALUE' -> (KEY, VALUE read as YAML, as train overrides are; "default": None)."""
    import yaml
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, None if value == "default" else yaml.safe_load(value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compiled.auto_layout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default="v5p:1x1x1")
    ap.add_argument("--methods", default="ar,streaming")
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--refill", default="before", help="streaming's refill order: before, after")
    ap.add_argument("--layouts", default="default,auto")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None, help="the first N layers of the 8B "
                    "(default: all; fewer for a quick look, bytes then of those layers)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compiler-option", type=option, action="append", default=[],
                    help="KEY=VALUE over the Decoder's step options (VALUE default: libtpu's own)")
    args = ap.parse_args(argv)
    options = dict(args.compiler_option) or None
    from decode.compile import aot
    from wedlm_jax.checkpoints import read_config
    config = read_config(ROOT_ARCH)
    if args.layers:
        config = config.replace(num_layers=args.layers)
    devices, chip = aot.describe_tpu(args.topology)
    dev = devices[0]
    rows = []
    for method in args.methods.split(","):
        for layout in args.layouts.split(","):
            rows.append(measure(config, dev, chip, method, args.page_size, layout, args.refill,
                                options, args.window, args.slots))
            r = rows[-1]
            print(f"{method:10s} W {r['window']} b {r['slots']} refill {r['refill']}  "
                  f"paged {r['page_size']}  {layout:8s} "
                  f"bytes/floor {r['bytes_over_floor']:.3f}  optimal {r['optimal_ms']:.3f} ms "
                  f"(floor {r['floor_ms']:.3f}, flops/peak {r['flops_ms']:.3f})  compile {r['compile_s']} s",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command="python -m benchmarks.compiled.auto_layout " + " ".join(sys.argv[1:] if argv is None else argv),
                           topology=args.topology, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
