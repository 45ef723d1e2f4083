#!/bin/bash
# The dry run (does one step fit a GPU's memory on this mesh and batch?), then sbatch, only if it fits.
#
#   CONFIG=configs/wedlm_8b_from_qwen3.yaml [DEVICE_MEMORY=80] [DRY_RUN="--topology h100:8"] \
#     train/launch/submit_slurm.sh [key=value ...]
#
# DRY_RUN: how the step is compiled for the check: a GPU topology jax describes without the
# hardware (h100:8, one node's GPUs; needs jax's CUDA plugin, `make gpu-compiler` for a
# compile-only one), or "--devices N" (CPU devices: XLA CPU's accounting of the same program).
# With the mesh's data axis at -1 the dry run counts one node's data replicas, each with a larger
# share of the batch than on the whole cluster: its verdict errs on the safe side.
set -euo pipefail
: "${CONFIG:?set CONFIG to the training config (YAML)}"
here=$(dirname "$0")
# wedlm-train: $WEDLM_TRAIN, else the one on PATH, else this repository's .venv/bin/wedlm-train
repo=$(cd "$(dirname "$0")/../.." && pwd)
train=${WEDLM_TRAIN:-$(command -v wedlm-train || true)}
[ -n "$train" ] || [ ! -x "$repo/.venv/bin/wedlm-train" ] || train=$repo/.venv/bin/wedlm-train
[ -n "$train" ] || { echo "submit_slurm: wedlm-train not found: run make setup (it makes .venv), activate a venv with it installed (pip install -e .), or set WEDLM_TRAIN" >&2; exit 127; }
$train --config "$CONFIG" --dry-run --device-memory "${DEVICE_MEMORY:-80}" \
    ${DRY_RUN:---topology h100:8} "$@" || { echo "submit_slurm: the dry run says no (above); nothing submitted" >&2; exit 1; }
CONFIG="$CONFIG" ${SBATCH:-sbatch} --export=ALL "$here/slurm.sbatch" "$@"
