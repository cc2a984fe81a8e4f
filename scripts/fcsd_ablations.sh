#!/usr/bin/env bash
# FarSkip-Collective's Table 2 ablations and Fig. 3 sweep at the scale of scripts/fcsd_demo.sh (docs/fcsd.md):
#
#   scripts/fcsd_ablations.sh [SHARED_DATA_DIR] [RUNS_DIR]
#
# 1. data and a teacher with the demonstration's shared steps (scripts/fcsd_lib.sh):
#    examples/corpus_moe_cpu.yaml with --num-layers LAYERS (default 8: 50% and 75% of the layers
#    are whole, 90% rounds to 7 = 87.5%; LAYERS=20 makes all three whole at 2.5x the cost);
# 2. Table 2 (students, examples/fcsd_tiny_cpu.yaml, STEPS steps each on the DATA corpus):
#    KL on the last 50/75/90% and on all layers, KL + intermediate L2 (one run per coefficient in
#    L2_COEFFS), SFT, KL with frozen embeddings and output layer, KL at 0.25x and 4x the batch
#    (same number of steps, as the paper);
# 3. Fig. 3: the teacher converted without training on its first N and on its last N layers,
#    N = 1 .. LAYERS-1, and on all;
# 4. held-out reports on WikiText-2 test (perplexity, KL to the teacher, MAX_WINDOWS windows):
#    RUNS_DIR/fcsd_ablations_report.json and RUNS_DIR/fcsd_fig3.json, and the tables with the
#    paper's rows beside ours: RUNS_DIR/fcsd_ablations.md (python -m distill.ablation_table).
# Finished steps are skipped (a run with a summary, a report that exists): rerun to resume.
# Environment: PYTHON, TORCHRUN (default: .venv's), NPROC (2), LAYERS (8), TEACHER
# (RUNS_DIR/corpus_moe<LAYERS>_cpu), TEACHER_ITERS (the config's 1500), DATA (mix: pretrain |
# sharegpt | mix), STEPS (300),
# L2_COEFFS ("0.1 1"), MAX_WINDOWS (300), DRY_RUN=1 (print the commands only).
set -euo pipefail

SHARED=${1:-../shared/data}
RUNS=${2:-runs}
PYTHON=${PYTHON:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
NPROC=${NPROC:-2}
LAYERS=${LAYERS:-8}
DATA=${DATA:-mix}
STEPS=${STEPS:-300}
L2_COEFFS=${L2_COEFFS:-0.1 1}
MAX_WINDOWS=${MAX_WINDOWS:-300}
BATCH=16  # examples/fcsd_tiny_cpu.yaml: 16 sequences of 128 tokens per step, micro-batch 8
MICRO=8
source "$(dirname "${BASH_SOURCE[0]}")/fcsd_lib.sh"
PROG=fcsd_ablations.sh

# every setting is checked before hours of training
fcsd_check_positive $PROG STEPS "$STEPS"
fcsd_check_positive $PROG LAYERS "$LAYERS"
fcsd_check_positive $PROG NPROC "$NPROC"
fcsd_check_positive $PROG MAX_WINDOWS "$MAX_WINDOWS"
TEACHER_ITERS=${TEACHER_ITERS:-1500}
fcsd_check_positive $PROG TEACHER_ITERS "$TEACHER_ITERS"
((LAYERS >= 2)) || { echo "$PROG: error: LAYERS must be at least 2 (first-N vs last-N), got $LAYERS" >&2; exit 2; }
fcsd_data_flags "$DATA" || { echo "$PROG: error: unknown distillation corpus DATA='$DATA' (pretrain, sharegpt, mix)" >&2; exit 2; }
for c in $L2_COEFFS; do
    [[ $c =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] || { echo "$PROG: error: L2_COEFFS has '$c', not a non-negative number" >&2; exit 2; }
done
QUARTER=$((BATCH / 4))
((QUARTER % NPROC == 0)) || { echo "$PROG: error: 0.25x batch ($QUARTER sequences) does not split over NPROC=$NPROC ranks" >&2; exit 2; }

last_n() {  # last_n PERCENT: the number of last layers that is PERCENT of LAYERS, rounded half up (>= 1)
    local n=$(((LAYERS * $1 + 50) / 100))
    ((n >= 1)) || n=1
    echo "$n"
}

fcsd_prepare_data "$SHARED"
TEACHER=${TEACHER:-$RUNS/corpus_moe${LAYERS}_cpu}
fcsd_teacher "$TEACHER" --num-layers "$LAYERS" --train-iters "$TEACHER_ITERS"

students=()
student() {  # student LABEL NAME FLAGS...: one FCSD run into RUNS/fcsd_abl_<DATA>_<NAME>, scored as LABEL
    local label=$1 name=$2
    shift 2
    local out=$RUNS/fcsd_abl_${DATA}_$name
    finished "$out" || run "$TORCHRUN" --standalone --nproc_per_node="$NPROC" -m distill.fcsd \
        --config examples/fcsd_tiny_cpu.yaml --load "$TEACHER" --save "$out" --train-iters "$STEPS" \
        "${data_flags[@]}" "$@"
    students+=(--student "$label=$out/best")
}

for pct in 50 75 90; do
    n=$(last_n $pct)
    student "KL (FAR $pct%) [last:$n of $LAYERS]" "kl_last$n" --kd-loss kl --farskip "last:$n"
done
student "KL (FAR 100%) [all $LAYERS]" kl_all --kd-loss kl --farskip all
for c in $L2_COEFFS; do
    student "KL + INTER. L2 [all, coefficient $c]" "kll2_${c}_all" --kd-loss kl+l2 --kd-l2-coeff "$c" --farskip all
done
student "SFT [all]" sft_all --kd-loss sft --farskip all
student "KL * EMBED. [all, embeddings and output layer frozen]" kl_frozen_all --kd-loss kl --farskip all \
    --freeze-embeddings
student "KL 0.25x BS [all, $QUARTER sequences per step]" kl_bs0.25_all --kd-loss kl --farskip all \
    --global-batch-size "$QUARTER" --micro-batch-size $((QUARTER / NPROC))
student "KL 4x BS [all, $((BATCH * 4)) sequences per step]" kl_bs4_all --kd-loss kl --farskip all \
    --global-batch-size $((BATCH * 4)) --micro-batch-size "$MICRO"

TEXT=$SHARED/pretrain/wikitext-2/test.txt
report=$RUNS/fcsd_ablations_report.json
[[ -f $report ]] || run "$PYTHON" -m distill.report --teacher "$TEACHER" --text "$TEXT" --out "$report" \
    --untrained all "${students[@]}" --max-windows "$MAX_WINDOWS"

fig3=()
for ((n = 1; n < LAYERS; n++)); do
    fig3+=(--untrained "first:$n" --untrained "last:$n")
done
fig3_report=$RUNS/fcsd_fig3.json
[[ -f $fig3_report ]] || run "$PYTHON" -m distill.report --teacher "$TEACHER" --text "$TEXT" --out "$fig3_report" \
    "${fig3[@]}" --untrained all --max-windows "$MAX_WINDOWS"

run "$PYTHON" -m distill.ablation_table --table2 "$report" --fig3 "$fig3_report" --num-layers "$LAYERS" \
    --out "$RUNS/fcsd_ablations.md"
