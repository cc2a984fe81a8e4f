#!/usr/bin/env bash
# Sem-MoE per domain on one checkpoint (docs/results/semmoe.md, "LAR per domain"):
# prompts from six domains of ../shared/data (ShareGPT chat, MMLU exams, MBPP code, BoolQ Wikipedia
# passages, LAMBADA fiction, ARC science questions), each capped and split 20 / 80; the router profiled
# on every part; placements solved on the mixed 20% at every EP size; their LAR and imbalance
# predicted on the mixed 80% per domain, served together (`evaluate --split-ids 1`); in-domain tables
# (solved on one domain, evaluated on its own held-out part); the paper's Table 1 and the
# domain-expert mutual information (`stats`); and the LAR measured in real forwards (`lar`) on a
# sample of the held-out mix, beside the prediction: attention-DP with Algorithm 2 on LAR_EP
# processes, attention-TP with Algorithm 3 on LAR_TP_EP (TP = EP; every tensor-parallel width of the
# model must divide by it: the DeepSeek-V2-Lite layout's dense 684-wide SwiGLU allows 2 only).
#
#   CKPT=runs/corpus_dsv2lite_routing scripts/semmoe_domains.sh runs/semmoe_dsv2
#
# Environment: CKPT (a trained checkpoint), EPS (solver EP sizes, default 2,4,8,16,32,64), LAR_EP
# (attention-DP forwards, default 8; 0 skips them), LAR_TP_EP (attention-TP forwards, default 2; 0
# skips them), LAR_SAMPLE (every n-th held-out request for the forwards,
# default 16), MAX_REQUESTS (per domain, default 3000), PY (default .venv/bin/python). Steps whose
# output exists are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/semmoe_domains.sh OUT_DIR}
CKPT=${CKPT:?set CKPT to a trained checkpoint directory}
EPS=${EPS:-2,4,8,16,32,64}
LAR_EP=${LAR_EP:-8}
LAR_TP_EP=${LAR_TP_EP:-2}
LAR_SAMPLE=${LAR_SAMPLE:-16}
MAX_REQUESTS=${MAX_REQUESTS:-3000}
PY=${PY:-.venv/bin/python}
DOMAINS=(sharegpt mmlu mbpp boolq lambada arc)
S="$PY -m tools.semmoe"
P=$OUT/prompts
mkdir -p "$OUT/tables"

[ -f "$P/mix_eval.jsonl" ] || $PY scripts/semmoe_prompts.py --out-dir "$P" --max-requests "$MAX_REQUESTS" \
  --datasets "$(IFS=,; echo "${DOMAINS[*]}")" --mix mix
# each domain's profiling part (for its in-domain tables), the mixed profiling part and the mixed held-out part
for name in "${DOMAINS[@]/%/_profile}" mix_profile mix_eval; do
  [ -f "$OUT/$name.npz" ] || $S profile --load "$CKPT" --data "$P/$name.jsonl" --out "$OUT/$name.npz" \
    --batch-tokens 4096 --expert-model-parallel-size 2 --nproc 2
done
for ep in ${EPS//,/ }; do
  for m in contiguous eplb semmoe; do
    [ -d "$OUT/tables/ep${ep}_mix_$m" ] || $S solve --profile "$OUT/mix_profile.npz" --ep "$ep" --method "$m" \
      --seed 0 --out "$OUT/tables/ep${ep}_mix_$m"
  done
  [ -f "$OUT/eval_ep$ep.json" ] || $S evaluate --tables "$OUT"/tables/ep${ep}_mix_{contiguous,eplb,semmoe} \
    --profile "$OUT/mix_eval.npz" --mode both --split-ids 1 --out "$OUT/eval_ep$ep.json"
done
# in-domain: each domain's own tables at EP = 8, on its held-out requests inside the mix
IN_EP=8
for d in "${DOMAINS[@]}"; do
  [ -d "$OUT/tables/ep${IN_EP}_${d}_semmoe" ] || $S solve --profile "$OUT/${d}_profile.npz" --ep "$IN_EP" \
    --method semmoe --seed 0 --out "$OUT/tables/ep${IN_EP}_${d}_semmoe"
  [ -f "$OUT/eval_ep${IN_EP}_in_$d.json" ] || $S evaluate --tables "$OUT/tables/ep${IN_EP}_${d}_semmoe" \
    --profile "$OUT/mix_eval.npz" --mode both --split-ids 1 --out "$OUT/eval_ep${IN_EP}_in_$d.json"
done
[ -f "$OUT/stats.json" ] || $S stats --profile "mix=$OUT/mix_eval.npz" --split-ids 1 --json "$OUT/stats.json"
measure() {  # measure <ep> <mode>: the LAR of the semmoe tables (placed) and contiguous (unplaced) in real forwards
  local ep=$1 mode=$2
  [ -d "$OUT/placed$ep" ] || $S apply --load "$CKPT" --tables "$OUT/tables/ep${ep}_mix_semmoe" --out "$OUT/placed$ep"
  [ -f "$OUT/lar_ep${ep}_semmoe_$mode.json" ] || $S lar --load "$OUT/placed$ep" \
    --tables "$OUT/tables/ep${ep}_mix_semmoe" --data "$P/mix_sample.jsonl" --profile "$OUT/mix_eval.npz" \
    --mode "$mode" --batch-tokens 4096 --out "$OUT/lar_ep${ep}_semmoe_$mode.json"
  [ -f "$OUT/lar_ep${ep}_contiguous_$mode.json" ] || $S lar --load "$CKPT" \
    --tables "$OUT/tables/ep${ep}_mix_contiguous" --data "$P/mix_sample.jsonl" --profile "$OUT/mix_eval.npz" \
    --mode "$mode" --batch-tokens 4096 --out "$OUT/lar_ep${ep}_contiguous_$mode.json"
}
[ -f "$P/mix_sample.jsonl" ] || awk "NR % $LAR_SAMPLE == 1" "$P/mix_eval.jsonl" > "$P/mix_sample.jsonl"
[ "$LAR_EP" -gt 0 ] && measure "$LAR_EP" dp
[ "$LAR_TP_EP" -gt 0 ] && measure "$LAR_TP_EP" tp
echo "semmoe_domains.sh: results in $OUT"
