#!/bin/bash
# One task of the Slurm job: srun starts it once per node (or once per GPU). wedlm-train's
# `distributed=true` lets jax.distributed find the job from Slurm's variables: SLURM_JOB_ID (the
# coordinator's port), SLURM_STEP_NODELIST (its host: the first node), SLURM_NTASKS, SLURM_PROCID
# and SLURM_LOCALID (with one task per GPU: the GPU this task drives).
#
#   CONFIG=configs/wedlm_8b_from_qwen3.yaml train/launch/slurm_task.sh [key=value ...]
set -euo pipefail
: "${CONFIG:?set CONFIG to the training config (YAML)}"
exec ${WEDLM_TRAIN:-wedlm-train} --config "$CONFIG" --no-progress distributed=true "$@"
