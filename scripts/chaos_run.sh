#!/usr/bin/env bash
# A bounded chaos run (issue 31): random faults of every kind (kill -9, SIGSTOP, segfault, abort,
# Python spin, GIL held, exception) during tiny-MoE training on 2 CPU ranks under
# torchrun --max-restarts, against a fault-free run of the same steps. scripts/chaos_run.py.
#
#   scripts/chaos_run.sh OUT_DIR [--faults 20] [--train-iters 1500] [--seed 0]
#
# About 2 x (train-iters x step time) + faults x (detection + restart); take it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exec "$PY" scripts/chaos_run.py "$@"
