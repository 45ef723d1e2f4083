"""Training data: the input pipeline (pipeline: JSONL records tokenized, packed into rows, batched
per host), packed folders and their readers (packed, arrayrecord), mixtures of them (mixture),
and the offline pretokenizer (pretokenize, its inputs in sources, on Ray with ray_pack)."""
