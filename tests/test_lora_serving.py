"""Serving many LoRA adapters in one continuous batch, on the demo model (CPU, float32) with two
random PEFT adapters large enough to change its greedy output:

  the batched low-rank forward (an adapter table, a row per sequence) equals, row by row, the
  forward of that row's adapter merged into the weights (`lora.fold`);
  two adapters and the base decoded in one continuous batch each give their solo run's tokens
  (streaming, verified, AR), and verified streaming gives AR's under an adapter;
  the server lists the adapters, serves `model: NAME`, loads and unloads at run time, refuses
  unknown names (404) and bad adapters (400 naming them), and compiles nothing for a new adapter.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode.config import DecodeConfigError
from decode.engine.runtime.batcher import Batcher
from decode.engine.step.state import Request
from decode.lora_options import LoraOptions
from demo.eval import DEMO_MODEL, load_model
from tests import plans
from wedlm_jax.lora import apply as lora_lib
from wedlm_jax.lora import table as lora_table
from wedlm_jax.lora.spec import LoraSpec
from wedlm_jax.model import Transformer
from wedlm_jax.lora.peft import save_peft

SPECS = {"alpha": LoraSpec(rank=4, alpha=8.0, targets=("all-linear",)),
         "beta": LoraSpec(rank=8, alpha=8.0, targets=("q", "v", "down"))}
SCALES = {"alpha": 0.1, "beta": 0.2}       # large enough to change the greedy tokens
LENGTHS = (24, 17, 20, 12)                   # the prompts' lengths (the demo's eval prompts, cut)


def random_adapter(config, spec, seed, scale):
    """An adapter tree of `spec`, A and B both random (scaled so the output changes)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (scale * rng.standard_normal(s.shape)).astype(np.float32),
                        lora_lib.adapter_shapes(config, spec))


@pytest.fixture(scope="module")
def demo():
    config, params, tokenizer = load_model(check=False)
    return config, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params), tokenizer


@pytest.fixture(scope="module")
def prompts(demo):
    with open(os.path.join(DEMO_MODEL, "eval.jsonl")) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()][:len(LENGTHS)]
    return [tuple(demo[2].encode(t))[:n] for t, n in zip(texts, LENGTHS)]


@pytest.fixture(scope="module")
def adapters(demo, tmp_path_factory):
    """{name: (spec, adapter tree, PEFT folder)}."""
    config = demo[0]
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for seed, (name, spec) in enumerate(SPECS.items(), 1):
        tree = random_adapter(config, spec, seed, SCALES[name])
        out[name] = (spec, tree, save_peft(config, tree, spec, root / name, base=DEMO_MODEL))
    return out


def test_batched_forward_equals_each_rows_merged_weights(demo, adapters):
    config, params, _ = demo
    table = lora_table.empty_table(config, 3, 8)
    for row, name in ((1, "alpha"), (3, "beta")):
        spec, tree, _ = adapters[name]
        table = lora_table.write_row(table, row, lora_table.adapter_rows(config, tree, spec, 8))
    rng = np.random.default_rng(0)
    tokens, positions = rng.integers(0, 512, (3, 12)), np.tile(np.arange(12), (3, 1))
    model = Transformer(config)
    got = np.asarray(model.apply({"params": lora_table.attach(params, table)}, tokens, positions,
                                 lora_index=jnp.asarray([1, 0, 3], jnp.int32)))
    base = np.asarray(model.apply({"params": params}, tokens, positions))
    for i, name in ((0, "alpha"), (2, "beta")):
        spec, tree, _ = adapters[name]
        want = np.asarray(model.apply({"params": lora_lib.fold(params, tree, spec)}, tokens,
                                      positions))[i]
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-4)
        assert np.abs(want - base[i]).max() > 0.5          # the adapter matters
    np.testing.assert_array_equal(got[1], base[1])         # row 0: the base, exactly


def _decoder(demo, method, **kw):
    config, params, _ = demo
    return plans.decoder(params, config, method=method, window=4, slots=4, capacity=64,
                         steps_per_call=3, sampling=False, kv_tile=16,
                         lora=LoraOptions(enable_lora=True, max_loras=2, max_lora_rank=8), **kw)


def _run(batcher, jobs):
    """Submit every (prompt, adapter name or None) at once; {index: generated ids}."""
    done, ids = {}, {}
    for i, (prompt, name) in enumerate(jobs):
        rid = batcher.submit(Request(prompt=prompt, max_new_tokens=12, stop_token_ids=()),
                             on_finish=lambda f: done.__setitem__(f.request_id, f.tokens),
                             adapter=name)
        ids[rid] = i
    batcher.run_until_idle()
    return {ids[k]: v for k, v in done.items()}


@pytest.mark.parametrize("method, page_size", [("streaming", 16), ("verified", 16), ("ar", 0)])
def test_adapters_and_base_in_one_batch_equal_solo(demo, adapters, prompts, method, page_size):
    dec = _decoder(demo, method, page_size=page_size)
    for name in SPECS:
        dec.adapters.load(name, adapters[name][2])
    jobs = [(prompts[0], "alpha"), (prompts[0], None), (prompts[0], "beta"),
            (prompts[1], "alpha"), (prompts[2], "beta"), (prompts[3], None)]
    together = _run(Batcher(dec), jobs)
    for i, job in enumerate(jobs):
        assert together[i] == _run(Batcher(dec), [job])[0], (method, job)
    outs = {tuple(together[i]) for i in range(3)}
    assert len(outs) == 3, outs                              # each adapter changes the output


def test_verified_equals_ar_under_an_adapter(demo, adapters, prompts):
    """AR with one weight tree per layer (GPU's layout: the table unstacked too)."""
    from wedlm_jax.model import unstack_layers
    config, params, tok = demo
    got = {}
    for method in ("verified", "ar"):
        dec = _decoder(demo if method == "verified" else
                       (config, unstack_layers(params, config.num_layers), tok), method)
        assert dec.static.stacked_layers == (method == "verified")
        dec.adapters.load("beta", adapters["beta"][2])
        got[method] = _run(Batcher(dec), [(p, "beta") for p in prompts])
    assert got["verified"] == got["ar"]


def test_without_lora_nothing_is_added(demo):
    """No table in the weights, no adapter row in the state (the programs are today's), no
    memory counted; with --enable-lora the table's bytes are."""
    config, params, _ = demo
    dec = plans.decoder(params, config, method="ar", slots=2, capacity=64, sampling=False)
    assert dec.adapters is None and dec.init_state().lora is None
    assert not lora_table.has_table(dec.params) and dec.memory_estimate["lora"] == 0
    table = lora_table.table_shapes(config, 2, 8)
    assert _decoder(demo, "ar").memory_estimate["lora"] == sum(
        x.size * 4 for x in jax.tree.leaves(table))


def test_a_held_adapter_is_not_unloaded(demo, adapters):
    dec = _decoder(demo, "ar")
    dec.adapters.load("alpha", adapters["alpha"][2])
    row = dec.adapters.acquire("alpha")
    with pytest.raises(DecodeConfigError, match="in use by 1 request"):
        dec.adapters.unload("alpha")
    dec.adapters.release(row)
    dec.adapters.unload("alpha")
    with pytest.raises(DecodeConfigError, match="'alpha' does not exist"):
        Batcher(dec).submit(Request(prompt=(1, 2)), adapter="alpha")


# ------------------------------------------------------------------------------ the server

@pytest.fixture(scope="module")
def server(demo, adapters):
    """wedlm-serve's app over the demo model with --enable-lora, 'alpha' loaded at start."""
    pytest.importorskip("fastapi")
    from decode.serving import serve
    from tests.live_server import serve_in_thread
    args = serve._parser().parse_args([
        "--checkpoint", DEMO_MODEL, "--slots", "4", "--window", "4", "--capacity", "64",
        "--no-default-stops", "--model-name", "demo", "--api-key", "key", "--enable-lora",
        "--lora-modules", f"alpha={adapters['alpha'][2]}", "--max-loras", "2",
        "--max-lora-rank", "8"])
    decoder, tokenizer, cfg = serve.load_decoder(args)
    batcher = Batcher(decoder)
    batcher.warm_up(64, every_bucket=False)
    engine = serve.EngineThread(batcher, max_pending=8, scorer=serve.scorer_for(decoder)).start()
    url, srv, thread, sock = serve_in_thread(serve.build_app(engine, tokenizer, cfg))
    yield url
    srv.should_exit = True
    thread.join(15)
    engine.shutdown(timeout=15)
    sock.close()


def _post(url, path, body, key="key"):
    import httpx
    return httpx.post(url + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"} if key else {})


def _text(url, model, prompt):
    r = _post(url, "/v1/completions", {"model": model, "prompt": list(prompt), "max_tokens": 10})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


def _bad_folders(demo, adapters, root):
    """{what: (PEFT folder, the words its refusal names)}: a rank above the bound, another base's
    shapes, DoRA."""
    import shutil
    config = demo[0]
    wide = LoraSpec(rank=16, alpha=16.0, targets=("q",))
    other = config.replace(hidden_size=256)
    dora = shutil.copytree(adapters["beta"][2], root / "dora")
    with open(dora / "adapter_config.json") as f:
        c = json.load(f)
    with open(dora / "adapter_config.json", "w") as f:
        json.dump(dict(c, use_dora=True), f)
    return {"rank": (save_peft(config, random_adapter(config, wide, 3, 0.1), wide, root / "wide"),
                     "r=16 is above the rank bound 8"),
            "base": (save_peft(other, random_adapter(other, SPECS["beta"], 4, 0.1),
                               SPECS["beta"], root / "other"), "shape (256, 8), the model needs (384, 8)"),
            "dora": (str(dora), "use_dora=True")}


def test_server_serves_adapters_by_model_name(server, demo, adapters, prompts, tmp_path):
    from decode.engine.step import programs
    url = server
    import httpx
    cards = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer key"}).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("demo", None), ("alpha", "demo")]
    base, alpha = _text(url, "demo", prompts[0]), _text(url, "alpha", prompts[0])
    assert base != alpha and _text(url, "demo", prompts[0]) == base   # (a prefix hit's program)
    r = _post(url, "/v1/completions", {"model": "gamma", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and "`gamma` does not exist" in r.json()["error"]["message"]
    # a new adapter at run time: nothing compiles for it
    before = programs.compiled_count() + lora_table.write_row._cache_size()
    body = {"lora_name": "beta", "lora_path": str(adapters["beta"][2])}
    assert _post(url, "/v1/load_lora_adapter", body, key=None).status_code == 401
    r = _post(url, "/v1/load_lora_adapter", body)
    assert r.status_code == 200 and "beta" in r.text, r.text
    beta = _text(url, "beta", prompts[0])
    assert beta not in (base, alpha)
    assert programs.compiled_count() + lora_table.write_row._cache_size() == before
    assert _post(url, "/v1/load_lora_adapter", body).status_code == 400      # loaded already
    # refused by name before any device work
    for what, (folder, words) in _bad_folders(demo, adapters, tmp_path).items():
        r = _post(url, "/v1/load_lora_adapter", {"lora_name": what, "lora_path": str(folder)})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (what, r.text)
    # unloaded: its name is gone, its row serves the next adapter
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "alpha"}).status_code == 200
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "alpha"}).status_code == 404
    r = _post(url, "/v1/completions", {"model": "alpha", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404
    body = {"lora_name": "alpha2", "lora_path": str(adapters["alpha"][2])}
    assert _post(url, "/v1/load_lora_adapter", body).status_code == 200
    assert _text(url, "alpha2", prompts[0]) == alpha and _text(url, "demo", prompts[0]) == base
    assert _text(url, "beta", prompts[0]) == beta
    assert programs.compiled_count() + lora_table.write_row._cache_size() == before


def test_batch_job_lines_name_adapters(demo, adapters, prompts, tmp_path, capsys):
    from decode import cli
    lines = [{"id": "a", "prompt": list(prompts[0]), "model": "alpha"},
             {"id": "b", "prompt": list(prompts[0])}, {"id": "c", "prompt": list(prompts[1]),
                                                        "model": "alpha"}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    flags = ["--checkpoint", DEMO_MODEL, "--input", str(src), "--method", "ar",
             "--max-new-tokens", "12", "--no-default-stops", "--slots", "4", "--enable-lora",
             "--lora-modules", f"alpha={adapters['alpha'][2]}", "--max-lora-rank", "8"]
    assert cli.main(flags + ["--output", str(out)]) == 0
    got = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    dec = _decoder(demo, "ar")
    dec.adapters.load("alpha", adapters["alpha"][2])
    want = _run(Batcher(dec), [(prompts[0], "alpha"), (prompts[0], None), (prompts[1], "alpha")])
    assert [got["a"], got["b"], got["c"]] == [want[0], want[1], want[2]]
    src.write_text(json.dumps({"prompt": "x", "model": "zeta"}) + "\n")
    assert cli.main(flags + ["--output", str(tmp_path / "o2.jsonl")]) == 2
    assert "in.jsonl:1: field 'model': 'zeta' is not an adapter of the job" in \
        capsys.readouterr().err
    assert cli.main(flags[:4] + ["--output", str(out), "--lora-modules", "x=y"]) == 2
    assert "--lora-modules goes with --enable-lora" in capsys.readouterr().err


def test_static_generate_names_an_adapter_per_prompt(demo, adapters, prompts):
    """`generate(..., adapters=[...])`: each prompt under its adapter (or the base) gives the
    continuous batch's tokens; the holds are given back; an unknown name is refused first."""
    from decode.config import DecodeConfig
    from decode.static.static_batch import generate
    dec = _decoder(demo, "streaming")
    dec.adapters.load("alpha", adapters["alpha"][2])
    names = ["alpha", None, "alpha"]
    dc = DecodeConfig(method="streaming", window=4, max_new_tokens=12, stop_token_ids=())
    res = generate(demo[1], demo[0], prompts[:3], dc, decoder=dec, adapters=names)
    want = _run(Batcher(dec), list(zip(prompts[:3], names)))
    assert res.tokens == [want[0], want[1], want[2]]
    assert res.tokens[0] != generate(demo[1], demo[0], prompts[:1], dc, decoder=dec).tokens[0]
    assert [a.holds for a in dec.adapters.loaded()] == [0]
    with pytest.raises(DecodeConfigError, match="'zeta' not loaded"):
        generate(demo[1], demo[0], prompts[:2], dc, decoder=dec, adapters=["zeta", "alpha"])
    assert [a.holds for a in dec.adapters.loaded()] == [0]


def test_prefix_pages_are_reused_under_the_same_adapter_only(demo, adapters, prompts):
    """The paged cache's prefix reuse keys a prompt's pages by its adapter as well as its tokens:
    a prompt sharing two full pages with an earlier one under the same adapter reuses them (and
    decodes as without reuse); under another adapter, the base, or an adapter loaded again into
    the same row, it reuses nothing."""
    dec = _decoder(demo, "streaming", page_size=16)
    for name in SPECS:
        dec.adapters.load(name, adapters[name][2])
    prefix = (tuple(prompts[0]) + tuple(prompts[1]))[:32]
    tails = [tuple(prompts[2][:5]), tuple(prompts[3][:5]), tuple(prompts[2][5:10])]
    batcher = Batcher(dec)

    def one(prompt, name):
        done = {}
        batcher.submit(Request(prompt=prompt, max_new_tokens=12, stop_token_ids=()),
                       on_finish=lambda f: done.setdefault("f", f), adapter=name)
        batcher.run_until_idle()
        return done["f"]

    first = one(prefix + tails[0], "alpha")
    assert first.cached_tokens == 0
    again = one(prefix + tails[1], "alpha")
    assert again.cached_tokens == 32
    assert again.tokens == _run(Batcher(dec), [(prefix + tails[1], "alpha")])[0]   # no reuse
    assert one(prefix + tails[2], "beta").cached_tokens == 0
    assert one(prefix + tails[2], None).cached_tokens == 0
    assert one(prefix + tails[0], None).cached_tokens == 32        # the base's own pages
    dec.adapters.unload("alpha")
    dec.adapters.load("alpha", adapters["beta"][2])                 # the same row, other weights
    reloaded = one(prefix + tails[1], "alpha")
    assert reloaded.cached_tokens == 0
    assert reloaded.tokens == _run(Batcher(dec), [(prefix + tails[1], "beta")])[0]
    batcher.pool.check()
