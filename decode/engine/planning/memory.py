"""What decoding allocates per device beyond the weights, estimated before anything compiles (the
Decoder refuses settings that cannot fit), and what the device has free."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from decode.engine.step.programs import Static
from wedlm_jax.attention.kv_quant import row_bytes
from wedlm_jax.lora.spec import projection_sizes


def estimate_memory(static: Static) -> dict:
    """Bytes per device of what decoding allocates beyond the weights: the KV cache, one step's
    logits (float32, [slots, S, V], with a softmax-sized temporary), the verified drafts'
    distributions, a prefill chunk's logits, and the LoRA adapter table (decode/lora_options.py;
    replicated)."""
    c = static.config
    rows = static.num_pages * static.page_size if static.paged else static.slots * static.rows
    cache = 2 * c.num_layers * rows * c.num_kv_heads * row_bytes(c.head_dim, static.cache_dtype)
    logits = 2 * static.slots * static.span * c.vocab_size * 4
    q = static.slots * static.span * c.vocab_size * 4 if static.keep_q else 0
    prefill = 2 * static.prefill_chunk * c.vocab_size * 4
    lora = ((static.max_loras + 1) * c.num_layers * static.max_lora_rank
            * sum(i + o for i, o in projection_sizes(c).values())
            * jnp.dtype(static.dtype).itemsize) if static.max_loras else 0
    return dict(cache=cache, logits=logits, q=q, prefill=prefill, lora=lora,
                total=cache + logits + q + prefill + lora)


def available_memory(mesh=None) -> int | None:
    """Free bytes on the first device (the accelerator's own figure), or the host's available
    memory on CPU (/proc/meminfo); None when unknown."""
    dev = (mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0])
    try:
        stats = dev.memory_stats()
    except Exception:  # noqa: BLE001 - platforms without memory stats
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
