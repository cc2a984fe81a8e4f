#!/usr/bin/env bash
# The GPU tier in one command, on a machine with at least one CUDA GPU:
#   scripts/gpu_check.sh                 # table on stdout, JSON in runs/gpu_check.json
#   GPU_CHECK_JSON=out.json scripts/gpu_check.sh -k farskip
# Ends with each skipped check and its reason and a one-line count (from pytest's JUnit XML, written
# beside the JSON as <name>.junit.xml); exits with pytest's status.
# Runs tests/gpu (pytest -m gpu): tiny MoE pretraining on NCCL (world size 1, and 2 ranks on one GPU
# where NCCL allows), BigMac vs fine-grained compute at GPT3-XL sizes, FarSkip overlapped vs simple with
# CUDA-event timing (EP=1, and EP=2 on 2 GPUs), HF conversion parity, a few lm-eval items and the
# server (standard and MLA checkpoints) on the GPU. Installs the `gpu` extra
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
JUNIT=${GPU_CHECK_JSON%.json}.junit.xml
mkdir -p "$(dirname "$JUNIT")"
rm -f "$JUNIT"
rc=0
"$PYTHON" -m pytest -m gpu tests/gpu -p no:cacheprovider -rs -v --junitxml="$JUNIT" "$@" || rc=$?
# every skipped check with its reason, then one line: how many passed, failed and were skipped
"$PYTHON" - "$JUNIT" "$rc" <<'PY' || true
import os, sys
import xml.etree.ElementTree as ET

path, rc = sys.argv[1], int(sys.argv[2])
if not os.path.exists(path):
    print(f"gpu_check: pytest wrote no report ({path}); exit {rc}")
    sys.exit(0)
counts = {"passed": 0, "failed": 0, "skipped": 0}
for case in ET.parse(path).getroot().iter("testcase"):
    name = case.get("name", "?").removeprefix("test_")
    if case.find("skipped") is not None:
        counts["skipped"] += 1
        print(f"gpu_check: skipped {name}: {case.find('skipped').get('message', '')}")
    elif case.find("failure") is not None or case.find("error") is not None:
        counts["failed"] += 1
    else:
        counts["passed"] += 1
print(f"gpu_check: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
      f"(exit {rc}; table and figures in {os.environ['GPU_CHECK_JSON']})")
PY
exit "$rc"
