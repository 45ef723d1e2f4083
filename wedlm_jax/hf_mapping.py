"""Hugging Face tensor names <-> this project's parameter tree, one regex table.

Each rule maps an HF name pattern to a parameter path template and a layout transform. HF stores
`nn.Linear` weights as [out, in]; we store kernels as [in..., out...] with the head dimension split
out ([embed, heads, head_dim] for q/k/v, [heads, head_dim, embed] for o). The layers are stacked:
HF's `model.layers.{i}.X` is slice `i` of the leading 'layers' axis of parameter `layers/X`.
`expected_tensors(config)` lists every HF tensor a checkpoint of `config` must hold with its HF
shape and its layer, so a converter can check names and shapes before reading any data.
"""

from __future__ import annotations

import re

import numpy as np

from wedlm_jax.config import ModelConfig

_L = r"model\.layers\.(\d+)\."
# (HF regex, param path template, transform). Templates use the regex groups; a template under
# "layers" names a stacked parameter whose slice is the layer index (the first group).
RULES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (r"model\.embed_tokens\.weight", ("embedding",), "copy"),
    (r"lm_head\.weight", ("lm_head",), "transpose"),
    (r"model\.norm\.weight", ("final_norm", "scale"), "copy"),
    (_L + r"input_layernorm\.weight", ("layers", "input_norm", "scale"), "copy"),
    (_L + r"post_attention_layernorm\.weight", ("layers", "post_attn_norm", "scale"), "copy"),
    (_L + r"self_attn\.([qkv])_proj\.weight", ("layers", "attn", "{1}_proj", "kernel"), "heads_in"),
    (_L + r"self_attn\.([qkv])_proj\.bias", ("layers", "attn", "{1}_proj", "bias"), "heads_bias"),
    (_L + r"self_attn\.o_proj\.weight", ("layers", "attn", "o_proj", "kernel"), "heads_out"),
    (_L + r"self_attn\.o_proj\.bias", ("layers", "attn", "o_proj", "bias"), "copy"),
    (_L + r"self_attn\.([qk])_norm\.weight", ("layers", "attn", "{1}_norm", "scale"), "copy"),
    (_L + r"mlp\.(gate|up|down)_proj\.weight", ("layers", "mlp", "{1}_proj", "kernel"), "transpose"),
    (_L + r"mlp\.(gate|up|down)_proj\.bias", ("layers", "mlp", "{1}_proj", "bias"), "copy"),
)
_COMPILED = tuple((re.compile(p + r"\Z"), t, k) for p, t, k in RULES)

# Buffers some checkpoints carry that are not parameters (recomputed from the config).
IGNORED = (re.compile(r".*rotary_emb\.inv_freq\Z"),)


def hf_name_to_path(name: str) -> tuple[tuple[str, ...], str, int | None] | None:
    """(param path, transform, layer index or None) for an HF tensor name, or None if no rule
    matches. A layer tensor is slice `layer` of the stacked parameter at `path`."""
    for rx, template, kind in _COMPILED:
        m = rx.match(name)
        if m:
            layer = int(m.group(1)) if template[0] == "layers" else None
            return tuple(part.format(*m.groups()) for part in template), kind, layer
    return None


def to_jax(kind: str, arr: np.ndarray, jax_shape: tuple[int, ...]) -> np.ndarray:
    if kind == "copy":
        return arr
    if kind == "transpose":
        return arr.T
    if kind == "heads_in":        # [H*D, E] -> [E, H, D]
        return arr.T.reshape(jax_shape)
    if kind == "heads_bias":      # [H*D] -> [H, D]
        return arr.reshape(jax_shape)
    if kind == "heads_out":       # [E, H*D] -> [H, D, E]
        return arr.T.reshape(jax_shape)
    raise ValueError(kind)


def to_hf(kind: str, arr: np.ndarray) -> np.ndarray:
    if kind == "copy":
        return arr
    if kind == "transpose":
        return arr.T
    if kind == "heads_in":        # [E, H, D] -> [H*D, E]
        return arr.reshape(arr.shape[0], -1).T
    if kind == "heads_bias":
        return arr.reshape(-1)
    if kind == "heads_out":       # [H, D, E] -> [E, H*D]
        return arr.reshape(-1, arr.shape[-1]).T
    raise ValueError(kind)


def hf_shape(kind: str, jax_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of a tensor whose JAX shape is `jax_shape`."""
    probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), jax_shape, (0,) * len(jax_shape))
    return tuple(to_hf(kind, probe).shape)


def _hf_names_for(config: ModelConfig) -> list[str]:
    c = config
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not c.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        if c.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if c.o_bias:
            names.append(p + "self_attn.o_proj.bias")
        if c.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if c.mlp_bias:
            names += [p + f"mlp.{x}_proj.bias" for x in ("gate", "up", "down")]
    return names


def expected_tensors(config: ModelConfig, shapes) -> dict[str, tuple[tuple[str, ...], str,
                                                                      tuple[int, ...], tuple[int, ...],
                                                                      int | None]]:
    """HF name -> (param path, transform, JAX shape, HF shape, layer) for every tensor of
    `config`. For a layer tensor the JAX shape is that of its slice (the stacked parameter without
    the leading 'layers' axis) and `layer` its index; otherwise `layer` is None.

    `shapes` is the params shape tree (`model.param_shapes(config)`)."""
    out = {}
    for name in _hf_names_for(config):
        path, kind, layer = hf_name_to_path(name)
        jshape = tuple(get_path(shapes, path).shape)
        if layer is not None:
            jshape = jshape[1:]
        out[name] = (path, kind, jshape, hf_shape(kind, jshape), layer)
    return out


def get_path(tree, path):
    for part in path:
        tree = tree[part]
    return tree


def set_path(tree: dict, path, value) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


