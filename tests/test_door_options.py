"""Every decoding option through every door (decode/config.py defines each once): a value given at
wedlm-decode --prompt, wedlm-decode --input (the batch job) or wedlm-serve reaches the Decoder and
the requests it decodes; a value out of range is refused before the model loads, with the same
words at each door; an option a door cannot honour is refused, never ignored."""

from __future__ import annotations

import json

import pytest

from tests import plans
from decode import cli
from decode.serving import serve
from decode.static import static_batch
from decode.config import (ENGINE_FLAGS, SAMPLING_FLAGS, DecodeConfigError, EngineOptions, Method,
                           Placement, Sampling)
from decode.engine.runtime.decoder import Decoder

# a value other than the default for every option a door takes
ENGINE = dict(method="verified", window=4, refill="after", capacity=64, prefill_chunk=8, allow_long=True,
              constraint_backend="host")
BATCHING = dict(slots=2, steps_per_call=3, window_policy="load")   # --input and wedlm-serve only
SAMPLING = dict(tau=0.7, lam=0.05, sampling_order="temper_first", max_new_tokens=5,
                temperature=0.5, top_k=3, top_p=0.9, seed=7, min_p=0.05, presence_penalty=0.5,
                frequency_penalty=-0.25, repetition_penalty=1.1)
PLACEMENT = dict(dtype="bfloat16", attention="dense", kv_tile=16, weight_layout="compiler",
                 quantize="int8", quantize_group=0, kv_dtype="int8")
PAGES = dict(page_size=8, num_pages=40)                     # --input and wedlm-serve only
SERVE_FLAGS = {"max_new_tokens": "--max-tokens"}


def _flags(values: dict, names=None) -> list:
    out = []
    for k, v in values.items():
        flag = (names or {}).get(k, "--" + k.replace("_", "-"))
        out += [flag] if v is True else [flag, str(v)]
    return out


@pytest.fixture
def seen(monkeypatch):
    """What reached the Decoder: its construction's settings and every request it checked."""
    out = dict(decoders=[], requests=[], generate=[])
    init, check, gen = Decoder.__init__, Decoder.check_request, static_batch.generate

    def spy_init(self, params, plan):
        placement = {k: getattr(plan.placement, k) for k in Placement.__dataclass_fields__}
        out["decoders"].append({**EngineOptions.pick(plan.engine), **placement})
        init(self, params, plan)

    def spy_check(self, r):
        r = check(self, r)
        out["requests"].append(r)
        return r

    def spy_generate(params, config, prompts, dc, **kw):
        out["generate"].append((dc, kw))
        return gen(params, config, prompts, dc, **kw)

    monkeypatch.setattr(Decoder, "__init__", spy_init)
    monkeypatch.setattr(Decoder, "check_request", spy_check)
    monkeypatch.setattr(static_batch, "generate", spy_generate)
    return out


def test_every_option_is_defined_once_with_a_valid_default_and_help():
    """The flags the doors make are the options' definitions: every compile-time and per-request
    option has help, a default its own check accepts, and a flag at the doors that take it."""
    for cls in (Sampling, Method, EngineOptions):
        base = cls()
        for name, f in cls.options().items():
            assert f.metadata["help"], name
            assert base.replace(**{name: getattr(base, name)}) == base
    assert set(ENGINE_FLAGS) == set(EngineOptions.options())
    assert set(SAMPLING_FLAGS["wedlm-decode"]) == set(Sampling.options()) - {"stop_token_ids",
                                                                              "logit_bias"}
    for door, parser in (("wedlm-decode", cli._parser()), ("wedlm-serve", serve._parser())):
        text = parser.format_help()
        for name in ENGINE_FLAGS + SAMPLING_FLAGS[door]:
            flag = SERVE_FLAGS.get(name, "--" + name.replace("_", "-")) if door == "wedlm-serve" \
                else "--" + name.replace("_", "-")
            assert flag in text, (door, flag)
    assert set(SAMPLING) == set(SAMPLING_FLAGS["wedlm-decode"])
    assert set(ENGINE) | set(BATCHING) == set(ENGINE_FLAGS)
    assert set(PLACEMENT) | set(PAGES) == {f.name for f in Placement.__dataclass_fields__.values()} - {"mesh"}


def _check_sampling(requests, want: dict):
    assert requests
    for r in requests:
        for k, v in want.items():
            assert getattr(r, k) == v, (k, getattr(r, k), v)


def test_prompt_door_takes_every_option(ckpt, seen, capsys):
    code = cli.main(["--checkpoint", ckpt[0], "--prompt", "count with me", "--no-compile-cache",
                     *_flags(ENGINE), *_flags(SAMPLING), *_flags(PLACEMENT)])
    assert code == 0, capsys.readouterr().err
    (dc, kw), = seen["generate"]
    for k in ("method", "window", "refill", "prefill_chunk", *SAMPLING):
        assert getattr(dc, k) == {**ENGINE, **SAMPLING}[k], k
    assert (kw["capacity"], kw["allow_long"]) == (64, True)
    for k, v in PLACEMENT.items():                  # the door's placement, passed whole
        assert getattr(kw["placement"], k) == v, (k, getattr(kw["placement"], k), v)
    dec = seen["decoders"][-1]
    assert (dec["method"], dec["refill"], dec["prefill_chunk"], dec["kv_tile"]) == ("verified", "after", 8, 16)
    _check_sampling(seen["requests"], {k: v for k, v in SAMPLING.items() if k != "max_new_tokens"})


def test_prompt_door_refuses_what_only_batching_takes(ckpt, capsys):
    for extra, flag in ((["--slots", "4"], "--slots"), (["--steps-per-call", "2"], "--steps-per-call"),
                        (["--page-size", "8"], "--page-size")):
        code = cli.main(["--checkpoint", ckpt[0], "--prompt", "hi", "--no-compile-cache", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"wedlm-decode: error: {flag} applies "
                                                                   "to continuous batching"), err


def test_flags_that_need_another_are_refused_without_it(tmp_path, capsys):
    """A Ray flag without --ray, a dry-run flag without --dry-run: one line naming both flags,
    exit 2, before the checkpoint is read (there is none here)."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    door = ["--checkpoint", str(tmp_path / "none"), "--input", str(src), "--output",
            str(tmp_path / "out.jsonl")]
    for extra, flag, needs in ((["--replicas", "2"], "--replicas", "--ray"),
                               (["--block-size", "8"], "--block-size", "--ray"),
                               (["--replica-cpus", "2"], "--replica-cpus", "--ray"),
                               (["--replica-gpus", "1"], "--replica-gpus", "--ray"),
                               (["--replica-tpus", "4"], "--replica-tpus", "--ray"),
                               (["--lazy-compile"], "--lazy-compile", "--ray"),
                               (["--topology", "v5e:2x4"], "--topology", "--dry-run"),
                               (["--device-memory", "16"], "--device-memory", "--dry-run")):
        code = cli.main(door + extra)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (flag, err)
        assert err[0].startswith(f"wedlm-decode: error: {flag} goes with {needs}"), err


def _decoder_took(kw: dict, engine: dict):
    for k, v in {**engine, **BATCHING, **PLACEMENT, **PAGES}.items():
        assert kw[k] == v, (k, kw[k], v)


def test_input_door_takes_every_option(ckpt, seen, tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "count with me"}) + "\n"
                   + json.dumps({"prompt": "one, two", "tau": 0.2, "max_tokens": 3}) + "\n")
    code = cli.main(["--checkpoint", ckpt[0], "--input", str(src), "--output", str(out), "--no-compile-cache",
                     *_flags(ENGINE), *_flags(BATCHING), *_flags(SAMPLING), *_flags(PLACEMENT),
                     *_flags(PAGES)])
    assert code == 0, capsys.readouterr().err
    _decoder_took(seen["decoders"][-1], ENGINE)
    first, second = seen["requests"][:2]       # (the Batcher checks each again)
    _check_sampling([first], SAMPLING)
    _check_sampling([second], {**SAMPLING, "tau": 0.2, "max_new_tokens": 3})   # a line's own


def test_serve_door_takes_every_option(ckpt, seen):
    from fastapi.testclient import TestClient
    from decode.engine.runtime.batcher import Batcher
    names = {**SERVE_FLAGS}
    defaults = {k: v for k, v in SAMPLING.items() if k in SAMPLING_FLAGS["wedlm-serve"]}
    args = serve._parser().parse_args(["--checkpoint", ckpt[0], "--model-name", "tiny", *_flags(ENGINE),
                                       *_flags(BATCHING), *_flags(defaults, names),
                                       *_flags(PLACEMENT), *_flags(PAGES)])
    serve._check_args(args)
    decoder, tokenizer, cfg = serve.load_decoder(args)
    _decoder_took(seen["decoders"][-1], ENGINE)
    engine = serve.EngineThread(Batcher(decoder), max_pending=4, scorer=serve.scorer_for(decoder)).start()
    try:
        client = TestClient(serve.build_app(engine, tokenizer, cfg))
        per_request = {k: v for k, v in SAMPLING.items() if k not in defaults}
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "count with me", **per_request})
        assert r.status_code == 200, r.text
        _check_sampling(seen["requests"], SAMPLING)          # the flags' defaults + the body's
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "one", "tau": 0.1,
                                                 "max_tokens": 2, "sampling_order": "filter_first"})
        assert r.status_code == 200, r.text
        _check_sampling(seen["requests"][-1:], {"tau": 0.1, "max_new_tokens": 2, "lam": 0.05,
                                                "sampling_order": "filter_first"})
    finally:
        engine.shutdown(timeout=15)


# one bad value per option, with the words every door must give
BAD = [("tau", -1, "tau must be a finite number >= 0, got -1"),
       ("lam", -0.5, "lam must be a finite number >= 0, got -0.5"),
       ("temperature", -1, "temperature must be a finite number >= 0, got -1"),
       ("top_k", 2**40, f"top_k must be an int in [0, {2**31 - 1}], got {2**40}"),
       ("top_p", 0, "top_p must be in (0, 1], got 0"),
       ("seed", 2**33, f"seed must be an int in [0, {2**32 - 1}], got {2**33}"),
       ("sampling_order", "sideways", "sampling_order 'sideways' is unknown; allowed: filter_first, "
                                      "temper_first"),
       ("max_new_tokens", 0, f"max_new_tokens must be an int in [1, {2**31 - 1}], got 0"),
       ("min_p", 1.5, "min_p must be in [0, 1], got 1.5"),
       ("presence_penalty", 3, "presence_penalty must be in [-2, 2], got 3"),
       ("frequency_penalty", -2.5, "frequency_penalty must be in [-2, 2], got -2.5"),
       ("repetition_penalty", 0, "repetition_penalty must be a finite number > 0, got 0")]


@pytest.mark.parametrize("name,value,words", BAD, ids=[b[0] for b in BAD])
def test_a_bad_value_gets_the_same_words_at_every_door(ckpt, tmp_path, capsys, name, value, words):
    # wedlm-decode --prompt: before the checkpoint is read
    flag = "--" + name.replace("_", "-")
    code = cli.main(["--checkpoint", str(tmp_path / "nothing"), "--prompt", "hi", flag, str(value)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"wedlm-decode: error: {words}"], err
    # the batch job: the line and the field, before the weights are read
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": "hi", name: value}) + "\n")
    code = cli.main(["--checkpoint", ckpt[0], "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                     "--no-compile-cache"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"{src}:2: field {name!r}: {words}" in err[0], err
    assert not (tmp_path / "o.jsonl").exists()
    # wedlm-serve: its own flags at start, a request's values as a 400 naming the field
    if name in SAMPLING_FLAGS["wedlm-serve"]:
        code = serve.main(["--checkpoint", ckpt[0], SERVE_FLAGS.get(name, flag), str(value)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1] == f"wedlm-serve: error: {words}", err
    wire = "max_tokens" if name == "max_new_tokens" else name
    body = {"model": "tiny", "prompt": "hi", wire: value}
    with pytest.raises(serve.APIError) as e:
        serve.parse_settings(body, Sampling())
    assert e.value.status == 400 and e.value.param == wire
    assert e.value.message == words.replace("max_new_tokens", "max_tokens")


def test_engine_options_refused_at_start_at_every_door(ckpt, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    for flag, value, words in (("--window", "0", "window must be an int in [1, 256], got 0"),
                               ("--refill", "sideways", "refill 'sideways' is unknown; allowed: before, after"),
                               ("--slots", "0", "slots must be an int in [1, 2147483647], got 0"),
                               ("--prefill-chunk", "-3", "prefill_chunk must be an int in [1, 2147483647], got -3")):
        for door in (["--prompt", "hi"], ["--input", str(src), "--output", str(tmp_path / "o.jsonl")]):
            code = cli.main(["--checkpoint", ckpt[0], *door, flag, value])
            err = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and err == [f"wedlm-decode: error: {words}"], (door, err)
        code = serve.main(["--checkpoint", ckpt[0], flag, value])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1] == f"wedlm-serve: error: {words}", err


def test_decoder_checks_with_the_same_definitions():
    """The library door (Decoder, Request, DecodeConfig) refuses with the doors' words."""
    for make, words in ((lambda: Sampling(tau=-1), BAD[0][2]),
                        (lambda: Sampling(top_k=2**40), BAD[3][2]),
                        (lambda: EngineOptions(window=0), "window must be an int in [1, 256], got 0")):
        with pytest.raises(DecodeConfigError) as e:
            make()
        assert str(e.value) == words
    with pytest.raises(DecodeConfigError, match=r"window must be an int in \[1, 256\], got 0"):
        plans.decoder({}, None, window=0)


def test_serve_refuses_dry_run_flags_without_dry_run(capsys):
    from decode.serving import serve
    assert serve.main(["--checkpoint", "demo/model", "--topology", "h100"]) == 2
    assert "--topology goes with --dry-run" in capsys.readouterr().err
