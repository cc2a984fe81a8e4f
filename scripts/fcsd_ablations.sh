#!/usr/bin/env bash
# FarSkip-Collective's Table 2 ablations and Fig. 3 sweep at the scale of scripts/fcsd_demo.sh (docs/results/fcsd.md):
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
# Environment: PYTHON, TORCHRUN (default: .venv's), NPROC (2), EP (expert-parallel size of each
# student, default NPROC), LAYERS (8), TEACHER (RUNS_DIR/corpus_moe<LAYERS>_cpu; an existing finished
# checkpoint is used as it is), TEACHER_ITERS (the config's 1500), DATA (mix: pretrain | sharegpt |
# mix), STEPS (300), L2_COEFFS ("0.1 1"), MAX_WINDOWS (300), STUDENT_FLAGS (more distill.fcsd flags
# for every student, e.g. "--eval-interval 15"), CONNECTIVITY (reference | paper-text: the FarSkip
# wiring of every student and untrained conversion; default: the default, reference), DRY_RUN=1
# (print the commands only).
# Repeats: SEEDS ("1234 1235 1236") trains every row once per seed into ..._s<SEED> and scores each
# seed's students in RUNS_DIR/fcsd_ablations_report_s<SEED>.json; the table then gives mean +- sd per
# row and each row's paired difference from KL (FAR 100%) with its 95% interval. JOBS (1) runs that
# many students at once (e.g. JOBS=2 NPROC=1 OMP_NUM_THREADS=1 on two cores), each logging to
# RUNS_DIR/<run>.log. Without SEEDS: one run per row with the config's seed, as before.
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
EP=${EP:-$NPROC}
JOBS=${JOBS:-1}
SEEDS=${SEEDS:-}
read -r -a extra_flags <<< "${STUDENT_FLAGS:-}"
wiring_flags=()  # the wiring of every student and untrained conversion (partial ranges after an MoE layer)
[[ -n ${CONNECTIVITY:-} ]] && wiring_flags=(--farskip-connectivity "$CONNECTIVITY")
BATCH=16  # examples/fcsd_tiny_cpu.yaml: 16 sequences of 128 tokens per step, micro-batch 8
MICRO=8
source "$(dirname "${BASH_SOURCE[0]}")/fcsd_lib.sh"
PROG=fcsd_ablations.sh

# every setting is checked before hours of training
fcsd_check_positive $PROG STEPS "$STEPS"
fcsd_check_positive $PROG LAYERS "$LAYERS"
fcsd_check_positive $PROG NPROC "$NPROC"
fcsd_check_positive $PROG MAX_WINDOWS "$MAX_WINDOWS"
fcsd_check_positive $PROG EP "$EP"
fcsd_check_positive $PROG JOBS "$JOBS"
for seed in $SEEDS; do fcsd_check_positive $PROG "a seed in SEEDS" "$seed"; done
TEACHER_ITERS=${TEACHER_ITERS:-1500}
fcsd_check_positive $PROG TEACHER_ITERS "$TEACHER_ITERS"
((LAYERS >= 2)) || { echo "$PROG: error: LAYERS must be at least 2 (first-N vs last-N), got $LAYERS" >&2; exit 2; }
[[ -z ${CONNECTIVITY:-} || $CONNECTIVITY == reference || $CONNECTIVITY == paper-text ]] || {
    echo "$PROG: error: CONNECTIVITY must be reference or paper-text, got '$CONNECTIVITY'" >&2; exit 2; }
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
student() {  # student LABEL NAME FLAGS...: one FCSD run into RUNS/fcsd_abl_<DATA>_<NAME>[_s<SEED>], scored as LABEL
    local label=$1 name=$2
    shift 2
    local out=$RUNS/fcsd_abl_${DATA}_$name seed_flags=()
    if [[ -n $seed ]]; then
        out+=_s$seed
        label+=" (seed $seed)"
        seed_flags=(--seed "$seed")
    fi
    students+=(--student "$label=$out/best")
    finished "$out" && return 0
    local cmd=("$TORCHRUN" --standalone --nproc_per_node="$NPROC" -m distill.fcsd --config examples/fcsd_tiny_cpu.yaml
               --load "$TEACHER" --save "$out" --train-iters "$STEPS" --expert-model-parallel-size "$EP"
               "${data_flags[@]}" "${seed_flags[@]}" "$@" "${wiring_flags[@]}" "${extra_flags[@]}")
    launch "$out.log" "${cmd[@]}"
}

launch() {  # launch LOG CMD...: run CMD, or with JOBS > 1 start it in the background (at most JOBS at once, output to LOG)
    local log=$1
    shift
    if ((JOBS == 1)) || [[ -n ${DRY_RUN:-} ]]; then
        run "$@"
    else  # a failed job stops the script (set -e on wait -n)
        while (($(jobs -rp | wc -l) >= JOBS)); do wait -n; done
        "$@" > "$log" 2>&1 &
    fi
}
wait_all() { while (($(jobs -rp | wc -l) > 0)); do wait -n; done; }

table2_rows() {  # every row of Table 2 for the current $seed (the longest, 4x batch, first)
    student "KL 4x BS [all, $((BATCH * 4)) sequences per step]" kl_bs4_all --kd-loss kl --farskip all \
        --global-batch-size $((BATCH * 4)) --micro-batch-size "$MICRO"
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
}

TEXT=$SHARED/pretrain/wikitext-2/test.txt
table2_reports=()
if [[ -z $SEEDS ]]; then
    seed=
    table2_rows
    report=$RUNS/fcsd_ablations_report.json
    [[ -f $report ]] || run "$PYTHON" -m distill.report --teacher "$TEACHER" --text "$TEXT" --out "$report" \
        --untrained all "${students[@]}" --max-windows "$MAX_WINDOWS" "${wiring_flags[@]}"
    table2_reports=("$report")
else
    declare -A seed_students
    for seed in $SEEDS; do  # seed-major: a run cut short still has whole seeds
        students=()
        table2_rows
        seed_students[$seed]="${students[*]@Q}"
    done
    wait_all
    for seed in $SEEDS; do
        eval "students=(${seed_students[$seed]})"
        report=$RUNS/fcsd_ablations_report_s$seed.json
        [[ -f $report ]] || launch "${report%.json}.log" "$PYTHON" -m distill.report --teacher "$TEACHER" \
            --text "$TEXT" --out "$report" --untrained all "${students[@]}" --max-windows "$MAX_WINDOWS" "${wiring_flags[@]}"
        table2_reports+=("$report")
    done
fi

fig3=()
for ((n = 1; n < LAYERS; n++)); do
    fig3+=(--untrained "first:$n" --untrained "last:$n")
done
fig3_report=$RUNS/fcsd_fig3.json
[[ -f $fig3_report ]] || launch "${fig3_report%.json}.log" "$PYTHON" -m distill.report --teacher "$TEACHER" \
    --text "$TEXT" --out "$fig3_report" "${fig3[@]}" --untrained all --max-windows "$MAX_WINDOWS" "${wiring_flags[@]}"
wait_all

seeded_flags=()  # with SEEDS: the statistics, the plot and the convergence of the students too
[[ -n $SEEDS ]] && seeded_flags=(--json "$RUNS/fcsd_ablations.json" --plot "$RUNS/fcsd_ablations.png" --convergence)
run "$PYTHON" -m distill.ablation_table --table2 "${table2_reports[@]}" --fig3 "$fig3_report" --num-layers "$LAYERS" \
    --out "$RUNS/fcsd_ablations.md" "${seeded_flags[@]}"
