"""The decoding engine: the plan (every static decision, made once), the Decoder over it,
its jitted programs and steps, the state, the page table and the weights' layouts."""
