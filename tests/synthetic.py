"""Re-export: the shared synthetic weights and tokenizer live in the top-level `synthetic` package."""
from synthetic import random_params, tiny_bpe_tokenizer  # noqa: F401
