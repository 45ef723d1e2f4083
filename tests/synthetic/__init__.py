"""Self-made inputs that tests and benchmarks share (no trained model, no downloads); not part of
the installed packages (pyproject.toml installs wedlm_jax, train, decode, demo), imported from the
checkout root:

    random_params(config, ...)          synthetic weights for any ModelConfig (wedlm_jax.model's)
    tiny_bpe_tokenizer(corpus, ...)     a byte-level BPE tokenizer trained on a few strings (below)
    synthetic.hf                        tiny random Hugging Face models (torch + transformers: the
                                        `test` extra, imported inside its functions only)
    synthetic.train_data                tiny tokenizer + JSONL training inputs and configs
                                        (python -m tests.synthetic.train_data data/tiny)
"""

from __future__ import annotations

from wedlm_jax.model import random_params  # noqa: F401 (the library's, used here by name)


def tiny_bpe_tokenizer(corpus, special_tokens, vocab_size: int = 120):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus` (a few strings), offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size,
                                                        special_tokens=list(special_tokens),
                                                        show_progress=False))
    return tok
