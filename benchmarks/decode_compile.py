"""The decode step as the target's compiler sees it (issue 21): `generate` of one step compiled
from abstract shapes (decode/aot.py) for this CPU or a TPU topology (libtpu, no TPU needed), at
the released 8B shape in bf16, with the bytes the step cannot avoid beside it.

    python -m benchmarks.decode_compile [--target cpu|tpu:v5p:1x1x1|...] [--model 8b|0.6b]
                                        [--slots 8] [--capacity 4096] [--live 2048] [--json F]

Per program (AR; streaming W 8/16 with refill before): memory per device (arguments, aliased,
temporaries), and where the compiler reports it, flops, bytes accessed and libtpu's
optimal_seconds. cost_analysis counts a loop body once: the layer scan's body is one layer, so
those figures are one layer plus the rest of the step, not the whole step; the temporaries are
whole-program. The floor: weights + live K/V (`--live` committed rows per slot) + the step's new
K/V rows + logits.
"""

from __future__ import annotations

import argparse
import json
import sys

GIB = 1 << 30


def target_device(name: str):
    import jax
    if name == "cpu":
        return jax.devices("cpu")[0]
    platform, _, topo = name.partition(":")
    if platform != "tpu" or not topo:
        raise SystemExit(f"decode_compile: --target {name!r}: use cpu or tpu:TOPOLOGY (e.g. tpu:v5p:1x1x1)")
    from jax.experimental import topologies
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=topo,
                                            chips_per_host_bounds=(1, 1, 1)).devices[0]
    except Exception as e:  # noqa: BLE001 - no libtpu, or an unknown topology: one line
        raise SystemExit(f"decode_compile: cannot describe {name} ({str(e).splitlines()[0][:200]}); "
                         "the TPU compiler comes with pip install 'jax[tpu]'") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--model", default="8b")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--live", type=int, default=2048)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from benchmarks.accelerator import DECODE_SHAPES, model_config
    from decode.aot import compile_generate
    if a.model not in DECODE_SHAPES:
        raise SystemExit(f"decode_compile: --model {a.model!r}: one of {', '.join(DECODE_SHAPES)}")
    config = model_config(DECODE_SHAPES[a.model]).replace(max_position_embeddings=1 << 20)
    device = target_device(a.target)
    rows = []
    for method, window in (("ar", 1), ("streaming", 8), ("streaming", 16)):
        f = compile_generate(config, device, method=method, window=window, refill="before",
                             slots=a.slots, capacity=a.capacity, dtype="bfloat16", live_rows=a.live)
        rows.append(f)
        m, c = f["memory"], f.get("cost", {})
        print(f"{a.target} {a.model} {method:<9} W={f['window']:<3} slots {a.slots} capacity {a.capacity}: "
              f"args {m['argument'] / GIB:.2f} GiB, aliased {m['alias'] / GIB:.2f}, temporaries "
              f"{m['temp'] / GIB:.3f} GiB (cache {f['cache_bytes'] / GIB:.2f} GiB); "
              + (f"bytes accessed {c['bytes accessed']:.3g}, flops {c.get('flops', 0):.3g}"
                 + (f", optimal_seconds {c['optimal_seconds']:.3g}" if "optimal_seconds" in c else "")
                 + "; " if c else "")
              + f"floor {f['floor']['total']:.3g} B", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(target=a.target, model=a.model, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
