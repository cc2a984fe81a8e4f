#!/usr/bin/env bash
# Sem-MoE in the server, end to end: profile a checkpoint's routing on ShareGPT's profiling split,
# solve EPLB-style, affinity-aware EPLB and Sem-MoE placements for EP ranks, predict their LAR on
# the held-out split, then serve the held-out prompts with bench_serve.py: standard (contiguous,
# round-robin), eplb and affinity-eplb (placed, round-robin) and semmoe (placed, Algorithm 2
# request scheduling; with TP = EP, attention tensor-parallel with Algorithm 3 token re-batching,
# the EPLB baselines on contiguous slices). docs/guides/semmoe.md; figures: docs/results/semmoe.md.
#
#   sudo CKPT=runs/corpus_moe8_cpu EP=2 scripts/semmoe_serving.sh runs/semmoe_serve
#   sudo CKPT=runs/corpus_moe8_cpu EP=2 TP=2 scripts/semmoe_serving.sh runs/semmoe_serve_tp
#   sudo CKPT=runs/corpus_moe8_cpu EP=2 VARIANTS=standard,eplb,affinity-eplb,semmoe scripts/semmoe_serving.sh runs/semmoe_serve_aff
#
# Environment: CKPT (a trained checkpoint), EP (ranks, default 2), TP (attention tensor
# parallelism: 1, or EP for Algorithm 3 on the same ranks; default 1), RATES (default 2,4,8),
# NUM_REQUESTS (per rate, default 32), FRACTION (target all-to-all share, default 0.4),
# OUTPUT_LEN (default 32), SLO_TTFT / SLO_TPOT (goodput SLO, seconds; default 1.0 / 0.2),
# VARIANTS (default standard,eplb,semmoe), LINK_GBIT (a fixed link rate instead of the search for
# FRACTION), RUNS (measured runs, rotated; default 3), TIMEOUT_S (bench_serve's wall-clock limit,
# default 14400), RESUME (1: reuse the runs a cut-off invocation finished in OUT/work; needs LINK_GBIT),
# PY (default .venv/bin/python). Steps whose output exists are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/semmoe_serving.sh OUT_DIR}
CKPT=${CKPT:?set CKPT to a trained checkpoint directory}
EP=${EP:-2}
TP=${TP:-1}
RATES=${RATES:-2,4,8}
NUM_REQUESTS=${NUM_REQUESTS:-32}
FRACTION=${FRACTION:-0.4}
OUTPUT_LEN=${OUTPUT_LEN:-32}
SLO_TTFT=${SLO_TTFT:-1.0}
SLO_TPOT=${SLO_TPOT:-0.2}
VARIANTS=${VARIANTS:-standard,eplb,semmoe}
RUNS=${RUNS:-3}
TIMEOUT_S=${TIMEOUT_S:-14400}
RESUME_ARG=()
[ "${RESUME:-0}" = 0 ] || RESUME_ARG=(--resume)
LINK=(--target-comm-fraction "$FRACTION")
[ -z "${LINK_GBIT:-}" ] || LINK=(--link-gbit "$LINK_GBIT")
PY=${PY:-.venv/bin/python}
PROMPTS=data/semmoe_prompts
mkdir -p "$OUT/tables"

[ -f "$PROMPTS/sharegpt_eval.jsonl" ] || \
  $PY scripts/semmoe_prompts.py --data-dir ../shared/data/prompts --out-dir "$PROMPTS" --datasets sharegpt
for part in profile eval; do
  [ -f "$OUT/sharegpt_$part.npz" ] || $PY -m tools.semmoe profile --load "$CKPT" \
    --data "$PROMPTS/sharegpt_$part.jsonl" --out "$OUT/sharegpt_$part.npz" --batch-tokens 4096
done
for m in contiguous eplb affinity-eplb semmoe; do
  [ -d "$OUT/tables/$m" ] || $PY -m tools.semmoe solve --profile "$OUT/sharegpt_profile.npz" --ep "$EP" \
    --method "$m" --out "$OUT/tables/$m"
done
[ -f "$OUT/evaluation.json" ] || $PY -m tools.semmoe evaluate --tables "$OUT/tables/contiguous" \
  "$OUT/tables/eplb" "$OUT/tables/affinity-eplb" "$OUT/tables/semmoe" --profile "$OUT/sharegpt_eval.npz" --mode both \
  --out "$OUT/evaluation.json"
$PY scripts/bench_serve.py --load "$CKPT" --semmoe-tables "$OUT/tables" --variants "$VARIANTS" \
  --ranks "$EP" --tensor-model-parallel-size "$TP" --expert-model-parallel-size "$EP" --prompts "$PROMPTS/sharegpt_eval.jsonl" --output-len "$OUTPUT_LEN" \
  "${LINK[@]}" --request-rates "$RATES" --num-requests "$NUM_REQUESTS" \
  --slo-ttft "$SLO_TTFT" --slo-tpot "$SLO_TPOT" --runs "$RUNS" --timeout-s "$TIMEOUT_S" "${RESUME_ARG[@]}" \
  --work-dir "$OUT/work" --json "$OUT/serve.json"
