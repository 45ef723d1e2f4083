"""Re-export: the tiny Hugging Face models live in `synthetic.hf` (shared with benchmarks)."""
from synthetic.hf import ROPE, hf_logits, make_hf_model  # noqa: F401
