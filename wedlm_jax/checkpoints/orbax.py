"""Orbax folders: `DIR/config.json` + `DIR/params/` (an Orbax PyTree checkpoint, uncompressed) +
the tokenizer files, restored one parameter at a time."""

from __future__ import annotations

import contextlib
import os
import re

import jax
import jax.numpy as jnp

from wedlm_jax import hf_mapping, model
from wedlm_jax.checkpoints.folders import PARAMS_DIR, atomic_output_dir, write_config
from wedlm_jax.checkpoints.tensors import (check_params, copy_tokenizer, nonfinite_error,
                                           parse_dtype, read_config, release_host_memory, settle,
                                           target_shardings)
from wedlm_jax.config import ModelConfig
from wedlm_jax.runtime.failures import Interrupted
from wedlm_jax.safetensors_io import CheckpointError


def _orbax():
    import orbax.checkpoint as ocp
    return ocp


def checkpointer():
    # No compression: zstd over random-looking weights gains little and made Orbax hold a second
    # host copy of every array while saving (BENCHMARKS.md section 10).
    ocp = _orbax()
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def save_orbax(config: ModelConfig, params, out_dir, tokenizer_from=None, force: bool = False,
               config_from=None) -> str:
    """Write `DIR/config.json`, `DIR/params/` (Orbax PyTree checkpoint) and the tokenizer files,
    atomically; the config carries every field of `config_from`'s config.json that `config` does
    not change (`folders.carried_config`)."""
    ocp = _orbax()
    check_params(config, params)
    with atomic_output_dir(out_dir, force) as tmp:
        ckptr = checkpointer()
        ckptr.save(os.path.join(tmp, PARAMS_DIR), args=ocp.args.PyTreeSave(params))
        ckptr.close()
        copy_tokenizer(tokenizer_from, tmp)
        write_config(tmp, config.to_hf_dict(), config_from)
    return os.path.abspath(os.fspath(out_dir))


def _orbax_metadata(ckptr, params_dir: str):
    meta = ckptr.metadata(params_dir).item_metadata
    return getattr(meta, "tree", meta)


def load_orbax(path, mesh=None, dtype=None, allow_nonfinite: bool = False,
               stacked_layers: bool = True) -> tuple[ModelConfig, dict]:
    """Restore an Orbax folder written by `save_orbax` onto `mesh` (or the default device).

    Restores one parameter (embedding, head, one stacked layer parameter, ...) at a time, largest
    first, so the transient host buffers never exceed one parameter and never sit on top of a
    nearly full tree. `stacked_layers=False`: the layers one tree each, a stacked parameter split
    into its layers as soon as it is restored (at most one parameter held twice)."""
    ocp = _orbax()
    path = os.fspath(path)
    params_dir = os.path.join(os.path.abspath(path), PARAMS_DIR)
    config = read_config(path)
    target = parse_dtype(dtype)
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"{path}: no {PARAMS_DIR}/ folder (not an Orbax checkpoint of this "
                              f"project)")
    ckptr = checkpointer()
    with _orbax_read_errors(params_dir):
        stored = _orbax_metadata(ckptr, params_dir)
    check_params(config, stored, source=params_dir)
    shardings = target_shardings(config, mesh, model.param_shapes(config))
    abstract = jax.tree.map(lambda m, s: jax.ShapeDtypeStruct(m.shape, target or m.dtype, sharding=s),
                            stored, shardings)
    params: dict = {}
    leaves = [(tuple(str(getattr(k, "key", k)) for k in kp), leaf)
              for kp, leaf in jax.tree_util.tree_leaves_with_path(abstract)]
    for ppath, leaf in sorted(leaves, key=lambda kl: -kl[1].size * kl[1].dtype.itemsize):
        part: dict = {}
        hf_mapping.set_path(part, ppath, leaf)
        with _orbax_read_errors(params_dir):
            restored = ckptr.restore(params_dir, args=ocp.args.PyTreeRestore(
                part, restore_args=ocp.checkpoint_utils.construct_restore_args(part),
                partial_restore=True))
        leaf = hf_mapping.get_path(restored, ppath)
        if not allow_nonfinite and not bool(jnp.isfinite(leaf).all()):
            bad = int(jnp.size(leaf) - jnp.count_nonzero(jnp.isfinite(leaf)))
            raise nonfinite_error(params_dir, ppath[0] + "".join(f"[{k!r}]" for k in ppath[1:]),
                                   bad)
        settle(params, ppath, leaf, stacked_layers)
        del restored, leaf
        release_host_memory()
    ckptr.close()
    order = abstract if stacked_layers else model.unstack_layers(abstract, config.num_layers)
    return config, jax.tree.map(lambda _, p: p, order, params)  # the config's key order


@contextlib.contextmanager
def _orbax_read_errors(params_dir: str):
    """Any failure to read an Orbax checkpoint (truncated or missing data files, bad metadata) as
    one CheckpointError naming the file when the error does, else the folder."""
    try:
        yield
    except (CheckpointError, Interrupted, KeyboardInterrupt, MemoryError):
        raise
    except Exception as e:
        chain, x = [], e
        while x is not None and len(chain) < 8:
            chain.append(x)
            x = x.__cause__ or x.__context__
        texts = [str(c) for c in chain]
        # tensorstore's own status line (OUT_OF_RANGE, DATA_LOSS, NOT_FOUND, ...) is the useful one
        detail = next((t for t in reversed(texts) if re.search(r"^[A-Z_]{5,}: ", t)), texts[0])
        first = next((l.strip() for l in detail.splitlines() if l.strip()), type(e).__name__)
        array = re.search(r'Error reading "([^"/]+)', detail)
        what = f"array {array.group(1)} of " if array else ""
        raise CheckpointError(f"{params_dir}: cannot read {what}the Orbax checkpoint (truncated "
                              f"or damaged): {first[:300]}") from None
