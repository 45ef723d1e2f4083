"""The PyTorch peer on the same card and shapes: transformers' greedy decode with a static KV cache
and `torch.compile`, the AR step timed at each batch, in a process of its own.

    python -m benchmarks.gpu.torch_baseline --out FILE [--shape 8b] [--batches 1,8] [--live 2048]
                                        [--steps 32] [--rounds 5] [--compile reduce-overhead]
    python -m benchmarks.gpu.torch_baseline --smoke --out FILE     # this CPU: the tiny shape, eager

The model is a `Qwen3ForCausalLM` built from the `Qwen3Config` of one of the shapes the JAX runs
use (`benchmarks.shapes.DECODE_SHAPES`, written by `ModelConfig.to_hf_dict`), its random
weights made on the device in bf16 (no download). Per batch: a `StaticCache` of `live` + the
decoded tokens rows (transformers' static-cache attention reads every row of it: the cache is as
long as a `generate` call of these tokens would make it), a prompt of `live` random tokens a row
prefilled eagerly, then the decode step as transformers' documentation compiles it (one token a
row: the model's forward and the argmax, `torch.compile(mode=..., fullgraph=True)`; mode
reduce-overhead adds CUDA graphs, the standard for static-cache decode). The batches are compiled
in turn, then timed in interleaved rounds of `steps` steps each (torch.cuda.synchronize around a
round), medians: ms per step and tokens/s. A batch whose compile fails is timed eager, marked so.

`--out` is written after every stage (build, each batch's prefill and compile, the timed rounds),
so a process stopped at its time limit (`benchmarks.gpu.on_gpu` runs it with one) keeps what it had.
`--compile none` runs the same loop eagerly (the CPU smoke: inductor on two cores is slow).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import time

MODES = ("reduce-overhead", "max-autotune-no-cudagraphs", "default", "none")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hf_config(shape: str):
    """The `Qwen3Config` of one of `benchmarks.shapes.DECODE_SHAPES` ('smoke': SMOKE_SHAPE)."""
    from transformers import Qwen3Config

    from benchmarks.shapes import DECODE_SHAPES, SMOKE_SHAPE
    from wedlm_jax.config import ModelConfig
    fields = SMOKE_SHAPE if shape == "smoke" else DECODE_SHAPES[shape]
    d = ModelConfig(**fields).to_hf_dict()
    d.pop("architectures", None)
    return Qwen3Config(**d, attn_implementation="sdpa")


def build_model(config, device, dtype, seed: int = 0):
    """A Qwen3ForCausalLM of `config` with transformers' own random init, made on `device` in
    `dtype` (no float32 copy first)."""
    import torch
    from transformers import Qwen3ForCausalLM
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def cache_names(model) -> tuple[str, bool]:
    """How this transformers version names a forward's cache argument (`cache` or
    `past_key_values`), and whether the forward takes `cache_position`."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "cache_position" in params


def forward_kwargs(names, cache, start: int, n: int, device) -> dict:
    """The cache arguments of a forward of `n` tokens a row from position `start`."""
    import torch
    pos = torch.arange(start, start + n, device=device)
    kw = {names[0]: cache, "use_cache": True, "position_ids": pos[None, :]}
    if names[1]:
        kw["cache_position"] = pos
    return kw


def decode_step(model, token, cache_kwargs):
    """One AR step of every row: the forward of the pending token and the greedy next one."""
    import torch
    logits = model(token, **cache_kwargs).logits
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True)


class Batch:
    """One batch: its static cache holding the prompts' K/V (prefilled eagerly, the last
    position's logits only), its pending token and position; `run(k)` decodes k steps with
    `step` and returns the wall seconds (the device synchronised before and after) and the
    tokens [rows, k]."""

    def __init__(self, model, step, prompts, max_len: int, device):
        import torch
        from transformers import StaticCache
        self.model, self.step, self.device = model, step, device
        self.names = cache_names(model)
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        with torch.no_grad():
            out = model(prompts, logits_to_keep=1,
                        **forward_kwargs(self.names, self.cache, 0, prompts.shape[1], device))
        self.token = torch.argmax(out.logits[:, -1], dim=-1, keepdim=True)
        self.first, self.pos = self.token.tolist(), prompts.shape[1]

    def sync(self):
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, k: int):
        import torch
        kws = [forward_kwargs(self.names, self.cache, p, 1, self.device)
               for p in range(self.pos, self.pos + k)]
        out = []
        self.sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            for kw in kws:
                torch.compiler.cudagraph_mark_step_begin()
                # the output cloned at once, out of the graph's memory pool: the other batch
                # size's graph (rounds interleave them) may replay over that pool before the
                # next step reads this token
                self.token = self.step(self.model, self.token, kw).clone()
                out.append(self.token)
        self.sync()
        seconds = time.perf_counter() - t0
        self.pos += k
        return seconds, torch.cat(out, dim=1).tolist()


def random_prompts(vocab: int, batch: int, live: int, seed: int, device):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, live), generator=g).to(device)


def greedy_tokens(model, prompts, new: int, step=decode_step) -> list:
    """`new` greedy tokens a row: the prefill's, then `new` - 1 steps (for checks)."""
    b = Batch(model, step, prompts, prompts.shape[1] + new, prompts.device)
    _, rest = b.run(new - 1)
    return [f + r for f, r in zip(b.first, rest)]


def compile_batch(row: dict, r: Batch, steps: int, warm: int) -> None:
    """The compiling call (eager after it, marked, if it fails) and `warm` - 1 more untimed
    (CUDA graphs are recorded on a later call than the first); row 0's first tokens kept."""
    t0 = time.perf_counter()
    first = r.first[0]
    try:
        _, toks = r.run(steps)
    except Exception as e:                            # the compile failed: timed eager, marked
        row["compile_failed"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
        r.step = decode_step
        _, toks = r.run(steps)
    row["compile_s"] = round(time.perf_counter() - t0, 1)
    row["first_tokens"] = first + toks[0][:15]
    for _ in range(warm - 1):
        r.run(steps)


def run(args) -> dict:
    import torch
    import transformers
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    batches = [int(x) for x in args.batches.split(",") if x]
    warm = 3                         # calls before the timed rounds: compile, record, replay
    max_len = args.live + (warm + args.rounds) * args.steps
    report = dict(torch=torch.__version__, transformers=transformers.__version__,
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  cuda=torch.version.cuda, shape=args.shape, dtype=str(dtype).split(".")[-1],
                  live=args.live, steps=args.steps, rounds=args.rounds, max_cache_len=max_len,
                  compile=args.compile, batches={}, stage="build")
    save = lambda: _write(args.out, report)
    save()
    t0 = time.perf_counter()
    model = build_model(hf_config(args.shape), device, dtype)
    report.update(build_s=round(time.perf_counter() - t0, 1),
                  params=sum(p.numel() for p in model.parameters()), stage="compile")
    save()
    step = decode_step if args.compile == "none" else torch.compile(
        decode_step, mode=args.compile, fullgraph=True, dynamic=False)
    runs = {}
    for i, b in enumerate(batches):
        row = report["batches"][str(b)] = dict(batch=b)
        try:
            t0 = time.perf_counter()
            prompts = random_prompts(model.config.vocab_size, b, args.live, i, device)
            runs[b] = Batch(model, step, prompts, max_len, device)
            row["prefill_s"] = round(time.perf_counter() - t0, 2)
            compile_batch(row, runs[b], args.steps, warm)
        except Exception as e:
            row["failed"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            runs.pop(b, None)
        save()
    report["stage"] = "rounds"
    for _ in range(args.rounds):                      # interleaved: every batch each round
        for b, r in runs.items():
            seconds, _ = r.run(args.steps)
            report["batches"][str(b)].setdefault("ms_rounds", []).append(
                round(1e3 * seconds / args.steps, 4))
        save()
    for b in runs:
        row = report["batches"][str(b)]
        row["ms_per_step"] = statistics.median(row["ms_rounds"])
        row["tokens_per_s"] = b * 1e3 / row["ms_per_step"]
    report["stage"] = "done"
    save()
    return report


def _write(path: str, report: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def run_subprocess(out_file: str, timeout_s: float, smoke: bool, batches=(1, 8), live=None,
                   steps: int = 32, rounds: int = 5, mode: str | None = None) -> dict:
    """This module in a process of its own (its own GPU memory, none of JAX's), stopped after
    `timeout_s`; what it wrote to `out_file` (all of it, or up to where it was stopped)."""
    mode = mode or ("none" if smoke else "reduce-overhead")
    cmd = [sys.executable, "-m", "benchmarks.gpu.torch_baseline", "--out", out_file,
           "--batches", ",".join(map(str, batches)), "--steps", str(steps), "--rounds", str(rounds),
           "--compile", mode, "--live", str(live or (32 if smoke else 2048))]
    cmd += ["--smoke"] if smoke else []
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    result = {}
    # a process group of its own: at the time limit the whole group goes (inductor's compile
    # workers too); the same session, so nothing outlives the command that started the run
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, process_group=0)
    try:
        result["returncode"] = proc.wait(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        result["stopped"] = f"time limit {timeout_s:.0f} s"
    try:
        with open(out_file) as f:
            result.update(json.load(f))
    except (OSError, ValueError) as e:
        result["failed"] = f"no report from the torch process ({type(e).__name__})"
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.torch_baseline",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON report (written after every stage)")
    ap.add_argument("--shape", default="8b", help="a shape of benchmarks.shapes.DECODE_SHAPES")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--live", type=int, default=2048, help="prompt tokens a row (live cache rows)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps a timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compile", default="reduce-overhead", choices=MODES)
    ap.add_argument("--smoke", action="store_true", help="the tiny shape on CPU, float32")
    a = ap.parse_args(argv)
    if a.smoke:
        a.shape = "smoke"
    run(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
