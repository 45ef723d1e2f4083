"""What a compiled program says about itself, read the same way by every dry run and benchmark
(training's `train.dry_run`, decoding's `decode.compile.aot`, `benchmarks.compiled.compile_for`): XLA's memory
analysis per device, its cost analysis where the compiler gives one, and the custom-call kernels
it really emitted."""

from __future__ import annotations

import re

COST_KEYS = ("flops", "bytes accessed", "optimal_seconds", "transcendentals")


def memory(compiled) -> dict:
    """Per-device bytes: total = arguments + outputs - aliased (a donated state updated in
    place) + temporaries."""
    m = compiled.memory_analysis()
    fig = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
           for k in ("argument", "output", "alias", "temp", "generated_code")}
    fig["total"] = fig["argument"] + fig["output"] - fig["alias"] + fig["temp"]
    return fig


def cost(compiled) -> dict:
    """flops, bytes accessed, libtpu's optimal_seconds ... ({} where the compiler reports none:
    XLA:GPU). A loop body counts once."""
    c = compiled.cost_analysis()
    if isinstance(c, (list, tuple)):
        c = c[0] if c else None
    return {k: float(v) for k, v in (c or {}).items() if k in COST_KEYS}


# libtpu's cost model has no figure for work it offloads to a SparseCore (v5p and v6e offload
# large scatters and gathers there: the embedding's gradient, the masking's scatter-adds): each
# such op puts -2 s into `optimal_seconds` (BENCHMARKS.md section 9, "MFU estimate"). A program
# compiled only for its cost estimate keeps that work on the TensorCore, where the cost model sees
# it (a conservative figure: the offload would overlap).
NO_SPARSECORE_OFFLOAD = {
    f"xla_tpu_enable_offloading_{op}_to_sparsecore": False
    for op in ("scatter", "gather", "sort", "reduce", "copy", "reshape")}
NO_SPARSECORE_OFFLOAD["xla_tpu_enable_sparse_core_compute_offload"] = False
# ... nor for the sliced prefetches memory-space assignment adds to deep programs (async
# slice-start / slice-done): -1 or -2 s again (BENCHMARKS.md section 7, the v6e slice).
NO_SLICED_PREFETCH = {"xla_tpu_sliced_prefetch_max_slices": 0}


def estimate_options(platform: str) -> dict | None:
    """Compiler options for a program compiled to be costed (not run) on `platform`."""
    return dict(NO_SPARSECORE_OFFLOAD, **NO_SLICED_PREFETCH) if platform == "tpu" else None


def kernels(compiled) -> dict:
    """{custom-call target: count} in the compiled HLO: a TPU Pallas/Mosaic kernel (splash, the
    ragged paged attention) shows as `tpu_custom_call`, a Triton kernel on GPU as
    `__gpu$xla.gpu.triton`, cuDNN attention as `__cudnn$fmha...`."""
    counts: dict = {}
    for target in re.findall(r'custom_call_target="([^"]+)"', compiled.as_text() or ""):
        counts[target] = counts.get(target, 0) + 1
    return dict(sorted(counts.items()))


def figures(compiled) -> dict:
    """memory, cost (when reported) and kernels of a compiled program."""
    out = dict(memory=memory(compiled), kernels=kernels(compiled))
    c = cost(compiled)
    if c:
        out["cost"] = c
    return out
