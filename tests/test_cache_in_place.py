"""The decode step updates the KV cache in place: compiled for this CPU from
abstract shapes (decode/compile/aot.py), the generate program's temporaries do not grow with the cache
capacity (a step that copied or re-created the cache would hold cache-sized buffers), and the
donated cache is aliased to the output."""

from __future__ import annotations

import jax
import pytest

from decode.compile.aot import compile_generate
from decode.config import EngineOptions, Placement
from wedlm_jax.config import ModelConfig

CONFIG = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
                     max_position_embeddings=1 << 16)


@pytest.mark.parametrize("method,refill", [("streaming", "before"), ("ar", "before"),
                                           ("verified", "after")])
def test_generate_holds_no_cache_sized_temporary(method, refill):
    cpu = jax.devices()[0]
    fig = {cap: compile_generate(CONFIG, cpu, EngineOptions(method=method, window=8, refill=refill,
                                                           slots=4, capacity=cap),
                                 Placement(dtype="float32", attention="tiled", kv_tile=128,
                                           page_size=0))
           for cap in (512, 4096)}
    cache_growth = fig[4096]["cache_bytes"] - fig[512]["cache_bytes"]
    temp_growth = fig[4096]["memory"]["temp"] - fig[512]["memory"]["temp"]
    assert cache_growth > 4 << 20
    assert temp_growth < 0.05 * cache_growth, (temp_growth, cache_growth)
    for f in fig.values():      # the donated cache comes back in the same buffers
        assert f["memory"]["alias"] >= f["cache_bytes"]
