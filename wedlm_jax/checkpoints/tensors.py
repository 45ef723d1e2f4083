"""What both checkpoint formats share: dtype and size arguments, placing a loaded parameter on
its sharding, the tokenizer files that travel with the weights, the config file, and the checks
every loaded or saved tree passes (names and shapes against the config, finite values)."""

from __future__ import annotations

import os
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax import hf_mapping, model, sharding
from wedlm_jax.config import ConfigError, ModelConfig
from wedlm_jax.dtypes import DtypeError, jnp_dtype
from wedlm_jax.safetensors_io import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json", "chat_template.jinja", "tokenizer.model",
                   "added_tokens.json")
LIST_LIMIT = 12


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


def name_list(items, limit: int = LIST_LIMIT) -> str:
    items = sorted(items)
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def target_shardings(config: ModelConfig, mesh, shapes):
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.tree.map(lambda _: device, shapes)
    return sharding.tree_shardings(model.param_logical_axes(config), shapes, mesh)


def place(arr: np.ndarray, target) -> jax.Array:
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


def settle(params: dict, ppath: tuple, value, stacked_layers: bool, target=None) -> None:
    """Put one loaded parameter into `params`: as is, or with `stacked_layers=False` a stacked
    layer parameter as one array per layer ("layer_i", the tree `model.unstack_layers` gives),
    each placed on its own (`target`: the stacked sharding, for a host array), so no whole stacked
    copy of the weights ever sits beside the per-layer ones."""
    if stacked_layers or ppath[0] != "layers":
        hf_mapping.set_path(params, ppath, value if target is None else place(value, target))
        return
    for i in range(value.shape[0]):
        one = value[i] if target is None else place(value[i], _layer_sharding(target))
        hf_mapping.set_path(params, (f"layer_{i}",) + tuple(ppath[1:]), one)


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=not enabled, leave=False)


def copy_tokenizer(src: str | None, dst: str) -> list[str]:
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


def nonfinite_error(where: str, name: str, count: int) -> CheckpointError:
    return CheckpointError(f"{where}: tensor {name!r} has {count} non-finite value(s) (NaN/Inf); "
                           f"refusing to convert it (pass --allow-nonfinite / "
                           f"allow_nonfinite=True to keep them)")


def check_params(config: ModelConfig, params, source: str = "params") -> None:
    """The params tree must have exactly the paths and shapes `config` needs."""
    want = {jax.tree_util.keystr(k): v.shape
            for k, v in jax.tree_util.tree_leaves_with_path(model.param_shapes(config))}
    got = {jax.tree_util.keystr(k): tuple(getattr(v, "shape", None) or np.shape(v))
           for k, v in jax.tree_util.tree_leaves_with_path(params)}
    missing, extra = [k for k in want if k not in got], [k for k in got if k not in want]
    if missing:
        raise CheckpointError(f"{source}: missing {len(missing)} parameter(s): {name_list(missing)}")
    if extra:
        raise CheckpointError(f"{source}: {len(extra)} unexpected parameter(s): {name_list(extra)}")
    bad = [f"{k} has shape {list(got[k])}, the config needs {list(s)}" for k, s in want.items()
           if tuple(got[k]) != tuple(s)]
    if bad:
        raise CheckpointError(f"{source}: shape mismatch: " + "; ".join(bad[:LIST_LIMIT]))


def release_host_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise, inflating peak RSS)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
