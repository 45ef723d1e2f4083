"""The weights in the layouts the compiled decode step asks for.

A weight loaded from a checkpoint is row-major. On TPU that is not the compiler's tile order for
every weight, and a program that takes row-major weights copies them into its own order inside
every call: for the 8B decode step on v5p those relayout copies are most of what it moves beyond
its floor (BENCHMARKS.md section 7, "What each default buys"). So the Decoder compiles
`generate` with every weight's layout left to the
compiler (`Layout.AUTO`), puts its weights into the layouts that compile chose, once, and keeps
the compiled program for its `generate` calls. The other programs that read the weights (prefill,
the static batch's prefill, the paged prefill, `step_with_aux`) compile for the weights as they
are: jit follows a committed argument's layout, so they read them without a copy too.

    resolve(choice, platform, quantized)  "auto" -> "compiler" on TPU, and on GPU for quantized
                               weights (the int4 gemm reads its values in another order: row-major
                               ones are transposed at every step); "default" elsewhere (the GPU and
                               CPU compilers keep row-major float weights in their matmuls' order)
    layers_stacked(platform, grouped_kernel)  whether the decode programs take the layers'
                               weights stacked (one buffer per weight, a layer scan) or one tree
                               per layer: on GPU the latter, since XLA:GPU copies each layer's
                               weights out of the stacked buffer at every step (BENCHMARKS.md
                               section 8); on TPU too where grouped weights are read by the
                               Mosaic kernel (a custom call's operand sliced out of a stack is a
                               copy of it: the stacked 8B MLP kernels were copied at every step)
    step_options(device, given, quantized) the compiler options `generate` is compiled with on
                               `device`: STEP_OPTIONS of its TPU generation (QUANTIZED_GPU_OPTIONS
                               for quantized weights on GPU), `given` over them (a key
                               given as None: the compiler's own default)
    choose(decoder)            (the compiled `generate`, the weights' formats it chose, its options)
    place(params, formats)     the weights in those formats (abstract shapes stay abstract)
    abstract_weights(config, static, device)   the weights as ShapeDtypeStructs, in the form a
                               Decoder on one device holds them (ahead-of-time compiles)
    shapes_of(tree), on_device(device, tree)   a tree's ShapeDtypeStructs, or placed on one device
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from decode.config import WEIGHT_LAYOUTS
from decode.engine.runtime import adapters
from wedlm_jax import model as model_lib
from wedlm_jax import quantize


def resolve(choice: str, platform: str, quantized: bool = False, adapters: bool = False) -> str:
    """The weight layout a Decoder on `platform` uses: "compiler" (the layouts its compiled decode
    step picks) or "default" (row-major, as loaded); `quantized`: the weights are; `adapters`:
    it holds a LoRA adapter table (written between steps: "auto" takes the default layout)."""
    if choice not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout {choice!r} is unknown; allowed: {', '.join(WEIGHT_LAYOUTS)}")
    if choice == "compiler" and adapters:
        raise ValueError("--enable-lora takes --weight-layout default or auto (the adapter table "
                         "is written between steps, in the default layout)")
    if choice == "auto" and adapters:
        return "default"
    if choice == "auto":
        gpu = platform in ("gpu", "cuda", "rocm")
        return "compiler" if platform == "tpu" or (gpu and quantized) else "default"
    return choice


def layers_stacked(platform: str, grouped_kernel: bool = False) -> bool:
    """Stacked layer weights (a layer scan) everywhere but on GPU, and on TPU when a Pallas kernel
    reads grouped weights (`grouped_kernel`; see the module docstring)."""
    return platform not in ("gpu", "cuda", "rocm") and not (grouped_kernel and platform == "tpu")


# libtpu options for the decode step, per TPU generation, chosen from compiles of the 8B step
# (BENCHMARKS.md section 7, "What each default buys"). On v5p libtpu's default scoped-VMEM limit
# keeps a 128-row step's up_proj a fusion of its own (its output written to HBM and read back by
# down_proj); with a core's whole 64 MiB it fuses them as it does at 8 rows, and the other
# decode programs compared are faster or about the same. MaxText's v5p recipes pass the same
# limit. v6e is not listed: 96 MiB there speeds one program and slows another, by the mesh.
# Other generations compile with libtpu's defaults. The options ride on the compiler's weight
# layouts, the TPU default: a Decoder given weight_layout "default" runs the plain jitted step,
# compiled with the defaults.
STEP_OPTIONS = {"v5p": {"xla_tpu_scoped_vmem_limit_kib": 65536}}
# XLA:GPU merges the q / k / v projections' dots into one over their concatenated kernels: for
# int4 kernels it casts them to bf16 to concatenate, written out and read again at every step
# (docs/quantization.md); with the merge off each
# projection's gemm reads its int4 values itself.
QUANTIZED_GPU_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


def step_options(device, given: dict | None = None, quantized: bool = False) -> dict | None:
    """Compiler options of the decode step on `device`: STEP_OPTIONS of its TPU generation (or
    QUANTIZED_GPU_OPTIONS for `quantized` weights on a GPU) with `given` over them; a key given as
    None is dropped (the compiler's default). None when empty."""
    from wedlm_jax.runtime.targets import tpu_generation
    gpu = quantized and getattr(device, "platform", "") in ("gpu", "cuda", "rocm")
    base = QUANTIZED_GPU_OPTIONS if gpu else STEP_OPTIONS.get(tpu_generation(device), {})
    merged = dict(base, **(given or {}))
    merged = {k: v for k, v in merged.items() if v is not None}
    return merged or None


def _abstract(x, fallback):
    """A leaf as a ShapeDtypeStruct carrying its sharding (`fallback` when it has none)."""
    sharding = getattr(x, "sharding", None) or fallback
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def choose(decoder, compiler_options: dict | None = None):
    """`generate` of `decoder` (k = its steps_per_call) compiled with the weights' layouts left to
    the compiler, under `step_options` (with `compiler_options` over them, e.g.
    `wedlm_jax.runtime.compiled.estimate_options` for a program compiled to be costed); returns (compiled
    program, the weights' formats as a pytree of Format, the options it was compiled with)."""
    dev = decoder.plan.device
    home = jax.sharding.SingleDeviceSharding(dev)
    params = jax.tree.map(lambda x: _abstract(x, home), decoder.params)
    options = step_options(dev, compiler_options, decoder.static.quantize != "none")
    compiled = decoder.compile("generate", options, params=params, auto_weight_layouts=True)
    return compiled, compiled.input_formats[0][0], options


def place(params, formats):
    """`params` in `formats` (one device_put; ShapeDtypeStructs get the formats as their sharding,
    for programs compiled ahead of time)."""
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        return jax.tree.map(lambda x, f: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=f),
                            params, formats)
    return jax.device_put(params, formats)


def shapes_of(tree):
    """A tree's ShapeDtypeStructs (no placement)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def on_device(device, tree):
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
                        tree)


def is_abstract(tree) -> bool:
    """Whether `tree` is shapes only (ShapeDtypeStructs: weights for an ahead-of-time compile)."""
    return all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def abstract_weights(model_config, static, device):
    """The weights a Decoder of `static` holds on one `device`, as ShapeDtypeStructs: its dtype,
    quantized, stacked or one tree per layer, with the adapter table when it has one."""
    params = model_lib.param_shapes(model_config, jnp.dtype(static.dtype))
    params = quantize.quantize_params(params, static.quantize, static.quantize_group)
    if not static.stacked_layers:
        params = model_lib.unstack_layers(params, model_config.num_layers)
    params = adapters.with_table_shapes(params, static) if static.max_loras else params
    return on_device(device, params)
