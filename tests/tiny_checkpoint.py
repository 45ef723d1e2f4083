"""A tiny Hugging Face checkpoint folder for the serving and batch-job tests: a random 2-layer model
(the synthetic package), a byte-level BPE tokenizer trained here, a chat template and generation eos ids."""

from __future__ import annotations

import json
import os

from tests.synthetic import random_params, tiny_bpe_tokenizer
from wedlm_jax.config import ModelConfig

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["one two three four five six seven eight nine ten", "the cat sat on the mat",
          "count with me: one, two, three", "hello world, hello there"] * 5


def make_checkpoint(folder) -> tuple[str, ModelConfig, dict]:
    """(folder path, config, params) of a tiny WeDLM checkpoint with tokenizer files."""
    from wedlm_jax.checkpoints import save_hf_checkpoint
    tok = tiny_bpe_tokenizer(CORPUS, SPECIALS)
    assert tok.get_vocab_size() <= 127
    config = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                         mask_token_id=127, eos_token_id=tok.token_to_id("<|endoftext|>"))
    params = random_params(config, seed=2, head_scale=20.0)  # its greedy text hits the tests' stops
    path = save_hf_checkpoint(config, params, os.path.join(os.fspath(folder), "model"), progress=False)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT, "eos_token": "<|im_end|>", "bos_token": None}, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tok.token_to_id("<|endoftext|>")]}, f)
    return path, config, params
