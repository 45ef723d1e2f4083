"""Weight-only quantization (wedlm_jax/quantize.py, on qwix): the round trip's error bounds, the
model reading quantized kernels, the decoding plan and the doors taking `quantize`, greedy AR on
the demo model against the unquantized weights, and the refusals of settings that cannot work."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from decode import cli
from decode.config import DecodeConfig, DecodeConfigError, Placement
from decode.static.static_batch import generate
from tests.plans import decoder, plan
from tests.quantize_cases import AR_TOKENS, CONFIG, prefix_length
from wedlm_jax import model as model_lib
from wedlm_jax import quantize as q

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo", "model")


def _kernels(tree):
    return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, qwix.QArray))
            if isinstance(x, qwix.QArray)]


# ---------------------------------------------------------------------------- the round trip

@pytest.mark.parametrize("scheme,group,n_in,shape", [
    ("int8", 0, 1, (3, 128, 4, 32)),     # stacked q_proj [L, embed, heads, head_dim]
    ("int8", 0, 2, (3, 4, 32, 128)),     # stacked o_proj [L, heads, head_dim, embed]
    ("int4", 64, 1, (3, 128, 256)),      # gate_proj [L, embed, mlp]
    ("int4", 32, 2, (3, 4, 32, 128)),    # o_proj: groups along head_dim, one per head
    ("int8", 32, 1, (128, 64)),          # one layer's tree (unstacked), grouped int8
])
def test_round_trip_error_is_half_a_step(scheme, group, n_in, shape):
    lead = 1 if len(shape) > 2 else 0                # the stacked layers' axis
    w = jnp.asarray(np.random.default_rng(0).standard_normal(shape) * 0.02, jnp.float32)
    qa = q.quantize_kernel(w, scheme, n_in, group, lead)
    assert jnp.dtype(qa.qvalue.dtype) == jnp.dtype(q.QTYPES[scheme])
    ins = list(range(lead, lead + n_in))
    want = [1 if i in ins else d for i, d in enumerate(shape)]
    if group:      # a scale per group of the last input axis, per index of the other ones
        for i in ins[:-1]:
            want[i] = shape[i]
        want[ins[-1]] = shape[ins[-1]] // group
    assert qa.scale.shape == tuple(want)
    back = qwix.dequantize(qa)
    step = jnp.broadcast_to(jnp.repeat(qa.scale, group, axis=ins[-1]) if group else qa.scale,
                            shape)
    err = jnp.abs(back - w)
    assert float((err - step / 2).max()) <= 1e-7       # round to nearest: half a step at most
    top = 127 if scheme == "int8" else 7     # qwix's absmax maps to top + 1/2: [-top-1, top]
    values = qa.qvalue.astype(jnp.int32)
    assert int(values.max()) <= top and int(values.min()) >= -top - 1
    assert int(jnp.abs(values).max()) >= top                          # the range is filled
    rel = float(jnp.linalg.norm(back - w) / jnp.linalg.norm(w))
    assert rel < (0.012 if scheme == "int8" else 0.16), rel


def test_params_quantized_the_projections_and_the_vocabulary_tables():
    """The seven projections under the scheme; the embedding and the LM head int8 under every
    scheme, one scale per vocabulary entry; the norms as they were."""
    params = model_lib.random_params(CONFIG)
    v, e = CONFIG.vocab_size, CONFIG.hidden_size
    for scheme, group, ratio in (("int8", 0, 0.26), ("int4", 32, 0.16)):
        qp = q.quantize_params(params, scheme, group)
        assert len(_kernels(qp)) == 7 + 2           # q k v o gate up down, stacked; the tables
        for name, scale_shape in (("embedding", (v, 1)), ("lm_head", (1, v))):
            table = qp[name]
            assert jnp.dtype(table.qvalue.dtype) == jnp.int8 and table.scale.shape == scale_shape
            err = jnp.abs(qwix.dequantize(table) - params[name])
            assert float((err - table.scale / 2).max()) <= 1e-7     # half a step at most
        assert qp["layers"]["input_norm"]["scale"] is params["layers"]["input_norm"]["scale"]
        kern = lambda t: q.weight_bytes({k: v for k, v in t["layers"].items() if k in ("attn", "mlp")})
        assert kern(qp) < ratio * kern(params)      # int8 / int4 values + their scales
        tables = lambda t: q.weight_bytes({k: t[k] for k in ("embedding", "lm_head")})
        assert tables(qp) == 2 * (v * e + v * 4)    # int8 values, float32 scales
        assert q.scheme_of(qp) == (scheme, group) and q.describe_params(qp) == scheme
    assert q.scheme_of(params) == ("none", 0)
    loaded = jax.tree.map(jnp.copy, params)       # weights just loaded: the float ones freed
    q.quantize_params(loaded, "int8", free=True)
    assert loaded["layers"]["mlp"]["up_proj"]["kernel"].is_deleted()
    assert loaded["embedding"].is_deleted() and not params["embedding"].is_deleted()
    assert not loaded["final_norm"]["scale"].is_deleted()
    with pytest.raises(q.QuantizeError, match="quantized already"):
        q.quantize_params(q.quantize_params(params, "int8"), "int8")


def test_an_int8_table_reads_as_its_dequantized_copy():
    """The embedding's rows and the head's logits from an int8 table equal those of the table
    dequantized (tied: the embedding read transposed as the head)."""
    w = jnp.asarray(np.random.default_rng(2).standard_normal((64, 16)) * 0.05, jnp.float32)
    table = q.quantize_table(w, 0)
    deq = qwix.dequantize(table)
    tokens = jnp.asarray([[0, 5, 63], [7, 7, 1]])
    np.testing.assert_allclose(q.embed(table, tokens, jnp.float32), deq[tokens], rtol=1e-6)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, 16)), jnp.float32)
    for head, ref in ((q.transpose_table(table), deq.T), (q.quantize_table(w.T, 1), None)):
        ref = qwix.dequantize(head) if ref is None else ref
        with jax.default_matmul_precision("highest"):
            np.testing.assert_allclose(q.head_matmul(x, head, jnp.float32),
                                       jnp.einsum("bse,ev->bsv", x, ref), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- the model

def _kl(a, b):
    pa, pb = jax.nn.log_softmax(a), jax.nn.log_softmax(b)
    return float((jnp.exp(pa) * (pa - pb)).sum(-1).mean())


def test_model_logits_close_stacked_and_per_layer():
    params = model_lib.random_params(CONFIG, head_scale=4.0)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 255, (2, 16)))
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    apply = lambda m, p: jax.jit(lambda p: m.apply({"params": p}, tokens, pos))(p)
    ref = apply(model_lib.Transformer(CONFIG), params)
    kls = {}
    for scheme in ("int8", "int4"):
        qp = q.quantize_params(params, scheme, 32)
        out = apply(model_lib.Transformer(CONFIG), qp)
        kls[scheme] = _kl(ref, out)
        per_layer = apply(model_lib.Transformer(CONFIG, stacked_layers=False),
                          model_lib.unstack_layers(qp, CONFIG.num_layers))
        np.testing.assert_allclose(per_layer, out, atol=1e-5)
    print(f"random Qwen3-shaped model, mean KL per token vs float32: {kls}")
    assert 0 < kls["int8"] < 1e-3 and kls["int8"] < kls["int4"] < 5e-2, kls


def test_no_full_precision_copy_of_the_weights():
    """The compiled forward holds the weights int8 (its arguments) and dequantizes one layer's
    kernel at a time inside the layer scan: its temporaries stay far below the float kernels."""
    config = CONFIG.replace(num_layers=8)
    params = model_lib.random_params(config)
    tokens = jnp.zeros((1, 4), jnp.int32)
    fwd = jax.jit(lambda p: model_lib.Transformer(config).apply({"params": p}, tokens,
                                                              jnp.arange(4)[None]))
    kernels = lambda t: q.weight_bytes({k: v for k, v in t["layers"].items() if k in ("attn", "mlp")})
    float_mem = fwd.lower(params).compile().memory_analysis()
    qp = q.quantize_params(params, "int8")
    mem = fwd.lower(qp).compile().memory_analysis()
    assert mem.argument_size_in_bytes < float_mem.argument_size_in_bytes - 0.7 * kernels(params)
    assert mem.temp_size_in_bytes < 0.3 * kernels(params), (mem.temp_size_in_bytes, kernels(params))


# ---------------------------------------------------------------------------- the plan and doors

def test_decoder_quantizes_float_weights_and_checks_quantized_ones():
    params = model_lib.random_params(CONFIG)
    dec = decoder(params, CONFIG, method="ar", slots=2, capacity=64, quantize="int4",
                  quantize_group=32)
    assert dec.static.quantize == "int4" and dec.static.quantize_group == 32
    assert len(_kernels(dec.params)) == 7 + 2
    qp = q.quantize_params(params, "int8")
    assert decoder(qp, CONFIG, method="ar", slots=2, capacity=64, quantize="int8").params is qp
    with pytest.raises(DecodeConfigError, match="quantized int8, not int4") as e:
        decoder(qp, CONFIG, method="ar", slots=2, capacity=64, quantize="int4", quantize_group=32)
    assert e.value.field == "quantize"
    with pytest.raises(DecodeConfigError, match="quantized int8, not none"):
        decoder(qp, CONFIG, method="ar", slots=2, capacity=64)
    abstract = decoder(params, CONFIG, method="ar", slots=2, capacity=64,
                       quantize="int8").abstract_args("generate")[0]
    assert len(_kernels(abstract)) == 7 + 2      # the dry runs' weights are quantized too


@pytest.mark.parametrize("settings,field,message", [
    (dict(quantize="int5"), "quantize", "quantize 'int5' is unknown; allowed: none, int8, int4"),
    (dict(quantize_group=64), "quantize_group", "quantize_group 64 needs a scheme"),
    (dict(quantize="int4", quantize_group=-2), "quantize_group", "must be an int >= 0"),
    (dict(quantize="int4", quantize_group=True), "quantize_group", "must be an int >= 0"),
])
def test_bad_settings_refused(settings, field, message):
    with pytest.raises(DecodeConfigError, match=message) as e:
        Placement(**settings)
    assert e.value.field == field


def test_group_that_cannot_tile_the_model_refused():
    # head_dim 32: o_proj's input axis; a group of 64 does not divide it
    with pytest.raises(DecodeConfigError, match=r"quantize_group 64 does not divide the input "
                       r"axis of o_proj \(32\); a group size must divide 32") as e:
        plan(CONFIG, method="ar", capacity=64, quantize="int4", quantize_group=64)
    assert e.value.field == "quantize_group"


def test_cli_refuses_at_start_with_one_line(capsys):
    code = cli.main(["--checkpoint", DEMO, "--prompt", "1, 2,", "--quantize", "int4",
                     "--quantize-group", "48"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == ("wedlm-decode: error: quantize_group 48 does not divide the input axis of "
                   "o_proj (64), down_proj (1024); a group size must divide 64 for this model (hidden 384, "
                   "head_dim 64, intermediate 1024)")


MESH_SCRIPT = """
import json
import jax
from decode.config import DecodeConfig, Placement
from decode.static.static_batch import generate
from tests.quantize_cases import CONFIG
from wedlm_jax.model import random_params
from wedlm_jax.quantize import quantize_params
from wedlm_jax.sharding import make_mesh
params = quantize_params(random_params(CONFIG, head_scale=20.0), "int4", 32)
prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
dc = DecodeConfig(method="ar", max_new_tokens=8)
one = generate(params, CONFIG, prompts, dc, capacity=32, placement=Placement(kv_tile=16))
mesh = make_mesh(data=2, fsdp=1, tensor=2)
sharded = generate(params, CONFIG, prompts, dc, capacity=32,
                   placement=Placement(kv_tile=16, mesh=(2, 1, 2)))
from tests.plans import decoder
kernel = decoder(params, CONFIG, mesh=mesh, method="ar", slots=4, capacity=32, quantize="int4",
                 quantize_group=32).params[
    "layers"]["attn"]["q_proj"]["kernel"]
specs = [str(kernel.qvalue.sharding.spec), str(kernel.scale.sharding.spec)]
print("RESULT " + json.dumps(dict(one=one.tokens, sharded=sharded.tokens, specs=specs)))
"""


def test_quantized_weights_on_a_mesh_decode_as_on_one_device():
    """data=2 x tensor=2 (4 forced CPU devices, in a subprocess): the quantized kernels' values
    and scales are laid out by the kernels' logical axes, and decode the same tokens."""
    import subprocess
    import sys
    from tests import xla
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS=xla.flags(4), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    assert out["sharded"] == out["one"] and all(len(t) == 8 for t in out["one"])
    # q_proj [layers, embed, heads, head_dim]: heads over tensor, in the values and the scales
    assert out["specs"] == ["P(None, None, 'tensor', None)"] * 2, out["specs"]


# ---------------------------------------------------------------------------- the demo model

def _mean_kl(config, params, qparams, prompts, continuations) -> float:
    """Mean KL(float || quantized) per continuation token, teacher-forced on the float tokens
    (one causal forward of the batch, padded at the end)."""
    rows = [p + c for p, c in zip(prompts, continuations)]
    width = max(map(len, rows))
    ids = jnp.asarray([r + [0] * (width - len(r)) for r in rows])
    pos = jnp.broadcast_to(jnp.arange(width), ids.shape)
    fwd = jax.jit(lambda p: jax.nn.log_softmax(
        model_lib.Transformer(config).apply({"params": p}, ids, pos)))
    a, b = fwd(params), fwd(qparams)
    kl = (jnp.exp(a) * (a - b)).sum(-1)
    return float(jnp.concatenate([kl[i, len(p) - 1:len(r) - 1]
                                  for i, (p, r) in enumerate(zip(prompts, rows))]).mean())


def _tie_gaps(config, params, prompts, base, out) -> list:
    """For each continuation the quantized weights decoded differently (`out`): the float
    model's logit gap between its choice and the quantized model's at the first token they
    differ."""
    gaps = []
    for p, a, b in zip(prompts, base, out):
        n = prefix_length(a, b)
        if n < AR_TOKENS:
            ids = jnp.asarray([p + a[:n]])
            logits = model_lib.Transformer(config).apply(
                {"params": params}, ids, jnp.arange(ids.shape[1])[None])[0, -1]
            gaps.append(float(logits[a[n]] - logits[b[n]]))
    return gaps


def test_demo_greedy_ar_int8_keeps_the_continuation(demo_prompts, tmp_path):
    config, params, prompts = demo_prompts
    dc = DecodeConfig(method="ar", max_new_tokens=AR_TOKENS)
    base = generate(params, config, prompts, dc).tokens
    assert all(len(t) == AR_TOKENS for t in base)
    report, outs = {}, {}
    for scheme in ("int8", "int4"):
        qp = q.quantize_params(params, scheme)
        out = outs[scheme] = generate(qp, config, prompts, dc).tokens   # scheme read off them
        shared = [prefix_length(a, b) / AR_TOKENS for a, b in zip(base, out)]
        report[scheme] = dict(common_prefix=shared, mean_common_prefix=float(np.mean(shared)),
                              mean_kl_per_token=_mean_kl(config, params, qp, prompts, base))
    print("demo model, greedy AR, 48 tokens vs float32:", json.dumps(report))
    assert report["int8"]["mean_common_prefix"] >= 0.8, report
    gaps = _tie_gaps(config, params, prompts, base, outs["int8"])
    assert all(g < 0.05 for g in gaps), gaps     # int8 parts from float only at near-ties
    assert report["int8"]["mean_kl_per_token"] < 1e-4, report
    assert report["int4"]["mean_common_prefix"] >= 0.5, report     # reported; a loose floor
    assert report["int8"]["mean_kl_per_token"] < report["int4"]["mean_kl_per_token"] < 1e-2


# ---------------------------------------------------------------------------- the step floor

@pytest.mark.parametrize("scheme,group", [("none", 0), ("int8", 0), ("int4", 32)])
def test_the_step_floor_counts_the_weights_as_stored(scheme, group):
    """A decode step's floor (decode.compile.aot.step_floor): every weight once as stored (the
    LM head int8 under a scheme), of an untied embedding only the rows the step looks up (int8
    rows with their scale under a scheme)."""
    from decode.compile.aot import step_floor
    config = CONFIG.replace(tie_word_embeddings=False)
    p = plan(config, method="ar", slots=4, capacity=64, quantize=scheme, quantize_group=group)
    stored = q.quantize_params(model_lib.param_shapes(config), scheme, group)
    item = jnp.dtype(p.static.dtype).itemsize
    row = config.hidden_size * item if scheme == "none" else config.hidden_size + item
    looked_up = 4 * row
    assert q.weight_bytes(stored["embedding"]) == config.vocab_size * row
    expected = q.weight_bytes(stored) - q.weight_bytes(stored["embedding"]) + looked_up
    assert step_floor(p.static, 32)["weights"] == pytest.approx(expected)
