# Sourced by the launch scripts: processes per node when GPUS_PER_NODE is not set.
# shellcheck shell=bash

# The GPUs SLURM gave this node (--gpus-per-node=a100:8 -> 8); 1 in a job without GPUs (a CPU
# partition); 8 outside SLURM (one 8-GPU node, the scripts' defaults).
processes_per_node() {
    local gpus="${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}"
    gpus="${gpus##*:}"
    if [[ "$gpus" =~ ^[1-9][0-9]*$ ]]; then
        echo "$gpus"
    elif [[ -n "${SLURM_JOB_ID:-}" ]]; then
        echo 1
    else
        echo 8
    fi
}
