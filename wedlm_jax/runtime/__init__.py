"""Process-level helpers of the commands, not model code: the JAX backends a process starts
(platforms), several processes as one job (distributed), the persistent compile cache
(compile_cache), failures told in one line (failures), compile-only targets (targets), what a
compiled program says about itself (compiled) and Ctrl-C (interrupts)."""
