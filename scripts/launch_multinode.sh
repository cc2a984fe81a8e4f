#!/usr/bin/env bash
# Multi-node launch of any of the project's torchrun entry points (run on every node).
#   NNODES=4 NODE_RANK=$SLURM_NODEID MASTER_ADDR=node0 scripts/launch_multinode.sh \
#       megatron.training.pretrain_gpt --config examples/deepseek_v2_lite.yaml --data-path ... --save ...
# Under SLURM: srun --nodes=4 --ntasks-per-node=1 scripts/launch_multinode.sh ... (NODE_RANK and
# MASTER_ADDR default from SLURM_NODEID and the first host of SLURM_JOB_NODELIST).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 MODULE [ARGS...]   (e.g. megatron.training.pretrain_gpt --config examples/qwen3_30b_a3b.yaml)" >&2
  exit 2
fi
MODULE=$1; shift
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
# FarSkip's overlapped layers and megatron-core's comm overlaps need more than one CUDA work queue
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-8}
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}
exec torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$GPUS_PER_NODE" \
  --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" -m "$MODULE" "$@"
