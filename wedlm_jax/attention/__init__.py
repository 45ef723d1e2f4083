"""Attention, one rule and its implementations.

    core      the reference: grouped-query attention over an explicit boolean mask, the masks of
              the model's entry points (segments, explicit, cache mode's `cache_last_key`) and
              the KV-cache write
    tiled     tile-skipping attention for the training layouts (dual stream, causal, packed)
    cache     cache mode: the new slots of a decoding forward against a dense KV cache (dense,
              tiled, the Triton kernel, cuDNN)
    paged     cache mode over a paged KV cache (the XLA gather path, the Triton paged kernel,
              jax's ragged TPU kernel) and the platform's default page size
    backends  which implementation runs where (`resolve`), and the splash / cuDNN training paths
"""
