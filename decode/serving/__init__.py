"""The continuous-batching doors: wedlm-serve (the OpenAI-compatible server: serve, app,
completions, protocol, scoring, the worker thread) and the batch job (--input), both
on the Batcher (batching.py)."""
