#!/usr/bin/env bash
# Pretrain on one machine with all its GPUs (torchrun, one process per GPU).
#
#   RECIPE=examples/recipes/paper/610m_biphasic_25_75.yaml examples/launch/single_node.sh \
#       --data-path /data/fineweb_edu_text_document --save /checkpoints/run1
#   DRY_RUN=1 RECIPE=... examples/launch/single_node.sh        # validate and print the plan only
#
# Extra arguments go to pretrain_encoder.py (Megatron-style flags override the recipe).
# Rerunning the same command resumes from the newest complete checkpoint in --save.
#
# Environment (defaults in brackets):
#   RECIPE          recipe YAML [examples/recipes/paper/610m_biphasic_25_75.yaml, from the working
#                   directory]; empty: no --config, the arguments name the recipe
#   GPUS_PER_NODE   processes to start [in a SLURM job: its GPUs on this node ($SLURM_GPUS_ON_NODE),
#                   or 1 without GPUs; else 8]
#   PYTHON          Python with this project's requirements [python]
#   TORCHRUN        torchrun command ["$PYTHON -m torch.distributed.run"]
#   DRY_RUN         1: run `pretrain_encoder.py --dry-run --world-size $GPUS_PER_NODE` without torchrun [0]
set -euo pipefail

RECIPE="${RECIPE-examples/recipes/paper/610m_biphasic_25_75.yaml}"
PYTHON="${PYTHON:-python}"
# shellcheck source=megatron_ext/launch/scripts/processes_per_node.sh
source "$("$PYTHON" -m megatron_ext.launch script processes_per_node.sh)"
GPUS_PER_NODE="${GPUS_PER_NODE:-$(processes_per_node)}"
TORCHRUN="${TORCHRUN:-$PYTHON -m torch.distributed.run}"
DRY_RUN="${DRY_RUN:-0}"
config=()
[[ -n "$RECIPE" ]] && config=(--config "$RECIPE")

if [[ "$DRY_RUN" == 1 ]]; then
    exec "$PYTHON" -m megatron_ext.cli.pretrain_encoder "${config[@]}" --dry-run --world-size "$GPUS_PER_NODE" "$@"
fi

# As in Megatron-LM's launch scripts: one hardware work queue keeps tensor-parallel communication
# kernels in issue order, which Megatron-Core's compute/communication overlap relies on.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# torchrun passes SIGTERM (and, with this, SIGUSR1) on to the workers, which stop at a checkpoint
# (exit code 75); it kills them if they take longer than its shutdown timeout (30 s by default).
export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}"
# $TORCHRUN is split on purpose: it may be a command with arguments.
# shellcheck disable=SC2086
exec $TORCHRUN --standalone --nproc-per-node "$GPUS_PER_NODE" \
    --module megatron_ext.cli.pretrain_encoder "${config[@]}" "$@"
