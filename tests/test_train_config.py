"""Training config, data pipeline and schedule: values, and every bad input erroring
before anything is compiled (counted with a jax.monitoring compile listener)."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from train.data import pipeline as data_lib
from tests.synthetic import train_data as fixtures
from train import main as main_lib
from train.config import TrainConfigError, load_config, mesh_shape
from train.step import attention_pairs, decay_mask, lr_schedule, model_flops_per_row
from tests import xla

from tests.compiles import COMPILES  # noqa: E402 - every compile (or cache load) here


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tiny"))
    paths = fixtures.make_tiny_setup(root, num_docs=24)
    paths["nomask_tok"] = fixtures.train_tokenizer(os.path.join(root, "tok_nomask"),
                                                   mask_token=False)
    return paths


def _write(setup, tmp_path, **over):
    return fixtures.write_config(str(tmp_path / "cfg.yaml"), fixtures.tiny_config_dict(setup, **over))


def _main_error(argv, capsys):
    """Run wedlm-train in-process; it must exit with status 2 without compiling anything."""
    before = len(COMPILES)
    rc = main_lib.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(COMPILES) == before, "something was compiled before the error"
    return err


# ------------------------------------------------------------------------------ config values

def test_yaml_and_overrides(setup, tmp_path):
    path = _write(setup, tmp_path)
    cfg = load_config(path, ["optimizer.lr=0.5", "steps=20", "objective.mask_per_block=false",
                             "data.train_files=[a.jsonl, b.jsonl]"])
    assert cfg.optimizer.lr == 0.5 and cfg.steps == 20 and cfg.objective.mask_per_block is False
    assert cfg.data.train_files == ("a.jsonl", "b.jsonl")
    assert cfg.objective.block_size == 8 and cfg.data.seq_len == 32
    assert cfg.warmup == 2
    cfg = load_config(path, ["optimizer.warmup_steps=null", "optimizer.warmup_ratio=0.5"])
    assert cfg.warmup == 3


@pytest.mark.parametrize("name", ["wedlm_7b_from_qwen25", "wedlm_8b_from_qwen3", "sft", "tiny_cpu"])
def test_shipped_configs_load(name):
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", f"{name}.yaml"))
    if name.startswith("wedlm"):
        assert cfg.objective.block_size == 32 and cfg.optimizer.lr == 3e-6
        assert cfg.optimizer.final_lr == 3e-7 and cfg.compute_dtype == "bf16"
        assert cfg.objective.mask_token_id == 151665
    if name == "sft":
        assert cfg.optimizer.weight_decay == 0.01 and cfg.warmup == 150 and cfg.optimizer.clip == 1.0


def test_lr_schedule_values(setup, tmp_path):
    cfg = load_config(_write(setup, tmp_path), ["steps=12", "optimizer.warmup_steps=4",
                                                "optimizer.lr=1.0", "optimizer.final_lr=0.1"])
    f = lr_schedule(cfg)
    got = np.array([float(f(i)) for i in range(14)])
    expect = [0.25, 0.5, 0.75, 1.0] + [0.1 + 0.45 * (1 + np.cos(np.pi * (i - 4) / 8))
                                       for i in range(4, 14)]
    expect[12:] = [0.1, 0.1]
    np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-7)


def test_mu_dtype_halves_the_first_moment(setup, tmp_path):
    """optimizer.mu_dtype=bf16 stores Adam's first moment in bfloat16 (the second stays float32)
    and the update follows the float32 one to bfloat16 precision."""
    import jax.numpy as jnp
    from train.step import make_optimizer
    params = {"w": jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32).reshape(8, 8)}
    grads = {"w": jnp.cos(jnp.arange(64, dtype=jnp.float32)).reshape(8, 8)}
    ups = {}
    for mu in ("null", "bf16"):
        cfg = load_config(_write(setup, tmp_path), ["steps=12", f"optimizer.mu_dtype={mu}"])
        opt = make_optimizer(cfg)
        state = opt.init(params)
        dtypes = {str(x.dtype) for x in jax.tree.leaves(state) if getattr(x, "ndim", 0) == 2}
        assert dtypes == ({"float32"} if mu == "null" else {"float32", "bfloat16"}), dtypes
        for _ in range(3):
            u, state = opt.update(grads, state, params)
        ups[mu] = np.asarray(u["w"])
    np.testing.assert_allclose(ups["bf16"], ups["null"], rtol=2e-2, atol=1e-9)
    assert np.abs(ups["null"]).max() > 0


def test_decay_mask():
    params = {"embedding": 1, "lm_head": 1, "final_norm": {"scale": 1},
              "layers_0": {"attn": {"q_proj": {"kernel": 1, "bias": 1}, "q_norm": {"scale": 1}}}}
    m = decay_mask(params, True)
    assert m == {"embedding": True, "lm_head": True, "final_norm": {"scale": False},
                 "layers_0": {"attn": {"q_proj": {"kernel": True, "bias": False},
                                       "q_norm": {"scale": False}}}}
    assert decay_mask(params, False)["embedding"] is False


def test_flops_count():
    from wedlm_jax.config import ModelConfig
    from wedlm_jax.masking import dual_stream_mask
    c = ModelConfig(model_type="qwen3", vocab_size=10, hidden_size=4, intermediate_size=6,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2)
    # allowed pairs = the true entries of the dual-stream mask (~1/4 of (2L)^2 for long rows)
    for length, block in ((3, 2), (7, 3), (64, 8), (100, 32)):
        assert attention_pairs(length, "dual_stream", block) == dual_stream_mask(length, block).sum()
    assert attention_pairs(1024, "ar_only", 32) == 1024 * 1025 // 2
    assert 0.24 < attention_pairs(1024, "dual_stream", 32) / 2048 ** 2 < 0.27
    # L = 3, B = 2: T = 6 slots; per slot: qkv 2*4*(4+2+2) = 64, o 2*4*4 = 32, mlp 2*3*4*6 = 144,
    # head 2*4*10 = 80; attention 4 * q_dim (4) FLOPs per allowed pair (12); training = 3x.
    assert model_flops_per_row(c, 3, "dual_stream", 2) == 3 * ((64 + 32 + 144 + 80) * 6 + 4 * 12 * 4)
    assert model_flops_per_row(c, 3, "ar_only", 2) == 3 * ((64 + 32 + 144 + 80) * 3 + 4 * 6 * 4)


# -------------------------------------------------------------------------------------- data

def test_sft_only_response_is_trained(setup):
    info = data_lib.load_tokenizer(setup["tokenizer"])
    ids, trained = data_lib.tokenize_record({"prompt": "the cat sat", "response": "a big dog"}, info)
    tok = info.tokenizer
    assert tok.decode(ids[trained].tolist(), skip_special_tokens=True).split() == ["a", "big", "dog"]
    assert "cat" in tok.decode(ids[~trained].tolist())
    ids2, tr2 = data_lib.tokenize_record({"messages": [
        {"role": "user", "content": "one two"}, {"role": "assistant", "content": "three"},
        {"role": "user", "content": "four"}, {"role": "assistant", "content": "five six"}]}, info)
    assert tok.decode(ids2[tr2].tolist(), skip_special_tokens=True).split() == ["three", "five", "six"]
    ids3, tr3 = data_lib.tokenize_record({"text": "red tree"}, info)
    assert tr3.all() and ids3[-1] == info.eos_token_id


def test_pack_rows():
    docs = data_lib.Documents([np.arange(1, 6, dtype=np.int32), np.arange(10, 13, dtype=np.int32),
                               np.arange(20, 29, dtype=np.int32)],
                              [np.ones(5, bool), np.array([0, 1, 1], bool), np.ones(9, bool)], [], 3)
    rows = data_lib.pack(docs, 8, seed=0)
    # every document's tokens appear exactly once, in order, under one segment id per row piece
    toks, segs = rows["tokens"], rows["segment_ids"]
    assert toks.shape[1] == 8 and (toks[segs == 0] == 0).all()
    pieces = []
    for t, s, m in zip(toks, segs, rows["maskable"]):
        for k in range(1, s.max() + 1):
            pieces.append((t[s == k].tolist(), m[s == k].tolist()))
    assert sorted(p for p, _ in pieces) == [[1, 2, 3, 4, 5], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27],
                                            [28]]
    assert dict((tuple(p), m) for p, m in pieces)[(10, 11, 12)] == [False, True, True]


def test_pipeline_order_independent_of_process_count_and_resumable(setup):
    info = data_lib.load_tokenizer(setup["tokenizer"])
    rows = data_lib.pack(data_lib.load_documents([setup["train"]], info, vocab_size=96), 32, 0)
    one = iter(data_lib.make_pipeline(rows, 8, 5, first_row=0, local_rows=8))
    halves = [iter(data_lib.make_pipeline(rows, 8, 5, first_row=4 * p, local_rows=4)) for p in (0, 1)]
    batches = [next(one) for _ in range(4)]
    for b in batches:
        parts = [next(h) for h in halves]
        for k in b:
            np.testing.assert_array_equal(b[k], np.concatenate([p[k] for p in parts]))
    np.testing.assert_array_equal(batches[1]["index"], np.arange(8, 16))
    # an epoch visits every row once; the next epoch reshuffles
    n = len(rows["tokens"])
    it = iter(data_lib.make_pipeline(rows, 1, 5, first_row=0, local_rows=1))
    firsts = [next(it)["tokens"][0].tolist() for _ in range(2 * n)]
    assert sorted(firsts[:n]) == sorted(rows["tokens"].tolist())
    assert firsts[:n] != firsts[n:]
    # get_state / set_state resumes exactly
    it = iter(data_lib.make_pipeline(rows, 8, 5, first_row=0, local_rows=8))
    next(it)
    state = it.get_state()
    want = [next(it)["index"].tolist() for _ in range(2)]
    it2 = iter(data_lib.make_pipeline(rows, 8, 5, first_row=0, local_rows=8))
    it2.set_state(state)
    assert [next(it2)["index"].tolist() for _ in range(2)] == want == [list(range(8, 16)),
                                                                     list(range(16, 24))]


def test_malformed_lines_error_or_skip(setup, tmp_path):
    info = data_lib.load_tokenizer(setup["tokenizer"])
    bad = fixtures.write_jsonl(str(tmp_path / "bad.jsonl"), [
        {"text": "the cat"}, "{not json", {"text": 3}, {"prompt": "a"}, {"foo": "bar"},
        {"messages": [{"role": "user", "content": "hi"}]}, {"text": "a dog"}])
    with pytest.raises(data_lib.DataError, match=r"bad\.jsonl:2: not valid JSON"):
        data_lib.load_documents([bad], info, vocab_size=96)
    docs = data_lib.load_documents([bad], info, vocab_size=96, skip_bad_lines=True)
    assert len(docs.tokens) == 2 and docs.num_lines == 7
    reasons = [s.split(": ", 1) for s in docs.skipped]
    assert [r[0].rsplit(":", 1)[1] for r in reasons] == ["2", "3", "4", "5", "6"]
    assert "'text' must be a string" in reasons[1][1]
    assert "'response'" in reasons[2][1] and "no 'text'" in reasons[3][1]
    assert "no assistant turn" in reasons[4][1]


# ---------------------------------------------------------------------- bad input, before compile

def test_unknown_key_names_nearest(setup, tmp_path, capsys):
    path = _write(setup, tmp_path)
    err = _main_error(["--config", path, "optimizer.weight_decy=0.1"], capsys)
    assert "unknown config key 'optimizer.weight_decy'" in err and "'optimizer.weight_decay'" in err
    cfg = fixtures.tiny_config_dict(setup)
    cfg["objective"]["blocksize"] = 4
    path2 = fixtures.write_config(str(tmp_path / "bad.yaml"), cfg)
    err = _main_error(["--config", path2], capsys)
    assert "'objective.blocksize'" in err and "did you mean 'objective.block_size'" in err
    err = _main_error(["--config", path, "model.config.hiden_size=8"], capsys)
    assert "'hiden_size'" in err and "model.config.hidden_size" in err


@pytest.mark.parametrize("override,expect", [
    ("objective.block_size=0", "objective.block_size must be >= 1, got 0"),
    ("objective.ar_weight=-0.5", "objective.ar_weight (a loss weight) must be >= 0, got -0.5"),
    ("optimizer.warmup_steps=7", "optimizer.warmup_steps (7) exceeds the total steps (6)"),
    ("objective.kind=mlm", "objective.kind must be one of dual_stream, plain, ar_only"),
    ("compute_dtype=f16", "compute_dtype must be one of bf16, f32"),
    ("optimizer.mu_dtype=f16", "optimizer.mu_dtype must be null (the params' dtype), bf16 or f32"),
])
def test_bad_values(setup, tmp_path, capsys, override, expect):
    err = _main_error(["--config", _write(setup, tmp_path), override], capsys)
    assert expect in err


def test_tokenizer_without_mask_token(setup, tmp_path, capsys):
    path = _write(setup, tmp_path, **{"data.tokenizer": setup["nomask_tok"]})
    err = _main_error(["--config", path], capsys)
    assert "has no mask token" in err and "objective.mask_token_id" in err
    # given explicitly, or not needed (ar_only), it is accepted: the config is prepared
    cfg = load_config(path, ["objective.mask_token_id=95"])
    assert main_lib.prepare(cfg)["mask_token_id"] == 95
    cfg = load_config(path, ["objective.kind=ar_only"])
    assert main_lib.prepare(cfg)["mask_token_id"] is None


def test_missing_data_files(setup, tmp_path, capsys):
    path = _write(setup, tmp_path, **{"data.train_files": [setup["train"], "/nonexistent/x.jsonl"]})
    err = _main_error(["--config", path], capsys)
    assert "1 file(s) do not exist: /nonexistent/x.jsonl" in err


def test_malformed_line_stops_run(setup, tmp_path, capsys):
    bad = fixtures.write_jsonl(str(tmp_path / "b.jsonl"), [{"text": "a cat"}, '{"text": "x"'])
    path = _write(setup, tmp_path, **{"data.train_files": [bad]})
    err = _main_error(["--config", path], capsys)
    assert f"{bad}:2: not valid JSON" in err
    # --skip-bad-lines: the line is skipped and counted, the run can go on
    cfg = main_lib.config_from_args(main_lib.parse_args(["--config", path, "--skip-bad-lines"]))
    prep = main_lib.prepare(cfg)
    assert prep["docs"].skipped == [f"{bad}:2: not valid JSON (Expecting ',' delimiter at column 13)"]
    assert len(prep["docs"].tokens) == 1


def test_mesh_not_dividing_devices(setup, tmp_path, capsys):
    err = _main_error(["--config", _write(setup, tmp_path), "mesh.fsdp=2"], capsys)
    assert "mesh.fsdp x mesh.tensor = 2 does not divide the 1 devices" in err
    err = _main_error(["--config", _write(setup, tmp_path), "mesh.data=3"], capsys)
    assert "= 3 does not match the 1 devices" in err


def test_mesh_not_dividing_batch():
    cfg = load_config(None, ["model.config={}", "data.train_files=[x]", "data.global_batch_size=6"])
    assert mesh_shape(cfg, 2) == (2, 1, 1)
    with pytest.raises(TrainConfigError, match="microbatch .* 6 rows.* not divisible by the "
                                               "batch-sharding mesh axes data x fsdp = 4"):
        mesh_shape(cfg, 4)
    with pytest.raises(TrainConfigError, match="must be a multiple of optimizer.grad_accum"):
        load_config(None, ["model.config={}", "data.train_files=[x]", "data.global_batch_size=6",
                           "optimizer.grad_accum=4"])


def test_mesh_not_dividing_batch_program(setup, tmp_path):
    """The same through wedlm-train on 4 CPU devices (a subprocess): exit 2, nothing compiled."""
    path = _write(setup, tmp_path, **{"data.global_batch_size": 6})
    code = (
        "import jax, sys\n"
        "n = []\n"
        "jax.monitoring.register_event_duration_secs_listener(lambda name, *a, **k: "
        "n.append(name) if name.endswith('backend_compile_duration') else None)\n"
        "jax.monitoring.register_event_listener(lambda name, *a, **k: "     # a load from the run's cache
        "n.append(name) if name == '/jax/compilation_cache/cache_hits' else None)\n"
        "from train.main import main\n"
        f"rc = main(['--config', {path!r}])\n"
        "print('RESULT', rc, len(n), jax.device_count())\n")
    env = dict(os.environ, XLA_FLAGS=xla.flags(4), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "RESULT 2 0 4" in out.stdout, out.stdout + out.stderr
    assert "not divisible by the batch-sharding mesh axes data x fsdp = 4" in out.stderr


def test_the_checks_allowed_values_are_the_models():
    """train/checks.py names the remat policies without loading jax; they are the model's."""
    from train import checks
    from wedlm_jax.model import REMAT_POLICIES
    assert checks.REMAT == REMAT_POLICIES
