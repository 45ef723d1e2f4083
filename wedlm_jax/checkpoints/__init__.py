"""Checkpoints: Hugging Face safetensors folders and this project's Orbax folders, loaded straight
onto a mesh and written whole or not at all.

    config, params = load_hf_checkpoint(dir, mesh=None, dtype=None)      # HF folder -> JAX
    save_hf_checkpoint(config, params, out_dir)                            # JAX -> HF folder
    save_orbax(config, params, out_dir); config, params = load_orbax(dir)  # Orbax folder
    config, params = load_checkpoint(dir)                                  # either kind

The parts: `tensors` (what both formats share: dtype and size arguments, placement, the tokenizer
files, the name / shape / finiteness checks), `folders` (atomic output folders and what killed
writers leave behind), `hf` and `orbax` (the two formats). `wedlm_jax.convert` is the command.
Loaded weights must be finite unless `allow_nonfinite=True`.
"""

from __future__ import annotations

import os

from wedlm_jax.checkpoints.folders import PARAMS_DIR
from wedlm_jax.checkpoints.hf import load_hf_checkpoint, save_hf_checkpoint
from wedlm_jax.checkpoints import quantized
from wedlm_jax.checkpoints.orbax import load_orbax, save_orbax
from wedlm_jax.checkpoints.tensors import read_config
from wedlm_jax.config import ModelConfig
from wedlm_jax.safetensors_io import CheckpointError

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint", "save_orbax", "load_orbax", "load_checkpoint",
           "checkpoint_kind", "read_config", "CheckpointError"]


def checkpoint_kind(path) -> str:
    """'orbax' or 'hf' for a checkpoint folder."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a folder")
    if os.path.isdir(os.path.join(path, PARAMS_DIR)):
        return "orbax"
    return "hf"


def load_checkpoint(path, mesh=None, dtype=None, **kw) -> tuple[ModelConfig, dict]:
    """Load an Orbax folder (config.json + params/) or a Hugging Face safetensors folder
    (`stacked_layers=False`: the layers one tree each, as GPU decoding holds them); a quantized
    Orbax folder (`wedlm_jax.checkpoints.quantized`) with its kernels quantized as stored."""
    if quantized.read_scheme(path) is not None:
        return quantized.load(path, mesh=mesh, dtype=dtype,
                              allow_nonfinite=kw.get("allow_nonfinite", False),
                              stacked_layers=kw.get("stacked_layers", True))
    if checkpoint_kind(path) == "orbax":
        return load_orbax(path, mesh=mesh, dtype=dtype,
                          allow_nonfinite=kw.get("allow_nonfinite", False),
                          stacked_layers=kw.get("stacked_layers", True))
    return load_hf_checkpoint(path, mesh=mesh, dtype=dtype, **kw)
