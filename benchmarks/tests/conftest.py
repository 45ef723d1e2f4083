"""A stand-in for the shipped demo model in the benchmarks' smoke tests: the same folder layout
(config, the demo's tokenizer and held-out eval.jsonl, bf16 safetensors in two shards with their
index, MANIFEST.sha256) around a tiny Qwen3 with random weights, so a smoke test runs every path of
a benchmark at a fraction of the trained model's compile and step time. Checks of what the trained
model knows stay on demo/model (tests/test_demo_model.py)."""

from __future__ import annotations

import os
import shutil

import pytest

# Untied LM head scaled up (peaky logits: greedy choices far from ties, so two decoding paths that
# should agree do so robustly) and v/o projections scaled up (attention mixes the context: each
# prompt gets its own text); seed 1: verified streaming accepts drafts (about 1.3 tokens a forward).
TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, tie_word_embeddings=False)
WEIGHTS = dict(seed=1, head_scale=30.0, vo_scale=5.0)
SHARD_BYTES = 150_000  # two shards, as the demo model ships


def write_tiny_demo_model(folder: str) -> str:
    """A demo-shaped model folder at `folder` (which must not exist); returns its path."""
    from demo.eval import DEMO_MODEL, write_manifest
    from wedlm_jax.config import ModelConfig
    from wedlm_jax.convert import save_hf_checkpoint
    from wedlm_jax.model import random_params
    config = ModelConfig.from_hf(os.path.join(DEMO_MODEL, "config.json")).replace(**TINY)
    save_hf_checkpoint(config, random_params(config, **WEIGHTS), folder, dtype="bfloat16",
                       max_shard_size=SHARD_BYTES, tokenizer_from=DEMO_MODEL, progress=False)
    shutil.copyfile(os.path.join(DEMO_MODEL, "eval.jsonl"), os.path.join(folder, "eval.jsonl"))
    write_manifest(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_demo_model(tmp_path_factory) -> str:
    """Path of a tiny demo-shaped model folder (write_tiny_demo_model), one per session."""
    return write_tiny_demo_model(str(tmp_path_factory.mktemp("tiny_demo") / "model"))
