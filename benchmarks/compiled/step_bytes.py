"""Where a compiled decode step's bytes go: the top-level instructions of the optimized
program ranked by the bytes they read and write, with the source op each comes from.

    PYTHONPATH=.:.venv/tpu-compiler JAX_PLATFORMS=cpu python -m benchmarks.compiled.step_bytes \
        [--topology v5p:1x1x1] [--method streaming] [--window 16] [--refill before]
        [--layers 2] [--page-size 64] [--slots 8] [--tensor 1] [--top 25]
        [--quantize int8|int4 [--quantize-group N]]

The 8B shape (configs/arch/qwen3-8b) with `--layers` layers (unrolled, so each layer's
instructions are in the program once), bf16, `--slots` slots (heads over `--tensor` chips; the
figures per chip), capacity 4096, the weights in the layouts the
Decoder gives them on the target (decode/engine/planning/layouts.py). libtpu's cost analysis gives the step's total;
this splits it: per instruction, the sizes of its operands and result as the HLO text states them
(an estimate of its HBM traffic: a fusion reads its operands once and writes its result once; an
in-place update of a donated buffer is counted as its update only). Each shape's memory space is
read from its layout (S(1): VMEM on TPU), so the HBM share is counted apart: an async copy into
VMEM (copy-start / copy-done) reads HBM once, and the fusion that consumes it reads VMEM. Groups
by source op (the jax primitive's name stack) tell which part of the step to change.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

ROOT_ARCH = "configs/arch/qwen3-8b"
ITEM = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
        "u32": 4, "f64": 8, "s64": 8, "u64": 8}
SHAPE = re.compile(r"\b(pred|[su](?:4|8|16|32|64)|bf16|f16|f32|f64)\[([\d,]*)\](\{[^}]*\})?")
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
        "conditional", "after-all", "partition-id", "replica-id", "iota"}


def space_bytes(text: str) -> collections.Counter:
    """{memory space: bytes} of every shape in `text`; the space is the layout's S(n) (none: 0,
    the default memory, HBM on TPU; S(1) is VMEM there, per openxla.org/xla/shapes)."""
    out = collections.Counter()
    for dtype, dims, layout in SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        space = re.search(r"S\((\d+)\)", layout or "")
        out[int(space.group(1)) if space else 0] += n * ITEM[dtype]
    return out


def shape_bytes(text: str) -> int:
    return sum(space_bytes(text).values())


def _first_of_tuple(result: str) -> str:
    """The first element of a tuple-shaped result (a copy-start's destination)."""
    m = SHAPE.search(result)
    return m.group(0) if m else ""


def computations(hlo: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines} of an HLO module's text."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            out[name] = []
        elif name and line.startswith(" "):
            out[name].append(line)
    return out


def sliced_reads(comps: dict[str, list[str]], name: str) -> dict[int, int]:
    """{parameter index: bytes read} of fused computation `name`'s parameters that it only slices
    (slice / dynamic-slice, here or inside a nested fusion) or gathers from: a fusion reading one
    layer of a stacked weight reads that layer, not the stack its operand names; one gathering
    rows of a table (an embedding lookup fused with its bounds check) reads those rows."""
    params, users, bitcasts = {}, collections.defaultdict(list), {}
    for line in comps.get(name, ()):
        m = INSTR.match(line)
        if not m:
            continue
        iname, result, op, rest = m.groups()
        if op == "parameter":
            params[iname] = int(re.match(r"\s*(\d+)", rest).group(1))
            continue
        args = rest.split("),", 1)[0] if ")," in rest else rest.rsplit(")", 1)[0]
        called = re.search(r"calls=%?([\w.\-]+)", line)
        for pos, ref in enumerate(re.findall(r"%([\w.\-]+)", args)):
            if op in ("slice", "dynamic-slice", "gather") and pos == 0:
                users[ref].append(shape_bytes(result))
            elif op == "fusion" and called:
                users[ref].append(sliced_reads(comps, called.group(1)).get(pos))
            elif op == "bitcast":                      # the same bytes: its users' reads count
                bitcasts[ref] = iname
                users[ref].append(0)
            else:
                users[ref].append(None)                  # read whole

    def reads(ref, depth=0):
        got = list(users[ref])
        if ref in bitcasts and depth < 8:
            got.append(reads(bitcasts[ref], depth + 1))
        return sum(got) if got and all(b is not None for b in got) else None
    out = {idx: reads(p) for p, idx in params.items()}
    return {idx: b for idx, b in out.items() if b is not None}


def instruction_bytes(hlo: str) -> list[dict]:
    """Top-level instructions (not inside fusions) with their estimated bytes, source op and kind.
    Operands are sized by the shapes printed with them or, when the text names them only, by
    the shape their own instruction produces."""
    comps = computations(hlo)
    fused = {c for lines in comps.values() for line in lines
             for c in re.findall(r"calls=%?([\w.\-]+)", line) if "fusion(" in line}
    sizes = {}
    for lines in comps.values():
        for line in lines:
            m = INSTR.match(line)
            if m:
                sizes[m.group(1)] = space_bytes(m.group(2))
    rows = []
    for cname, lines in comps.items():
        if cname in fused:
            continue
        for line in lines:
            m = INSTR.match(line)
            if not m:
                continue
            name, result, op, rest = m.groups()
            if op in FREE:
                continue
            args = rest.split("),", 1)[0] if ")," in rest else rest.rsplit(")", 1)[0]
            ins = [space_bytes(typ) if typ else sizes.get(ref, collections.Counter())
                   for typ, ref in re.findall(r"(?:(\S*\[\S*)\s+)?%([\w.\-]+)", args)]
            called = re.search(r"calls=%?([\w.\-]+)", line)
            if op == "fusion" and called and called.group(1) in comps:
                for i, read in sliced_reads(comps, called.group(1)).items():
                    if i < len(ins) and ins[i]:
                        space = max(ins[i], key=ins[i].get)       # the operand's memory space
                        ins[i] = collections.Counter({space: min(read, sum(ins[i].values()))})
            in_c, out_c = sum(ins, collections.Counter()), space_bytes(result)
            if "dynamic-update-slice" in name or "dynamic_update_slice" in name or \
                    op == "dynamic-update-slice" or ("scatter" in name and ins):
                big = max(range(len(ins)), key=lambda i: sum(ins[i].values()), default=None)
                in_c = sum((c for i, c in enumerate(ins) if i != big), collections.Counter())
                out_c = collections.Counter(in_c)          # in place: the update only
            elif op == "copy-start":     # reads its operand, writes its destination (the tuple's
                out_c = space_bytes(_first_of_tuple(result))     # other parts alias the source)
            elif op == "copy-done":      # the transfer is the copy-start's
                in_c = out_c = collections.Counter()
            src = re.search(r'op_name="([^"]*)"', line)
            if src and re.search(r"(^|/)gather$", src.group(1)) and ins:
                # a gather reads the rows it produces, not its whole operand (the embedding
                # table, the logits a token's log-probability is picked from)
                big = max(range(len(ins)), key=lambda i: sum(ins[i].values()))
                rows_read = collections.Counter({k: min(v, sum(out_c.values()))
                                                 for k, v in ins[big].items()})
                in_c = sum((c for i, c in enumerate(ins) if i != big), rows_read)
            total = in_c + out_c
            cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
            target = re.search(r'custom_call_target="([^"]+)"', line)
            kernel = re.search(r'name = \\?"(\w+)\\?"', line) if target else None
            rows.append(dict(computation=cname, name=name, op=op, bytes=sum(total.values()),
                             target=target.group(1) if target else None,
                             kernel=kernel.group(1) if kernel else None,
                             hbm_bytes=total[0], result=result[:80],
                             source=src.group(1) if src else "",
                             cycles=int(cycles.group(1)) if cycles else None))
    return sorted(rows, key=lambda r: -r["bytes"])


# custom calls that are attention kernels (a Mosaic kernel on TPU, a Pallas Triton kernel on GPU):
# their operands are whole buffers, not their traffic, which the callers add analytically
KERNEL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton")
# Pallas kernels (by their pallas_call name) that read every operand once and write their
# result once: counted like any instruction (wedlm_jax.grouped_matmul)
COUNTED_KERNELS = ("wedlm_grouped_matmul",)


def hbm_traffic(hlo: str) -> float:
    """Estimated HBM bytes of a compiled program: its top-level instructions' operands and results
    in the default memory space (`instruction_bytes`), attention-kernel custom calls left out (a
    library GEMM call is counted like any instruction)."""
    return float(sum(r["hbm_bytes"] for r in instruction_bytes(hlo) if not is_attention_kernel(r)))


def is_attention_kernel(row: dict) -> bool:
    """Whether an `instruction_bytes` row is an attention kernel's custom call (its operands
    whole buffers, not its traffic); a kernel that reads its operands whole
    (`COUNTED_KERNELS`) is not."""
    named = f"{row.get('kernel') or ''} {row['name']}"     # Triton: its name; Mosaic: the call's
    return (row["op"] == "custom-call" and row["target"] in KERNEL_TARGETS
            and not any(k in named for k in COUNTED_KERNELS))


def kernel_not_counted(slots: int, span: int, config, live_rows: int, dtype: str) -> float:
    """Bytes a step's paged-attention kernel calls move that the compiler's cost analysis does not
    count (libtpu counts ~10 KB per Mosaic call whatever its operands): every layer's live K/V
    pages (`decode.compile.aot.kv_not_counted`), its queries read and its output written."""
    import jax.numpy as jnp

    from decode.compile.aot import kv_not_counted
    item = jnp.dtype(dtype).itemsize
    q_out = 2 * config.num_layers * slots * span * config.num_heads * config.head_dim * item
    return kv_not_counted(slots, config, live_rows, 0, dtype) + q_out


def grouped_kernel_bytes(config, rows: int, group: int, bits: int, dtype: str,
                         kernel: str = "mosaic", flops: bool = False) -> float:
    """Bytes the grouped matmul kernel's calls in a step move (wedlm_jax.grouped_matmul; libtpu
    counts ~10 KB and no flops for a Mosaic call whatever its operands): for every layer's
    projection whose shapes `kernel` tiles, its `bits`-bit values and group scales read once,
    its `rows` input rows read and output rows written; nothing past the kernel's MAX_ROWS
    (XLA's gemm then). `flops`: their matmuls' flops instead (2 x rows x K x N)."""
    import jax.numpy as jnp

    from wedlm_jax import grouped_matmul as gm
    if not group or rows > gm.MAX_ROWS[kernel]:
        return 0.0
    item = jnp.dtype(dtype).itemsize
    e, m = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = [(e, q), (e, kv), (e, kv), (q, e), (e, m), (e, m), (m, e)]
    cost = ((lambda k, n: 2.0 * rows * k * n) if flops else
            (lambda k, n: k * n * bits / 8 + (k // group) * n * item + rows * (k + n) * item))
    per_layer = sum(cost(k, n) for k, n in shapes if gm.supported(k, n, group, kernel))
    return per_layer * config.num_layers


def source_group(source: str) -> str:
    """A short key of the source op: the name stack without the jit prefix and indices."""
    parts = [p for p in source.split("/") if p and not p.startswith(("jit(", "while", "body", "cond"))]
    return "/".join(re.sub(r"\[.*?\]|\d+", "", p) for p in parts[-3:]) or "(no source)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compiled.step_bytes",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default="v5p:1x1x1", help="a TPU topology, or h100 (XLA's GPU "
                    "compiler: PYTHONPATH=.:.venv/gpu-compiler)")
    ap.add_argument("--method", default="streaming")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--refill", default="before", help="streaming's refill order: before, after")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--weight-layout", default="auto")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--tensor", type=int, default=1, help="heads over this many of the chips")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--quantize", default="none", help="the projections' weights: none, int8, int4")
    ap.add_argument("--quantize-group", type=int, default=None,
                    help="int4's group (0: per channel)")
    ap.add_argument("--attention", default="tiled", help="the cache attention (auto: the "
                    "Decoder's choice for the target, the Triton kernel on GPU)")
    args = ap.parse_args(argv)
    from decode.compile import aot
    from decode.config import EngineOptions, Placement
    from wedlm_jax.runtime.compiled import figures
    from wedlm_jax.checkpoints import read_config
    config = read_config(ROOT_ARCH).replace(num_layers=args.layers)
    devs = aot.describe_target(args.topology)[0][:args.tensor]     # a TPU topology, or h100
    dec, compiled = aot.generate_program(
        config, devs, EngineOptions(method=args.method, window=args.window, refill=args.refill,
                                    slots=args.slots, capacity=4096),
        Placement(dtype="bfloat16", page_size=args.page_size or 0,
                  weight_layout=args.weight_layout, attention=args.attention,
                  quantize=args.quantize, quantize_group=args.quantize_group,
                  mesh=(1, 1, args.tensor)), scan_unroll=args.layers)
    cost = figures(compiled).get("cost") or {}
    floor = aot.step_floor(dec.static, 2048, args.tensor)
    rows = instruction_bytes(compiled.as_text())
    total = sum(r["bytes"] for r in rows)
    custom = [r for r in rows if r["op"] == "custom-call"]
    hbm = sum(r["hbm_bytes"] for r in rows if not is_attention_kernel(r))
    if dec.static.paged:       # a Mosaic kernel's operands are whole buffers, not its traffic
        kernel = kernel_not_counted(args.slots, dec.static.spec.span, config, 2048,
                                    "bfloat16") / args.tensor
        kernel_note = "the paged-attention kernels' live pages, queries and output (analytic)"
    else:
        kernel = 0.0
        kernel_note = "no kernel"
    print(f"{args.method} W {dec.window} ({dec.weight_layout} weight layout), {args.layers} layers: "
          f"libtpu bytes accessed {cost.get('bytes accessed', float('nan')) / 1e9:.3f} GB; "
          f"instructions' operand+result bytes {total / 1e9:.3f} GB; floor at 2048 live rows "
          f"{floor['total'] / 1e9:.3f} GB (weights {floor['weights'] / 1e9:.3f}, KV "
          f"{floor['kv_read'] / 1e9:.3f}, logits {floor['logits'] / 1e9:.3f})")
    print(f"HBM traffic estimate (operands and results in memory space 0; VMEM-resident reads "
          f"and writes, S(1), apart; attention kernels' custom calls replaced by {kernel_note}; "
          f"the grouped matmul kernel's operands and result counted): "
          f"{(hbm + kernel) / 1e9:.3f} GB = {(hbm + kernel) / floor['total']:.3f} of the floor")
    timed = [r["cycles"] for r in rows if r["cycles"] is not None]
    print(f"the compiler's own per-instruction estimate (backend_config estimated_cycles, on "
          f"{len(timed)} of {len(rows)} instructions: the matmul fusions): {sum(timed):,} cycles")
    groups, hbm_groups = collections.Counter(), collections.Counter()
    for r in rows:
        groups[source_group(r["source"])] += r["bytes"]
        hbm_groups[source_group(r["source"])] += 0 if is_attention_kernel(r) else r["hbm_bytes"]
    print("\nby source op (all memory spaces | HBM):")
    for key, b in groups.most_common(args.top):
        print(f"  {b / 1e6:10.1f} MB  {hbm_groups[key] / 1e6:10.1f} MB  {key}")
    print(f"\ntop {args.top} instructions (all memory spaces | HBM):")
    for r in rows[:args.top]:
        print(f"  {r['bytes'] / 1e6:10.1f} MB  {r['hbm_bytes'] / 1e6:10.1f} MB  {r['op']:<22} "
              f"{r['result']:<60} {source_group(r['source'])}")
    if custom:
        print(f"\n{len(custom)} custom calls (operand sizes, not traffic): "
              f"{sum(r['bytes'] for r in custom) / 1e9:.3f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
