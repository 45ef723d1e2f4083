"""The decoding engine: the plan (every static decision, made once), the Decoder over it,
its jitted programs and steps, the state, the page table, the weights' layouts and the
continuous Batcher that runs requests through the Decoder's slots."""
