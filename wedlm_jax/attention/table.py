"""The attention backends, named once: what each is, where it runs and what it reads. The model's
dispatch (`attention.backends`, `attention.cache`), the decoding plan (decode/engine/planning/plan.py) and
the doors' `--attention` choices (decode/config.py) all read this table; adding a backend is a
row here and its function where the dispatch calls it.

No import of jax here: the options read it before anything heavy loads.
"""

from __future__ import annotations

import dataclasses

LAYOUTS = ("causal", "structure", "cache", "mask")
HALF = ("bfloat16", "float16")
KV_DTYPES = ("auto", "int8")   # the cache's storage; auto: in the placement's dtype

# the names, each spelled once
DENSE, TILED, SPLASH, CUDNN, PALLAS = "dense", "tiled", "splash", "cudnn", "pallas"
AUTO = "auto"          # per platform, layout and dtype (`attention.backends.resolve`)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One attention implementation.

    platforms   where it runs (None: any; an accelerator kernel also runs anywhere in interpret
                mode, `kernel`)
    layouts     the layouts it handles (LAYOUTS: causal, structure, cache, mask)
    dtypes      the input dtypes it takes (None: any)
    caches      the decode caches it reads: "dense" (a slot's rows) and / or "paged" (pages
                through a page table; off TPU: the Triton paged kernel or the gather path)
    kv_int8     whether it reads an int8 KV cache (attention.kv_quant)
    smem_tile   its KV tile must fit the device's shared memory (attention.cache.pallas_tile)
    title       how errors name it; `cache_title` when it reads the decode cache
    """
    name: str
    title: str
    platforms: tuple | None = None
    layouts: tuple = LAYOUTS
    dtypes: tuple | None = None
    caches: tuple = ()
    kv_int8: bool = False
    kernel: bool = False
    smem_tile: bool = False
    cache_title: str = ""


BACKENDS = {b.name: b for b in (
    Backend(DENSE, "the dense-mask reference", layouts=LAYOUTS, caches=("dense",), kv_int8=True,
            cache_title="dense cache attention"),
    Backend(TILED, "the tiled XLA path", layouts=("causal", "structure", "cache"),
            caches=("dense", "paged"), kv_int8=True, cache_title="tiled XLA cache attention"),
    Backend(SPLASH, "the Pallas TPU splash-attention kernel", platforms=("tpu",),
            layouts=("causal", "structure"), kernel=True),
    Backend(CUDNN, "cuDNN flash attention via jax.nn.dot_product_attention", platforms=("gpu",),
            layouts=("causal", "cache"), dtypes=HALF, caches=("dense",), kernel=True,
            cache_title="cuDNN attention"),
    Backend(PALLAS, "the Pallas (Triton) kernels (training structures, cache decoding)",
            platforms=("gpu",), layouts=("causal", "structure", "cache"),
            caches=("dense", "paged"), kernel=True, smem_tile=True,
            cache_title="Pallas (Triton) cache kernels"),
)}

IMPLEMENTATIONS = tuple(BACKENDS) + (AUTO,)                  # the model's `attention` setting
CACHE_IMPLEMENTATIONS = tuple(n for n, b in BACKENDS.items() if "cache" in b.layouts)
# a decoder's --attention: auto, the XLA paths (tiled, the default, first), then the kernels
CACHE_CHOICES = (AUTO,) + tuple(sorted(CACHE_IMPLEMENTATIONS,
                                       key=lambda n: (BACKENDS[n].kernel, n != TILED)))
KV_INT8_AUTO = TILED   # what "auto" reads an int8 cache with (the kernels read float rows)


def backend(name: str) -> Backend:
    """The table's row for `name`; ValueError naming the allowed ones otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"attention must be one of {', '.join(BACKENDS)}; got {name!r}")
    return BACKENDS[name]


def for_int8_cache(attention: str) -> str:
    """The cache attention an int8 KV cache decodes with when `attention` is asked for: "auto"
    becomes KV_INT8_AUTO; a backend that does not read int8 rows is a ValueError naming it."""
    if attention == AUTO:
        return KV_INT8_AUTO
    b = backend(attention)
    if not b.kv_int8:
        raise ValueError(f"--kv-dtype int8 is not read by the {b.cache_title}; use --attention "
                         f"{KV_INT8_AUTO} or {AUTO}")
    return attention
