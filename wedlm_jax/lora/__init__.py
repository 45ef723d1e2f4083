"""Low-rank adapters (LoRA): the adapters' settings and their rules (spec), applied to the model
through qwix (apply: init, combine, fold), many adapters in one batch as a table (table), and PEFT
folders read and written (peft)."""
