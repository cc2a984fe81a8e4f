#!/usr/bin/env bash
# The GPU tier in one command, on a machine with at least one CUDA GPU:
#   scripts/gpu_check.sh                 # table on stdout, JSON in runs/gpu_check.json
#   GPU_CHECK_JSON=out.json scripts/gpu_check.sh -k farskip
# Runs tests/gpu (pytest -m gpu): tiny MoE pretraining on NCCL (world size 1, and 2 ranks on one GPU
# where NCCL allows), BigMac vs fine-grained compute at GPT3-XL sizes, FarSkip overlapped vs simple with
# CUDA-event timing, HF conversion parity and a few lm-eval items on the GPU. Installs the `gpu` extra
# (Transformer Engine) first when it is missing, unless GPU_CHECK_INSTALL=0 (offline machines); without
# it every check runs on megatron-core's local spec, and the table says which spec ran.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); nothing to run" >&2
    exit 2
fi
if [ "${GPU_CHECK_INSTALL:-1}" = 1 ] && ! "$PYTHON" -c 'import transformer_engine' 2>/dev/null; then
    echo "gpu_check: installing the gpu extra (Transformer Engine)"
    "$PYTHON" -m pip install -e ".[gpu]" \
        || echo "gpu_check: the gpu extra did not install; the checks run on the local spec"
fi
export GPU_CHECK_JSON=${GPU_CHECK_JSON:-runs/gpu_check.json}
exec "$PYTHON" -m pytest -m gpu tests/gpu -p no:cacheprovider -rs -v "$@"
