"""Hugging Face safetensors folders <-> JAX params.

Loading checks every tensor name and shape against the config before reading any data, then
assembles one parameter at a time (a stacked layer parameter from its layers' tensors, read one by
one; largest first, so the transient host copy never sits on top of a nearly full tree) and places
it straight into its target sharding: on a mesh each device receives only its slice. Saving
gathers one tensor (one layer's slice) at a time."""

from __future__ import annotations

import os

import jax
import numpy as np

from wedlm_jax import hf_mapping, model
from wedlm_jax import safetensors_io as st
from wedlm_jax.checkpoints.folders import (atomic_output_dir, check_out_dir, source_config,
                                           write_config, write_json)
from wedlm_jax.checkpoints.tensors import (LIST_LIMIT, check_params, copy_tokenizer,
                                           count_nonfinite, name_list, nonfinite_error, parse_dtype,
                                           parse_size, progress_bar, read_config,
                                           release_host_memory, settle, target_shardings)
from wedlm_jax.config import ModelConfig, settle_qk_norm
from wedlm_jax.safetensors_io import CheckpointError


def plan_hf_load(config: ModelConfig, tensors: dict[str, st.TensorInfo], allow_extra: bool = False,
                 source: str = "checkpoint") -> list[tuple[st.TensorInfo, tuple, str, tuple, int | None]]:
    """Match a checkpoint's tensors (headers only) against `config`: [(info, param path,
    transform, JAX shape, layer)], or a CheckpointError naming every missing, unexpected or
    misshapen tensor. A layer tensor is slice `layer` of the stacked parameter at `param path`
    (its JAX shape is the slice's)."""
    expected = hf_mapping.expected_tensors(config, model.param_shapes(config))
    present = {n: i for n, i in tensors.items() if not any(rx.match(n) for rx in hf_mapping.IGNORED)}
    if config.tie_word_embeddings:
        present.pop("lm_head.weight", None)
    missing = [n for n in expected if n not in present]
    extra = [n for n in present if n not in expected]
    if missing:
        raise CheckpointError(f"{source}: missing {len(missing)} tensor(s) the config "
                              f"({config.model_type}, {config.num_layers} layers) needs: "
                              f"{name_list(missing)}")
    if extra and not allow_extra:
        raise CheckpointError(f"{source}: {len(extra)} unexpected tensor(s) not used by a "
                              f"{config.model_type} model: {name_list(extra)} (pass --allow-extra / "
                              f"allow_extra=True to skip them)")
    bad = [f"{n} has shape {list(present[n].shape)} in {os.path.basename(present[n].file)}, the "
           f"config needs {list(hf)}" for n, (_, _, _, hf, _) in expected.items()
           if tuple(present[n].shape) != tuple(hf)]
    if bad:
        raise CheckpointError(f"{source}: shape mismatch: " + "; ".join(bad[:LIST_LIMIT]) +
                              (f" ... and {len(bad) - LIST_LIMIT} more" if len(bad) > LIST_LIMIT
                               else ""))
    return [(present[n], path, kind, jshape, layer)
            for n, (path, kind, jshape, _, layer) in expected.items()]


def _group_by_param(plan) -> list[tuple[tuple, list]]:
    """The plan grouped by target parameter (a stacked layer parameter gathers its layers' tensors
    in layer order), largest parameter first."""
    groups: dict[tuple, list] = {}
    for item in plan:
        groups.setdefault(item[1], []).append(item)
    out = [(path, sorted(items, key=lambda it: -1 if it[4] is None else it[4]))
           for path, items in groups.items()]
    return sorted(out, key=lambda g: -sum(it[0].nbytes for it in g[1]))


def load_hf_checkpoint(path, mesh=None, dtype=None, allow_extra: bool = False,
                       progress: bool = True, allow_nonfinite: bool = False,
                       stacked_layers: bool = True) -> tuple[ModelConfig, dict]:
    """Read a Hugging Face safetensors checkpoint folder into (config, params).

    `dtype`: None keeps each tensor's stored dtype, else 'bf16' / 'f32' (or a dtype). With a
    `mesh`, every param lands in the sharding `sharding.tree_shardings` gives it; without, on the
    default device. One parameter is assembled on the host at a time (a stacked layer parameter
    from its layers' tensors, read one by one), largest first, and placed before the next.
    `stacked_layers=False`: the layers one tree each (`model.unstack_layers`'s tree), placed layer
    by layer."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a folder")
    config = read_config(path)
    target = parse_dtype(dtype)
    tensors = st.index_tensors(path)
    config = settle_qk_norm(config, path, tensors)  # released-checkpoint convention, from headers
    plan = plan_hf_load(config, tensors, allow_extra, source=path)
    shardings = target_shardings(config, mesh, model.param_shapes(config))
    params: dict = {}
    with progress_bar(sum(i.nbytes for i, *_ in plan), "load " + os.path.basename(path.rstrip("/")),
                   progress) as bar:
        for ppath, items in _group_by_param(plan):
            stacked = items[0][4] is not None
            dt = target or np.result_type(*(st.DTYPES[it[0].dtype] for it in items))
            arr = np.empty(((len(items),) if stacked else ()) + items[0][3], dt)
            for info, _, kind, jshape, layer in items:
                raw = st.read_tensor(info)
                if not allow_nonfinite and (bad := count_nonfinite(raw)):
                    raise nonfinite_error(info.file, info.name, bad)
                if stacked:
                    arr[layer] = hf_mapping.to_jax(kind, raw, jshape)
                else:
                    arr[...] = hf_mapping.to_jax(kind, raw, jshape)
                del raw
                bar.update(info.nbytes)
            settle(params, ppath, arr, stacked_layers, hf_mapping.get_path(shardings, ppath))
            del arr
            release_host_memory()
    return config, params


def to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise CheckpointError("params span several processes; gather them to one host before "
                              "saving (multi-host export is not supported)")
    return np.asarray(jax.device_get(x))


def save_hf_checkpoint(config: ModelConfig, params, out_dir, *, dtype=None,
                       max_shard_size: int | str = "5GB", tokenizer_from=None, force: bool = False,
                       progress: bool = True, config_from=None) -> str:
    """Write `params` as a Hugging Face checkpoint folder: safetensors (sharded with
    `model.safetensors.index.json` above `max_shard_size`), `config.json` (carrying every field of
    `config_from`'s config.json that this one does not change: `folders.carried_config`),
    tokenizer files from `tokenizer_from`. Arrays are gathered to the host one tensor at a time.
    Returns out_dir."""
    target = parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    check_params(config, params)
    check_out_dir(os.path.abspath(os.fspath(out_dir)), force)
    expected = hf_mapping.expected_tensors(config, model.param_shapes(config))
    specs, kinds = [], {}
    for name, (ppath, kind, _, hf_shape, layer) in expected.items():
        leaf = hf_mapping.get_path(params, ppath)
        specs.append((name, st.dtype_name(target or leaf.dtype), hf_shape))
        kinds[name] = (ppath, kind, layer)
    sizes = [int(np.prod(s)) * st.DTYPES[d].itemsize for _, d, s in specs]

    def fetch(name):  # one tensor (one layer's slice of a stacked parameter) to the host
        ppath, kind, layer = kinds[name]
        leaf = hf_mapping.get_path(params, ppath)
        return hf_mapping.to_hf(kind, to_host(leaf if layer is None else leaf[layer]))

    shards = st.plan_shards(sizes, limit)
    with atomic_output_dir(out_dir, force) as tmp, progress_bar(sum(sizes), "save", progress) as bar:
        if len(shards) == 1:
            write_safetensors(os.path.join(tmp, st.SINGLE_NAME), specs, fetch, bar.update)
        else:
            weight_map = {}
            for k, shard in enumerate(shards):
                fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                write_safetensors(os.path.join(tmp, fname), [specs[i] for i in shard], fetch,
                                  bar.update)
                weight_map.update({specs[i][0]: fname for i in shard})
            write_json(os.path.join(tmp, st.INDEX_NAME),
                        {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map})
        copy_tokenizer(tokenizer_from, tmp)
        hf = config.to_hf_dict()
        hf["dtype"] = "bfloat16" if specs[0][1] == "BF16" else "float32"
        if "torch_dtype" in source_config(config_from):   # the older name, kept in step
            hf["torch_dtype"] = hf["dtype"]
        write_config(tmp, hf, config_from)
    return os.path.abspath(os.fspath(out_dir))


def write_safetensors(file, specs, fetch, on_tensor=None) -> None:
    """One safetensors file; a module-level seam so tests can interrupt a conversion mid-way."""
    st.write_file(file, specs, fetch, on_tensor)
