#!/bin/bash
# One task of the Slurm job: srun starts it once per node (or once per GPU). wedlm-train's
# `distributed=true` lets jax.distributed find the job from Slurm's variables: SLURM_JOB_ID (the
# coordinator's port), SLURM_STEP_NODELIST (its host: the first node), SLURM_NTASKS, SLURM_PROCID
# and SLURM_LOCALID (with one task per GPU: the GPU this task drives).
#
#   CONFIG=configs/wedlm_8b_from_qwen3.yaml train/launch/slurm_task.sh [key=value ...]
set -euo pipefail
: "${CONFIG:?set CONFIG to the training config (YAML)}"
if [ -z "${SLURM_JOB_ID:-}" ] || [ -z "${SLURM_PROCID:-}" ]; then
    echo "slurm_task.sh: not inside a Slurm job step (no SLURM_JOB_ID / SLURM_PROCID): submit train/launch/slurm.sbatch with sbatch (or train/launch/submit_slurm.sh), or run wedlm-train itself" >&2
    exit 2
fi
# wedlm-train: $WEDLM_TRAIN, else the one on PATH, else this repository's .venv/bin/wedlm-train
repo=$(cd "$(dirname "$0")/../.." && pwd)
train=${WEDLM_TRAIN:-$(command -v wedlm-train || true)}
[ -n "$train" ] || [ ! -x "$repo/.venv/bin/wedlm-train" ] || train=$repo/.venv/bin/wedlm-train
[ -n "$train" ] || { echo "slurm_task.sh: wedlm-train not found: run make setup (it makes .venv), activate a venv with it installed (pip install -e .), or set WEDLM_TRAIN" >&2; exit 127; }
exec $train --config "$CONFIG" --no-progress distributed=true "$@"
