"""The offline doors: the batch job (`--input`: batch_job, its lines read and checked by lines)
and the same job on a Ray cluster (`--ray`: ray_job, its output folder of parts part_folder),
on the engine's Batcher."""
