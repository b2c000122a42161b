#!/usr/bin/env bash
# Pretrain on several machines: run this same command on every node (e.g. with pdsh or your
# scheduler). torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT gathers the nodes and assigns
# node ranks; for SLURM see slurm.sbatch.
#
#   NNODES=8 MASTER_ADDR=node001 NETWORK_INTERFACE=ib0 RECIPE=examples/recipes/paper/1b_mlm_40.yaml \
#       examples/launch/multi_node.sh --data-path /data/fineweb_edu_text_document --save /checkpoints/run1
#   DRY_RUN=1 NNODES=8 RECIPE=... examples/launch/multi_node.sh     # the plan for 8 x GPUS_PER_NODE ranks
#
# Extra arguments go to pretrain_encoder.py. --save must be on storage shared by all nodes; a
# restarted job resumes from its newest complete checkpoint.
#
# Environment (defaults in brackets):
#   RECIPE          recipe YAML [examples/recipes/paper/610m_biphasic_25_75.yaml, from the working
#                   directory]; empty: no --config, the arguments name the recipe
#   NNODES          number of nodes [$SLURM_JOB_NUM_NODES in a SLURM job, else 2]
#   GPUS_PER_NODE   processes per node [in a SLURM job: its GPUs on this node ($SLURM_GPUS_ON_NODE),
#                   or 1 without GPUs; else 8]
#   MASTER_ADDR     host of the rendezvous store, reachable from every node [in a SLURM job: the
#                   first host of $SLURM_JOB_NODELIST; else localhost, refused with NNODES > 1]
#   MASTER_PORT     its TCP port [29500]
#   RDZV_ID         job id shared by the nodes of one run [$SLURM_JOB_ID in a SLURM job, else
#                   encoder-$MASTER_ADDR-$MASTER_PORT]
#   NETWORK_INTERFACE  the interface the nodes talk over, e.g. ib0: sets NCCL_SOCKET_IFNAME and
#                   GLOO_SOCKET_IFNAME, and this node's --local-addr is its address there [unset:
#                   torchrun's default, the host's name]
#   NODE_RANK       optional: set 0 on MASTER_ADDR and >0 elsewhere when MASTER_ADDR does not match
#                   the host's name (e.g. an IP of another interface), so the store host is explicit
#   PYTHON          Python with this project's requirements [python]
#   TORCHRUN        torchrun command ["$PYTHON -m torch.distributed.run"]
#   DRY_RUN         1: run `pretrain_encoder.py --dry-run --world-size $((NNODES * GPUS_PER_NODE))` [0]
# NCCL: see the notes in slurm.sbatch (NCCL_IB_HCA, NCCL_DEBUG).
set -euo pipefail

RECIPE="${RECIPE-examples/recipes/paper/610m_biphasic_25_75.yaml}"
NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-2}}"
PYTHON="${PYTHON:-python}"
# shellcheck source=megatron_ext/launch/scripts/processes_per_node.sh
source "$("$PYTHON" -m megatron_ext.launch script processes_per_node.sh)"
GPUS_PER_NODE="${GPUS_PER_NODE:-$(processes_per_node)}"
if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then  # inside a SLURM allocation: its first node, its job id
    MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
    RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-}}"
fi
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-encoder-$MASTER_ADDR-$MASTER_PORT}"
if (( NNODES > 1 )) && [[ "${DRY_RUN:-0}" != 1 && ( "$MASTER_ADDR" == localhost || "$MASTER_ADDR" == 127.* ) ]]; then
    echo "multi_node.sh: error: MASTER_ADDR=$MASTER_ADDR with NNODES=$NNODES: the other nodes cannot reach it; set MASTER_ADDR to the first node's host name or address" >&2
    exit 2
fi
local_addr=()
if [[ -n "${NETWORK_INTERFACE:-}" ]]; then
    export NCCL_SOCKET_IFNAME="$NETWORK_INTERFACE" GLOO_SOCKET_IFNAME="$NETWORK_INTERFACE"
    local_addr=(--local-addr "$("$PYTHON" -m megatron_ext.launch.slurm_batch address)")
fi
NODE_RANK="${NODE_RANK:-}"
TORCHRUN="${TORCHRUN:-$PYTHON -m torch.distributed.run}"
DRY_RUN="${DRY_RUN:-0}"
config=()
[[ -n "$RECIPE" ]] && config=(--config "$RECIPE")

if [[ "$DRY_RUN" == 1 ]]; then
    exec "$PYTHON" -m megatron_ext.cli.pretrain_encoder "${config[@]}" --dry-run \
        --world-size "$((NNODES * GPUS_PER_NODE))" "$@"
fi

rdzv_conf=()
if [[ -n "$NODE_RANK" ]]; then
    # c10d ignores --node-rank; is_host picks the node that serves the rendezvous store instead.
    rdzv_conf=(--rdzv-conf "is_host=$([[ "$NODE_RANK" == 0 ]] && echo true || echo false)")
fi

# As in Megatron-LM's launch scripts: one hardware work queue keeps tensor-parallel communication
# kernels in issue order, which Megatron-Core's compute/communication overlap relies on.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# torchrun passes SIGTERM (and, with this, SIGUSR1) on to the workers, which stop at a checkpoint
# (exit code 75); it kills them if they take longer than its shutdown timeout (30 s by default).
export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}"
# shellcheck disable=SC2086
exec $TORCHRUN --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID" \
    "${rdzv_conf[@]}" "${local_addr[@]}" \
    --module megatron_ext.cli.pretrain_encoder "${config[@]}" "$@"
