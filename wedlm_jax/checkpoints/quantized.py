"""Quantized Orbax checkpoints: weights quantized once at conversion, loaded as they are.

    wedlm-convert hf-to-orbax --hf DIR --out DIR --quantize int8|int4 [--quantize-group N]
    config, qparams = convert_hf(hf_dir, "int8"); save(config, qparams, out_dir, hf_dir, meta)
    config, qparams = load(dir, mesh=None, dtype=None, stacked_layers=True)

A quantized folder is an Orbax folder (`config.json`, `params/`, the tokenizer files) plus
`quantization.json` ({"scheme", "group", "scale_dtype"}); in `params/` each projection kernel and
vocabulary table is a {"qvalue", "scale"} pair (`wedlm_jax.quantize`'s QArray, stored), every
other parameter is float.
`convert_hf` reads the Hugging Face folder one tensor at a time and quantizes each layer's kernel
as it is read (the same scales `quantize.quantize_params` gives the stacked kernel), so the float
kernels of the whole model never sit in memory together. `load` checks every stored tensor's
presence, shape and dtype against the config and the scheme before reading any data, then reads
the scales first (finite and positive), then the rest one tensor at a time, and returns the
QArray tree the decoders take. The Hugging Face folder stays the source of truth: a quantized
folder is not exported back (`check_exportable`).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from wedlm_jax import hf_mapping, model, quantize, sharding
from wedlm_jax import quantize_scheme as scheme_rules
from wedlm_jax import safetensors_io as st
from wedlm_jax.checkpoints import folders, tensors
from wedlm_jax.checkpoints.folders import PARAMS_DIR
from wedlm_jax.checkpoints.hf import plan_hf_load
from wedlm_jax.checkpoints.orbax import checkpointer
from wedlm_jax.config import settle_qk_norm
from wedlm_jax.safetensors_io import CheckpointError

QUANT_FILE = "quantization.json"
SCALE_DTYPES = ("bfloat16", "float16", "float32")
PAIR = ("qvalue", "scale")


# --------------------------------------------------------------------------- the folder's scheme

def read_record(folder) -> dict | None:
    """A quantized folder's {"scheme", "group", "scale_dtype"} (the group resolved), None for a
    float folder; CheckpointError naming `quantization.json` when it is not a valid record."""
    path = os.path.join(os.fspath(folder), QUANT_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)
        scheme, scale_dtype = meta["scheme"], meta["scale_dtype"]
        if scheme not in quantize.QTYPES or scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scheme {scheme!r}, scale_dtype {scale_dtype!r}")
        return dict(scheme=scheme, group=scheme_rules.resolve_group(scheme, meta["group"]),
                    scale_dtype=scale_dtype)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a quantization record this project reads ({e}); "
                              f"convert the Hugging Face folder again") from None


def read_scheme(folder) -> tuple[str, int] | None:
    """(scheme, group) of a quantized folder, None for a float one (see `read_record`)."""
    meta = read_record(folder)
    return None if meta is None else (meta["scheme"], meta["group"])


def check_matches(folder, scheme: str, group: int) -> None:
    """A quantized folder must be decoded with its own (scheme, group): QuantizeError (field
    quantize) naming both otherwise; a float folder passes (quantized at load when asked)."""
    stored = read_scheme(folder)
    if stored is None or stored == (scheme, group):
        return
    have, want = quantize.describe(*stored), quantize.describe(scheme, group)
    raise scheme_rules.QuantizeError(
        f"{folder} holds weights quantized {have}; the plan says --quantize {want}: decode it with "
        f"--quantize {stored[0]}" + (f" --quantize-group {stored[1]}" if stored[1] else ""),
        "quantize")


def check_exportable(folder) -> None:
    """Export to Hugging Face takes float weights: a quantized folder is refused, one line."""
    stored = read_scheme(folder)
    if stored is not None:
        raise CheckpointError(f"{folder} holds weights quantized {quantize.describe(*stored)}; "
                              f"the Hugging Face folder it was converted from is the source of "
                              f"truth: export from that one, not from the quantized copy")


# --------------------------------------------------------------------------- HF -> quantized

def _allocate(items, target, scheme, group, names):
    """The host buffers of one parameter (a stacked one for all its layers): a float array, or
    the (qvalue, scale) pair of a quantized one (a projection kernel, a vocabulary table)."""
    info, _, _, jshape, layer = items[0]
    lead = (len(items),) if layer is not None else ()
    dt = target or np.result_type(*(st.DTYPES[it[0].dtype] for it in items))
    if not quantize.is_quantized_param(names):
        return np.empty(lead + jshape, dt)
    one = jax.eval_shape(lambda w: quantize.quantize_param(w, names, scheme, group),
                         jax.ShapeDtypeStruct(jshape, dt))
    return {"qvalue": np.empty(lead + one.qvalue.shape, one.qvalue.dtype),
            "scale": np.empty(lead + one.scale.shape, one.scale.dtype)}


def _store(buf, layer, value, scheme, group, names) -> None:
    """One tensor (one layer's slice) into its parameter's buffers, quantized if it is one a
    scheme quantizes."""
    at = () if layer is None else (layer,)
    if not isinstance(buf, dict):
        buf[at] = value
        return
    q = quantize.quantize_tensor(jnp.asarray(value.astype(buf["scale"].dtype)), names, scheme,
                                 group)
    buf["qvalue"][at] = np.asarray(q.qvalue)
    buf["scale"][at] = np.asarray(q.scale)


def convert_hf(path, scheme: str, group: int | None = None, dtype=None, allow_extra=False,
               allow_nonfinite=False, on_tensor=None) -> tuple:
    """(config, tree) of a Hugging Face folder with every projection kernel quantized as it is
    read (one float tensor at a time); the tree holds host arrays, a kernel as a {"qvalue",
    "scale"} pair (`save` writes it). `dtype` as `load_hf_checkpoint`'s (the scales' too)."""
    path = os.fspath(path)
    config = tensors.read_config(path)
    group = scheme_rules.check_model(config, scheme, group)
    target = tensors.parse_dtype(dtype)
    stored = st.index_tensors(path)
    config = settle_qk_norm(config, path, stored)
    groups: dict = {}
    for item in plan_hf_load(config, stored, allow_extra, source=path):
        groups.setdefault(item[1], []).append(item)
    tree: dict = {}
    for ppath, items in groups.items():
        names = tuple(ppath)
        buf = _allocate(items, target, scheme, group, names)
        for info, _, kind, jshape, layer in items:
            raw = st.read_tensor(info)
            if not allow_nonfinite and (bad := tensors.count_nonfinite(raw)):
                raise CheckpointError(f"{info.file}: tensor {info.name!r} has {bad} non-finite "
                                      f"value(s) (NaN/Inf); refusing to quantize it")
            _store(buf, layer, hf_mapping.to_jax(kind, raw, jshape), scheme, group, names)
            if on_tensor is not None:
                on_tensor(info.nbytes)
        hf_mapping.set_path(tree, ppath, buf)
    return config, tree


def save(config, tree, out_dir, tokenizer_from=None, force: bool = False) -> str:
    """Write a quantized folder from `convert_hf`'s tree, atomically (config.json last)."""
    import orbax.checkpoint as ocp
    scheme, group, scale_dtype = _tree_scheme(tree)
    with folders.atomic_output_dir(out_dir, force) as tmp:
        ckptr = checkpointer()
        ckptr.save(os.path.join(tmp, PARAMS_DIR), args=ocp.args.PyTreeSave(tree))
        ckptr.close()
        tensors.copy_tokenizer(tokenizer_from, tmp)
        folders.write_json(os.path.join(tmp, QUANT_FILE),
                           {"scheme": scheme, "group": group, "scale_dtype": scale_dtype})
        folders.write_json(os.path.join(tmp, "config.json"), config.to_hf_dict())
    return os.path.abspath(os.fspath(out_dir))


def _tree_scheme(tree) -> tuple[str, int, str]:
    """(scheme, group, scale dtype) of a stored tree, from its kernels' pairs."""
    qp = from_storage(tree)
    scheme, group = quantize.scheme_of(qp)
    scale = next(x.scale for x in jax.tree.leaves(qp, is_leaf=_is_q) if _is_q(x))
    return scheme, group, np.dtype(scale.dtype).name


def convert_folder(hf_dir, out_dir, scheme: str, group: int | None = None, *, dtype=None,
                   allow_extra=False, allow_nonfinite=False, force=False, progress=True,
                   needed: list | None = None) -> str:
    """`wedlm-convert hf-to-orbax --quantize`: the quantized folder of `hf_dir` at `out_dir`
    (free space checked against its size before any tensor is read). QuantizeError from the
    scheme as a CheckpointError naming the setting."""
    from wedlm_jax.runtime.failures import check_space
    try:
        config = tensors.read_config(hf_dir)
        group = scheme_rules.check_model(config, scheme, group)
    except scheme_rules.QuantizeError as e:
        raise CheckpointError(f"--{e.field.replace('_', '-')}: {e}") from None
    infos = st.index_tensors(hf_dir).values()
    dt = tensors.parse_dtype(dtype) or np.result_type(*{st.DTYPES[i.dtype] for i in infos})
    size = quantize.weight_bytes(quantize.quantize_params(
        model.param_shapes(config, jnp.dtype(dt)), scheme, group))
    if needed is not None:
        needed[0] = size
    check_space(out_dir, size, "the quantized checkpoint")
    total = sum(i.nbytes for i in infos)
    with tensors.progress_bar(total, f"quantize {scheme}", progress) as bar:
        config, tree = convert_hf(hf_dir, scheme, group, dtype, allow_extra, allow_nonfinite,
                                  on_tensor=bar.update)
    return save(config, tree, out_dir, tokenizer_from=hf_dir, force=force)


# --------------------------------------------------------------------------- storage form

def _is_q(x) -> bool:
    return isinstance(x, qwix.QArray)


def _is_pair(x) -> bool:
    return isinstance(x, dict) and set(x) == set(PAIR)


def to_storage(params):
    """QArray kernels as {"qvalue", "scale"} pairs (what `params/` holds)."""
    return jax.tree.map(lambda x: {"qvalue": x.qvalue, "scale": x.scale} if _is_q(x) else x,
                        params, is_leaf=_is_q)


def from_storage(tree):
    """{"qvalue", "scale"} pairs as QArrays (the qtype their values' dtype: int8 or int4)."""
    def pair(x):
        if not _is_pair(x):
            return x
        qtype = quantize.QTYPES[jnp.dtype(x["qvalue"].dtype).name]
        return qwix.QArray(qvalue=x["qvalue"], scale=x["scale"], qtype=qtype)
    return jax.tree.map(pair, tree, is_leaf=_is_pair)


# --------------------------------------------------------------------------- quantized -> JAX

def _named(tree) -> dict:
    """{dotted name: leaf} of a stored tree ("layers.attn.q_proj.kernel.scale")."""
    return {jax.tree_util.keystr(k, simple=True, separator="."): v
            for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def expected_storage(config, meta: dict):
    """The stored tree `params/` must hold for `config` under the record `meta`: abstract
    float leaves and {"qvalue", "scale"} pairs (the scales in the record's dtype)."""
    floats = model.param_shapes(config, jnp.dtype(meta["scale_dtype"]))
    return to_storage(quantize.quantize_params(floats, meta["scheme"], meta["group"]))


def _mismatch(name: str, want, got) -> str | None:
    """What is wrong with one stored tensor (None: nothing): its presence, shape or dtype."""
    if got is None:
        return f"tensor {name} is missing"
    if tuple(got.shape) != tuple(want.shape):
        return f"tensor {name} has shape {list(got.shape)}, the config needs {list(want.shape)}"
    stored = jnp.dtype(got.dtype)
    exact = name.endswith((".qvalue", ".scale"))
    if (exact and stored != jnp.dtype(want.dtype)) or \
            (not exact and not jnp.issubdtype(stored, jnp.floating)):
        need = jnp.dtype(want.dtype).name
        return f"tensor {name} has dtype {stored.name}, the scheme needs {need}"
    return None


def check_stored(params_dir: str, want, stored, meta: dict) -> None:
    """Every tensor the scheme needs is stored with its shape and dtype (from the metadata, no
    data read); one CheckpointError naming the folder and the first tensors at fault."""
    got, need = _named(stored), _named(want)
    bad = [m for n, w in need.items() if (m := _mismatch(n, w, got.get(n))) is not None]
    bad += [f"tensor {n} is not one of a {meta['scheme']} checkpoint's"
            for n in got if n not in need]
    if bad:
        more = f" ... and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise CheckpointError(f"{params_dir}: {'; '.join(bad[:3])}{more} (quantized "
                              f"{quantize.describe(meta['scheme'], meta['group'])}); the "
                              f"checkpoint is damaged: convert the Hugging Face folder again")


def _restore_one(ckptr, params_dir: str, name: str, path: tuple, leaf):
    """One stored tensor, restored into `leaf`'s dtype and sharding; a CheckpointError naming
    the tensor and the folder when it cannot be read."""
    import orbax.checkpoint as ocp
    part: dict = {}
    hf_mapping.set_path(part, path, leaf)
    try:
        out = ckptr.restore(params_dir, args=ocp.args.PyTreeRestore(
            part, restore_args=ocp.checkpoint_utils.construct_restore_args(part),
            partial_restore=True))
    except Exception as e:  # noqa: BLE001 - tensorstore / Orbax: one line naming the tensor
        first = next((l.strip() for l in str(e).splitlines() if l.strip()), type(e).__name__)
        raise CheckpointError(f"{params_dir}: cannot read tensor {name} (truncated or damaged): "
                              f"{first[:200]}") from None
    return hf_mapping.get_path(out, path)


def _check_values(params_dir: str, name: str, value, allow_nonfinite: bool) -> None:
    """A scale must be finite and positive, a float weight finite (unless allowed)."""
    if name.endswith(".qvalue"):
        return
    scale = name.endswith(".scale")
    ok = jnp.isfinite(value) & (value > 0) if scale else jnp.isfinite(value)
    if (scale or not allow_nonfinite) and not bool(ok.all()):
        bad = int(value.size - jnp.count_nonzero(ok))
        what = "non-finite or non-positive" if scale else "non-finite (NaN/Inf)"
        raise CheckpointError(f"{params_dir}: tensor {name} has {bad} {what} value(s); the "
                              f"checkpoint is damaged: convert the Hugging Face folder again")


def _targets(config, want, mesh, dtype):
    """{dotted name: (path, ShapeDtypeStruct to restore into)}: qvalues as stored, floats and
    scales in `dtype` (None: as stored), each on its sharding (`mesh`) or the default device."""
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shards = jax.tree.map(lambda _: device, want)
    else:
        qp = from_storage(want)
        axes = quantize.logical_axes(model.param_logical_axes(config), qp)
        shards = to_storage(sharding.tree_shardings(axes, qp, mesh))
    out = {}
    for (k, w), s in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(shards)):
        name = jax.tree_util.keystr(k, simple=True, separator=".")
        dt = w.dtype if name.endswith(".qvalue") or dtype is None else dtype
        out[name] = (tuple(str(getattr(p, "key", p)) for p in k),
                     jax.ShapeDtypeStruct(w.shape, dt, sharding=s))
    return out


def load(path, mesh=None, dtype=None, allow_nonfinite: bool = False,
         stacked_layers: bool = True) -> tuple:
    """(config, params) of a quantized folder: QArray kernels, float leaves in `dtype` (None: as
    stored; the scales too), on `mesh` or the default device. Checks first (`check_stored`),
    then the scales (finite, positive), then the other tensors one at a time, largest first."""
    path = os.fspath(path)
    params_dir = os.path.join(os.path.abspath(path), PARAMS_DIR)
    config, meta = tensors.read_config(path), read_record(path)
    if meta is None or not os.path.isdir(params_dir):
        raise CheckpointError(f"{path}: not a quantized checkpoint ({QUANT_FILE} and "
                              f"{PARAMS_DIR}/ needed)")
    want = expected_storage(config, meta)
    ckptr = checkpointer()
    try:
        stored = ckptr.metadata(params_dir).item_metadata
    except Exception as e:  # noqa: BLE001 - Orbax's own message, one line
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise CheckpointError(f"{params_dir}: cannot read the Orbax metadata ({first})") from None
    check_stored(params_dir, want, getattr(stored, "tree", stored), meta)
    targets = _targets(config, want, mesh, tensors.parse_dtype(dtype))
    order = sorted(targets, key=lambda n: (not n.endswith(".scale"), -targets[n][1].size))
    params: dict = {}
    for name in order:
        tpath, leaf = targets[name]
        value = _restore_one(ckptr, params_dir, name, tpath, leaf)
        _check_values(params_dir, name, value, allow_nonfinite)
        tensors.settle(params, tpath, value, stacked_layers)
    ckptr.close()
    shape = want if stacked_layers else model.unstack_layers(want, config.num_layers)
    return config, from_storage(jax.tree.map(lambda _, p: p, shape, params))
