"""Tiny, self-made training inputs for tests, demos and benchmarks (no downloads): a word-level BPE
tokenizer trained on the spot, JSONL files in the three formats, and a config file.

    paths = make_tiny_setup(tmp_dir)            # tokenizer folder + train.jsonl + sft.jsonl
    write_config(path, paths, steps=6, ...)     # a YAML config for wedlm-train
"""

from __future__ import annotations

import json
import os

import numpy as np
import yaml

SPECIALS = ["<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>", "<unk>"]
WORDS = ("the cat dog bird sat ran flew on under over a mat log tree red blue green big small "
         "and then it was happy sad one two three four five six seven eight nine ten").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def sentences(n: int, seed: int = 0, min_words: int = 4, max_words: int = 14) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(min_words, max_words + 1)))
            for _ in range(n)]


def train_tokenizer(folder: str, vocab_size: int = 96, mask_token: bool = True,
                    chat_template: bool = True) -> str:
    """A BPE tokenizer over WORDS with whitespace pre-tokenization; writes tokenizer.json and
    tokenizer_config.json (eos <|endoftext|>, optional chat template) into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    os.makedirs(folder, exist_ok=True)
    specials = [s for s in SPECIALS if mask_token or s != "<|mask|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  show_progress=False)
    tok.train_from_iterator(sentences(400, seed=123) + ["user\nassistant\nsystem\n"], trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    cfg = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    if chat_template:
        cfg["chat_template"] = CHAT_TEMPLATE
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def write_jsonl(path: str, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def make_tiny_setup(root: str, num_docs: int = 64, seed: int = 0, mask_token: bool = True) -> dict:
    """Tokenizer folder, a pretraining JSONL and an SFT JSONL (both SFT formats) under `root`."""
    tok = train_tokenizer(os.path.join(root, "tokenizer"), mask_token=mask_token)
    train = write_jsonl(os.path.join(root, "train.jsonl"),
                        [{"text": s} for s in sentences(num_docs, seed)])
    qa = sentences(2 * num_docs, seed + 1)
    sft = []
    for i in range(num_docs):
        if i % 2:
            sft.append({"prompt": qa[2 * i], "response": qa[2 * i + 1]})
        else:
            sft.append({"messages": [{"role": "user", "content": qa[2 * i]},
                                     {"role": "assistant", "content": qa[2 * i + 1]}]})
    sft_path = write_jsonl(os.path.join(root, "sft.jsonl"), sft)
    return {"tokenizer": tok, "train": train, "sft": sft_path, "root": root}


TINY_MODEL = {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
              "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "qk_norm": True,
              "max_position_embeddings": 256}


def tiny_config_dict(paths: dict, **overrides) -> dict:
    """A from-scratch config dict over the tiny setup; `overrides` as {'section.key': value}."""
    d = {
        "model": {"config": dict(TINY_MODEL)},
        "data": {"train_files": [paths["train"]], "tokenizer": paths["tokenizer"], "seq_len": 32,
                 "global_batch_size": 8, "shuffle_seed": 0},
        "objective": {"kind": "dual_stream", "block_size": 8, "ar_weight": 1.0},
        "optimizer": {"lr": 3e-3, "final_lr": 3e-4, "warmup_steps": 2, "weight_decay": 0.01,
                      "clip": 1.0, "grad_accum": 1},
        "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
        "steps": 6, "seed": 0, "compute_dtype": "f32", "log_every": 1, "progress": False,
    }
    for key, value in overrides.items():
        cur = d
        parts = key.split(".")
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = value
    return d


def write_config(path: str, config: dict) -> str:
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path


if __name__ == "__main__":  # python -m tests.synthetic.train_data data/tiny  (inputs for configs/tiny_cpu.yaml)
    import sys
    out = sys.argv[1] if len(sys.argv) > 1 else "data/tiny"
    os.makedirs(out, exist_ok=True)
    p = make_tiny_setup(out, num_docs=256)
    print(f"wrote {p['tokenizer']}/tokenizer.json, {p['train']} and {p['sft']}")
