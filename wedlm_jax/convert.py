"""Hugging Face safetensors <-> JAX params <-> Orbax, and the `wedlm-convert` command.

    config, params = load_hf_checkpoint(dir, mesh=None, dtype=None)      # HF folder -> JAX
    save_hf_checkpoint(config, params, out_dir)                            # JAX -> HF folder
    save_orbax(config, params, out_dir); config, params = load_orbax(dir)  # Orbax folder
    config, params = load_checkpoint(dir)                                  # either kind

    wedlm-convert hf-to-orbax --hf DIR --out DIR [--dtype bf16|f32] [--allow-extra] [--force]
    wedlm-convert orbax-to-hf --orbax DIR --out DIR [--dtype bf16|f32] [--max-shard-size 5GB] [--force]
    (both: [--allow-nonfinite] to convert weights holding NaN/Inf)

Loading checks every tensor name and shape against the config before reading any data, then
assembles one parameter at a time (a stacked layer parameter from its layers' tensors, read one by
one; largest first, so the transient host copy never sits on top of a nearly full tree) and places
it straight into its target sharding: on a mesh each device receives only its slice. Saving
gathers one tensor (one layer's slice) at a time. Every writer builds the output in a hidden sibling folder
(`.NAME.partial-HOST-PID-*`), writes `config.json` last, and renames the folder into place only
when it is complete; an existing checkpoint at the destination is replaced only with `force=True`,
and only after the new one is complete. A writer killed outright leaves its partial folder behind;
the next writer into the same parent folder removes the partial folders of processes of this host
that are no longer alive (never a live one's). The command cleans up and exits with one line on
SIGINT / SIGTERM and on a full disk; loaded weights must be finite unless `--allow-nonfinite`.

An Orbax folder is `DIR/config.json` + `DIR/params/` (an Orbax PyTree checkpoint, uncompressed) +
the tokenizer files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax import hf_mapping, model, sharding
from wedlm_jax import safetensors_io as st
from wedlm_jax.config import ConfigError, ModelConfig, settle_qk_norm
from wedlm_jax.dtypes import DTYPE_ALIASES, DtypeError, allowed, jnp_dtype
from wedlm_jax.failures import (DiskFullError, check_space, check_writable, disk_full, format_bytes,
                                mount_point)
from wedlm_jax.safetensors_io import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json", "chat_template.jinja", "tokenizer.model",
                   "added_tokens.json")
PARAMS_DIR = "params"
_LIST_LIMIT = 12

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint", "save_orbax", "load_orbax", "load_checkpoint",
           "CheckpointError", "main"]


# --------------------------------------------------------------------------- small helpers

def parse_dtype(dtype) -> np.dtype | None:
    """None (keep each tensor's dtype), a dtype name or alias of `wedlm_jax.dtypes` (bf16, f32,
    ...) or a numpy / jax dtype."""
    if dtype is None:
        return None
    try:
        return np.dtype(jnp_dtype(dtype))
    except DtypeError as e:
        raise CheckpointError(str(e)) from None


def parse_size(size) -> int:
    """Bytes from an int or a string like '5GB', '500MB', '2MiB', '100KB'."""
    if isinstance(size, int):
        if size <= 0:
            raise CheckpointError(f"max_shard_size {size} must be positive")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise CheckpointError(f"max_shard_size {size!r} is not a size like 5GB, 500MB or 1048576")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2).upper() or "_"))


def _names(items, limit: int = _LIST_LIMIT) -> str:
    items = sorted(items)
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _target_shardings(config: ModelConfig, mesh, shapes):
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.tree.map(lambda _: device, shapes)
    return sharding.tree_shardings(model.param_logical_axes(config), shapes, mesh)


def _place(arr: np.ndarray, target) -> jax.Array:
    """A host array onto its target sharding; each device receives only its own slice."""
    if isinstance(target, jax.sharding.SingleDeviceSharding):
        return jax.device_put(arr, target)
    return jax.make_array_from_callback(arr.shape, target, lambda idx: arr[idx])


def _layer_sharding(s):
    """The sharding of one layer's slice of a stacked parameter sharded as `s` (the layer axis,
    never split, dropped)."""
    if isinstance(s, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*tuple(s.spec)[1:]))
    return s


def _settle(params: dict, ppath: tuple, value, stacked_layers: bool, target=None) -> None:
    """Put one loaded parameter into `params`: as is, or with `stacked_layers=False` a stacked
    layer parameter as one array per layer ("layer_i", the tree `model.unstack_layers` gives),
    each placed on its own (`target`: the stacked sharding, for a host array), so no whole stacked
    copy of the weights ever sits beside the per-layer ones."""
    if stacked_layers or ppath[0] != "layers":
        hf_mapping.set_path(params, ppath, value if target is None else _place(value, target))
        return
    for i in range(value.shape[0]):
        one = value[i] if target is None else _place(value[i], _layer_sharding(target))
        hf_mapping.set_path(params, (f"layer_{i}",) + tuple(ppath[1:]), one)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=not enabled, leave=False)


def _copy_tokenizer(src: str | None, dst: str) -> list[str]:
    if src is None:
        return []
    copied = []
    for name in TOKENIZER_FILES:
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dst, name))
            copied.append(name)
    return copied


def check_tokenizer(folder: str) -> str | None:
    """The source folder's tokenizer before it travels with the weights: a CheckpointError naming
    a tokenizer.json that does not load; a note (None when there is one) when the folder has none."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return (f"note: {folder} has no tokenizer.json, so neither has the converted folder; "
                "decoding needs one: copy it in")
    try:
        from tokenizers import Tokenizer
        Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the tokenizers library's own message, one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{path}: not a tokenizer the tokenizers library reads ({first}); "
                              "fix or remove it before converting") from None
    return None


def read_config(folder: str) -> ModelConfig:
    """`folder/config.json` as a ModelConfig; every ConfigError names the file."""
    path = os.path.join(folder, "config.json")
    try:
        return ModelConfig.from_hf(path)
    except ConfigError as e:
        if path in str(e):
            raise
        raise ConfigError(f"{path}: {e}") from None


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------- atomic output

def _looks_like_checkpoint(folder: str) -> bool:
    names = set(os.listdir(folder))
    return bool({"config.json", PARAMS_DIR, st.INDEX_NAME} & names) or \
        any(n.endswith(".safetensors") for n in names)


def check_out_dir(out_dir: str, force: bool, is_complete=_looks_like_checkpoint,
                  what: str = "a checkpoint", force_hint: str = "--force (force=True)") -> None:
    """Refuse, before any work, an output folder we must not replace: a file or symlink, a
    non-empty folder that `is_complete` does not recognise (even with force), or one holding
    `what` without force."""
    if not os.path.lexists(out_dir):
        return
    if not os.path.isdir(out_dir) or os.path.islink(out_dir):
        raise CheckpointError(f"{out_dir}: exists and is a file or a symlink, not a folder; "
                              f"refusing to replace it")
    if not os.listdir(out_dir):
        return
    if not is_complete(out_dir):
        raise CheckpointError(f"{out_dir}: exists, is not empty and holds no {what.split(' ', 1)[-1]}; "
                              f"refusing to replace it (even with --force); choose another output folder")
    if not force:
        raise CheckpointError(f"{out_dir}: already holds {what}; pass {force_hint} to replace it")


@contextlib.contextmanager
def atomic_output_dir(out_dir, force: bool = False, is_complete=_looks_like_checkpoint,
                      what: str = "a checkpoint") -> Iterator[str]:
    """Yield a hidden temporary sibling of `out_dir` to write into; on success rename it into
    place (replacing an existing one only if `force`), on any error delete it. Every writer of a
    folder (checkpoints, packed training data) goes through here."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    check_out_dir(out_dir, force, is_complete, what)
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    remove_dead_partials(parent)
    tmp = tempfile.mkdtemp(prefix=f".{name}.partial-{_owner_tag()}-", dir=parent)
    try:
        yield tmp
        check_out_dir(out_dir, force, is_complete, what)
        if os.path.lexists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{name}.old-{_owner_tag()}-", dir=parent)
            os.rename(out_dir, os.path.join(old, name))
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------- leftovers, signals

# `.NAME.partial-HOST-PID-xxxx` (being written) and `.NAME.old-HOST-PID-xxxx` (a replaced output,
# deleted once the new one is in place); HOST is sanitised to [A-Za-z0-9_] so the name parses.
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<host>\w+)-(?P<pid>\d+)-[^/]+$")


def _host() -> str:
    return re.sub(r"\W", "_", socket.gethostname()) or "host"


def _owner_tag(pid: int | None = None) -> str:
    return f"{_host()}-{os.getpid() if pid is None else pid}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_partials(parent: str, pid: int | None = None) -> list[str]:
    """Remove what killed writers left in `parent`: partial folders of processes of this host
    that are gone (or, with `pid`, that process's own), and `.old-` folders of replaced outputs,
    which go back into place when the new output never arrived. Returns the names handled."""
    done = []
    try:
        names = os.listdir(parent)
    except OSError:
        return done
    for n in sorted(names):
        m = _LEFTOVER.match(n)
        if not m or m["host"] != _host():
            continue
        owner = int(m["pid"])
        if pid is not None and owner != pid:
            continue
        if pid is None and (owner == os.getpid() or _pid_alive(owner)):
            continue
        path = os.path.join(parent, n)
        target = os.path.join(parent, m["name"])
        inner = os.path.join(path, m["name"])
        if m["kind"] == "old" and os.path.isdir(inner) and not os.path.lexists(target):
            os.rename(inner, target)  # killed between the two renames: put the old one back
        shutil.rmtree(path, ignore_errors=True)
        done.append(n)
    return done


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived during a conversion (raised from the signal handler)."""


def _raise_interrupted(signum, frame):
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the cleanup short
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


def params_nbytes(params, dtype=None) -> int:
    """Bytes the params take at `dtype` (None: as they are)."""
    target = parse_dtype(dtype)
    return sum(int(np.prod(x.shape)) * np.dtype(target or x.dtype).itemsize
               for x in jax.tree.leaves(params))


_EXPONENT = {2: (np.uint16, None), 4: (np.uint32, 0x7F800000), 8: (np.uint64, 0x7FF0000000000000)}


def count_nonfinite(arr) -> int:
    """NaN/Inf entries of a host float array: those whose exponent bits are all ones, counted on
    the integer view 16M elements at a time (fast for bfloat16 too; no full-size temporary)."""
    flat = np.asarray(arr).reshape(-1)
    if flat.dtype == np.dtype(jnp.bfloat16):
        utype, mask = np.uint16, 0x7F80
    elif np.issubdtype(flat.dtype, np.floating) and flat.dtype.itemsize in (2, 4, 8):
        utype, mask = _EXPONENT[flat.dtype.itemsize]
        mask = 0x7C00 if mask is None else mask  # float16
    else:
        return 0
    bits = flat.view(utype)
    step = 1 << 24
    return sum(int(np.count_nonzero((bits[i:i + step] & utype(mask)) == utype(mask)))
               for i in range(0, bits.size, step))


def _nonfinite_error(where: str, name: str, count: int) -> CheckpointError:
    return CheckpointError(f"{where}: tensor {name!r} has {count} non-finite value(s) (NaN/Inf); "
                           f"refusing to convert it (pass --allow-nonfinite / "
                           f"allow_nonfinite=True to keep them)")


# --------------------------------------------------------------------------- HF -> JAX

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
                              f"{_names(missing)}")
    if extra and not allow_extra:
        raise CheckpointError(f"{source}: {len(extra)} unexpected tensor(s) not used by a "
                              f"{config.model_type} model: {_names(extra)} (pass --allow-extra / "
                              f"allow_extra=True to skip them)")
    bad = [f"{n} has shape {list(present[n].shape)} in {os.path.basename(present[n].file)}, the "
           f"config needs {list(hf)}" for n, (_, _, _, hf, _) in expected.items()
           if tuple(present[n].shape) != tuple(hf)]
    if bad:
        raise CheckpointError(f"{source}: shape mismatch: " + "; ".join(bad[:_LIST_LIMIT]) +
                              (f" ... and {len(bad) - _LIST_LIMIT} more" if len(bad) > _LIST_LIMIT
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
    shardings = _target_shardings(config, mesh, model.param_shapes(config))
    params: dict = {}
    with _progress(sum(i.nbytes for i, *_ in plan), "load " + os.path.basename(path.rstrip("/")),
                   progress) as bar:
        for ppath, items in _group_by_param(plan):
            stacked = items[0][4] is not None
            dt = target or np.result_type(*(st.DTYPES[it[0].dtype] for it in items))
            arr = np.empty(((len(items),) if stacked else ()) + items[0][3], dt)
            for info, _, kind, jshape, layer in items:
                raw = st.read_tensor(info)
                if not allow_nonfinite and (bad := count_nonfinite(raw)):
                    raise _nonfinite_error(info.file, info.name, bad)
                if stacked:
                    arr[layer] = hf_mapping.to_jax(kind, raw, jshape)
                else:
                    arr[...] = hf_mapping.to_jax(kind, raw, jshape)
                del raw
                bar.update(info.nbytes)
            _settle(params, ppath, arr, stacked_layers, hf_mapping.get_path(shardings, ppath))
            del arr
            _release_host_memory()
    return config, params


# --------------------------------------------------------------------------- JAX -> HF

def _check_params(config: ModelConfig, params, source: str = "params") -> None:
    """The params tree must have exactly the paths and shapes `config` needs."""
    want = {jax.tree_util.keystr(k): v.shape
            for k, v in jax.tree_util.tree_leaves_with_path(model.param_shapes(config))}
    got = {jax.tree_util.keystr(k): tuple(getattr(v, "shape", None) or np.shape(v))
           for k, v in jax.tree_util.tree_leaves_with_path(params)}
    missing, extra = [k for k in want if k not in got], [k for k in got if k not in want]
    if missing:
        raise CheckpointError(f"{source}: missing {len(missing)} parameter(s): {_names(missing)}")
    if extra:
        raise CheckpointError(f"{source}: {len(extra)} unexpected parameter(s): {_names(extra)}")
    bad = [f"{k} has shape {list(got[k])}, the config needs {list(s)}" for k, s in want.items()
           if tuple(got[k]) != tuple(s)]
    if bad:
        raise CheckpointError(f"{source}: shape mismatch: " + "; ".join(bad[:_LIST_LIMIT]))


def _to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise CheckpointError("params span several processes; gather them to one host before "
                              "saving (multi-host export is not supported)")
    return np.asarray(jax.device_get(x))


def save_hf_checkpoint(config: ModelConfig, params, out_dir, *, dtype=None,
                       max_shard_size: int | str = "5GB", tokenizer_from=None, force: bool = False,
                       progress: bool = True) -> str:
    """Write `params` as a Hugging Face checkpoint folder: safetensors (sharded with
    `model.safetensors.index.json` above `max_shard_size`), `config.json`, tokenizer files from
    `tokenizer_from`. Arrays are gathered to the host one tensor at a time. Returns out_dir."""
    target = parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    _check_params(config, params)
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
        return hf_mapping.to_hf(kind, _to_host(leaf if layer is None else leaf[layer]))

    shards = st.plan_shards(sizes, limit)
    with atomic_output_dir(out_dir, force) as tmp, _progress(sum(sizes), "save", progress) as bar:
        if len(shards) == 1:
            write_safetensors(os.path.join(tmp, st.SINGLE_NAME), specs, fetch, bar.update)
        else:
            weight_map = {}
            for k, shard in enumerate(shards):
                fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                write_safetensors(os.path.join(tmp, fname), [specs[i] for i in shard], fetch,
                                  bar.update)
                weight_map.update({specs[i][0]: fname for i in shard})
            _write_json(os.path.join(tmp, st.INDEX_NAME),
                        {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map})
        _copy_tokenizer(tokenizer_from, tmp)
        hf = config.to_hf_dict()
        hf["dtype"] = "bfloat16" if specs[0][1] == "BF16" else "float32"
        _write_json(os.path.join(tmp, "config.json"), hf)
    return os.path.abspath(os.fspath(out_dir))


def write_safetensors(file, specs, fetch, on_tensor=None) -> None:
    """One safetensors file; a module-level seam so tests can interrupt a conversion mid-way."""
    st.write_file(file, specs, fetch, on_tensor)


# --------------------------------------------------------------------------- Orbax

def _orbax():
    import orbax.checkpoint as ocp
    return ocp


def _orbax_checkpointer():
    # No compression: zstd over random-looking weights gains little and made Orbax hold a second
    # host copy of every array while saving (peak RSS ~1.9x instead of ~1.0x the checkpoint).
    ocp = _orbax()
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def _release_host_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise, inflating peak RSS)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def save_orbax(config: ModelConfig, params, out_dir, tokenizer_from=None, force: bool = False) -> str:
    """Write `DIR/config.json`, `DIR/params/` (Orbax PyTree checkpoint) and the tokenizer files,
    atomically."""
    ocp = _orbax()
    _check_params(config, params)
    with atomic_output_dir(out_dir, force) as tmp:
        ckptr = _orbax_checkpointer()
        ckptr.save(os.path.join(tmp, PARAMS_DIR), args=ocp.args.PyTreeSave(params))
        ckptr.close()
        _copy_tokenizer(tokenizer_from, tmp)
        _write_json(os.path.join(tmp, "config.json"), config.to_hf_dict())
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
    ckptr = _orbax_checkpointer()
    with _orbax_read_errors(params_dir):
        stored = _orbax_metadata(ckptr, params_dir)
    _check_params(config, stored, source=params_dir)
    shardings = _target_shardings(config, mesh, model.param_shapes(config))
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
            raise _nonfinite_error(params_dir, ppath[0] + "".join(f"[{k!r}]" for k in ppath[1:]),
                                   bad)
        _settle(params, ppath, leaf, stacked_layers)
        del restored, leaf
        _release_host_memory()
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
    (`stacked_layers=False`: the layers one tree each, as GPU decoding holds them)."""
    if checkpoint_kind(path) == "orbax":
        return load_orbax(path, mesh=mesh, dtype=dtype,
                          allow_nonfinite=kw.get("allow_nonfinite", False),
                          stacked_layers=kw.get("stacked_layers", True))
    return load_hf_checkpoint(path, mesh=mesh, dtype=dtype, **kw)


# --------------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wedlm-convert",
                                description="Convert checkpoints between Hugging Face safetensors "
                                            "and this project's Orbax format.")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-orbax", help="HF safetensors folder -> Orbax folder")
    a.add_argument("--hf", required=True, help="Hugging Face checkpoint folder (safetensors)")
    a.add_argument("--allow-extra", action="store_true",
                   help="skip tensors the model does not use instead of failing")
    b = sub.add_parser("orbax-to-hf", help="Orbax folder -> HF safetensors folder")
    b.add_argument("--orbax", required=True, help="Orbax checkpoint folder written by hf-to-orbax")
    b.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    for s in (a, b):
        s.add_argument("--out", required=True, help="output folder (created atomically)")
        s.add_argument("--dtype", choices=tuple(DTYPE_ALIASES), default=None, metavar="DTYPE",
                       help=f"parameter dtype of the output: {allowed()} (default: as stored)")
        s.add_argument("--force", action="store_true", help="replace an existing checkpoint at --out")
        s.add_argument("--allow-nonfinite", action="store_true",
                       help="convert weights that hold NaN/Inf instead of refusing")
        s.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    """The command: `_convert` with SIGINT/SIGTERM and a full disk turned into one line each, the
    partial output removed first; exit 130 / 143 (signals) or 2 (errors)."""
    from wedlm_jax import platforms
    platforms.choose()      # no backend whose hardware is absent (a libtpu lock, a CUDA error)
    import threading
    args = _parser().parse_args(argv)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _raise_interrupted)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
    needed = [0]
    try:
        return _convert(args, needed)
    except Interrupted as e:
        # end the process at once after the cleanup: no Orbax / tensorstore writer thread may
        # outlive it (atomic_output_dir removed the partial folder already; this is a second pass)
        _cleanup_line(args.out, f"interrupted by {e}")
        os._exit(130 if str(e) == "SIGINT" else 143)
    except Exception as e:
        if not disk_full(e) is not None:
            raise
        need = f", needed about {format_bytes(needed[0])}" if needed[0] else ""
        _cleanup_line(args.out, f"error: no space left on "
                                f"{mount_point(os.path.abspath(args.out))}{need}")
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _cleanup_line(out: str, message: str) -> None:
    """Remove this process's partial output and print the one-line outcome."""
    remove_dead_partials(os.path.dirname(os.path.abspath(out)), pid=os.getpid())
    print(f"wedlm-convert: {message}; {out} was not changed (partial output removed)",
          file=sys.stderr, flush=True)


def _convert(args, needed: list) -> int:
    src = args.hf if args.command == "hf-to-orbax" else args.orbax
    try:
        if os.path.realpath(src) == os.path.realpath(args.out):
            raise CheckpointError(f"{args.out}: the output folder is the input folder; choose "
                                  f"another --out")
        check_writable(args.out, "--out")
        tokenizer_note = check_tokenizer(src)
        if args.command == "hf-to-orbax":
            check_out_dir(os.path.abspath(args.out), args.force)
            config, params = load_hf_checkpoint(args.hf, dtype=args.dtype,
                                                allow_extra=args.allow_extra,
                                                progress=not args.no_progress,
                                                allow_nonfinite=args.allow_nonfinite)
            needed[0] = params_nbytes(params)
            check_space(args.out, needed[0], "the converted checkpoint")
            out = save_orbax(config, params, args.out, tokenizer_from=args.hf, force=args.force)
        else:
            check_out_dir(os.path.abspath(args.out), args.force)
            parse_size(args.max_shard_size)
            config, params = load_orbax(args.orbax, dtype=args.dtype,
                                        allow_nonfinite=args.allow_nonfinite)
            needed[0] = params_nbytes(params)
            check_space(args.out, needed[0], "the converted checkpoint")
            out = save_hf_checkpoint(config, params, args.out, max_shard_size=args.max_shard_size,
                                     tokenizer_from=args.orbax, force=args.force,
                                     progress=not args.no_progress)
    except (ConfigError, CheckpointError, DiskFullError, FileNotFoundError, PermissionError) as e:
        print(f"wedlm-convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}" + (f" ({tokenizer_note})" if tokenizer_note else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
