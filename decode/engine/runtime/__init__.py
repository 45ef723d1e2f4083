"""The host runtime around the compiled programs: the Decoder over its slots (decoder), the
continuous Batcher (batcher), the paged cache's page table (pages), the LoRA adapters served
(adapters), compiling before serving (warm_up) and the host parser's programs (parser_programs)."""
