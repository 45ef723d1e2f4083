#!/bin/bash
# wedlm-train on a TPU slice of a GKE cluster, launched with xpk (a JobSet: one pod per TPU VM host,
# every pod the same command; jax.distributed finds the slice from the TPU metadata). The dry run
# first: the step compiled for the slice's topology from config.json alone (needs libtpu:
# `pip install -e '.[tpu]'`), and the workload is created only if it fits.
#
#   CLUSTER=my-gke CONFIG=configs/wedlm_8b_from_qwen3.yaml IMAGE=us-docker.pkg.dev/P/R/wedlm:latest \
#   CKPT=gs://my-bucket/wedlm-8b-cpt [TPU_TYPE=v5p-64 TOPOLOGY=tpu:v5p:2x4x4 DEVICE_MEMORY=95] \
#     train/launch/xpk.sh [key=value ...]
#
# TPU_TYPE is xpk's name of the slice (v5p-64: 32 chips on 8 hosts), TOPOLOGY the same slice for
# the dry run (chips x y z). The image holds this repository installed (`pip install -e .[tpu]`);
# checkpoint.dir must be on gs://. A rerun of the same line resumes from the newest checkpoint.
# One slice: the mesh spans its chips over ICI (several slices over DCN are not set up here).
set -euo pipefail
: "${CLUSTER:?}" "${CONFIG:?}" "${IMAGE:?}" "${CKPT:?set CKPT to a gs:// checkpoint folder}"
TPU_TYPE=${TPU_TYPE:-v5p-64}
# wedlm-train: $WEDLM_TRAIN, else the one on PATH, else this repository's .venv/bin/wedlm-train
repo=$(cd "$(dirname "$0")/../.." && pwd)
train=${WEDLM_TRAIN:-$(command -v wedlm-train || true)}
[ -n "$train" ] || [ ! -x "$repo/.venv/bin/wedlm-train" ] || train=$repo/.venv/bin/wedlm-train
[ -n "$train" ] || { echo "xpk.sh: wedlm-train not found: run make setup (it makes .venv), activate a venv with it installed (pip install -e .), or set WEDLM_TRAIN" >&2; exit 127; }
$train --config "$CONFIG" --dry-run --device-memory "${DEVICE_MEMORY:-95}" \
    --topology "${TOPOLOGY:-tpu:v5p:2x4x4}" "$@" \
    || { echo "xpk.sh: the dry run says no (above); nothing launched" >&2; exit 1; }
${XPK:-xpk} workload create --cluster "$CLUSTER" --workload "${WORKLOAD:-wedlm-train-$(date +%m%d-%H%M)}" \
    --tpu-type "$TPU_TYPE" --num-slices 1 --docker-image "$IMAGE" --max-restarts 3 \
    --command "wedlm-train --config $CONFIG --no-progress distributed=true checkpoint.dir=$CKPT $*"
