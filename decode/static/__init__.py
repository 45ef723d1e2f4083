"""A static batch: generate() over a list of prompts, and the per-step trace of one."""
