#!/usr/bin/env bash
# Multi-node launch of any of the project's torchrun entry points: run it once on every node.
#   NNODES=4 MASTER_ADDR=node0 scripts/launch_multinode.sh \
#       megatron.training.pretrain_gpt --config examples/deepseek_v2_lite.yaml --data-path ... --save ...
# Under Slurm: srun --nodes=4 --ntasks-per-node=1 scripts/launch_multinode.sh ... (NNODES defaults to
# SLURM_NNODES, MASTER_ADDR to the first host of SLURM_JOB_NODELIST, RDZV_ID to SLURM_JOB_ID;
# scripts/slurm_pretrain.sbatch is an example job).
# The nodes meet at torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT (the node that is MASTER_ADDR
# hosts it) and form one world of NNODES x GPUS_PER_NODE ranks; which node gets which ranks is the
# rendezvous' choice. MAX_RESTARTS > 0: after a rank or a node fails, torchrun restarts every node's
# ranks (a lost node's replacement joins the same rendezvous) and the job resumes from its last
# checkpoint when it loads its --save directory (--load DIR --save DIR).
# Environment: NNODES, GPUS_PER_NODE (8), MASTER_ADDR (127.0.0.1 outside Slurm), MASTER_PORT (29500),
# MAX_RESTARTS (0), RDZV_ID (none outside Slurm), PYTHON (python3: the environment with torch).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 MODULE [ARGS...]   (e.g. megatron.training.pretrain_gpt --config examples/qwen3_30b_a3b.yaml)" >&2
  exit 2
fi
MODULE=$1; shift
NNODES=${NNODES:-${SLURM_NNODES:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-0}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-none}}
# FarSkip's overlapped layers and megatron-core's comm overlaps need more than one CUDA work queue
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-8}
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}
# each rendezvous round's rank 0 starts the ranks' store: with the agents' shared store (torch's
# default) a replacement node never gets the round's MASTER_ADDR (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
exec "${PYTHON:-python3}" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE" \
  --max-restarts="$MAX_RESTARTS" --rdzv-id="$RDZV_ID" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \
  -m "$MODULE" "$@"
