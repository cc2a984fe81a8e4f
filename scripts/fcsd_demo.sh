#!/usr/bin/env bash
# The FCSD demonstration of docs/results/fcsd.md, end to end on this machine (2 CPU ranks; the teacher and
# each distillation corpus take about an hour at 300 steps):
#
#   scripts/fcsd_demo.sh [SHARED_DATA_DIR] [RUNS_DIR]
#
# 1. the shared pretraining corpus (War and Peace + tiny-shakespeare + WikiText-2 valid) and a
#    distillation corpus the teacher never saw (the ShareGPT first-turn prompts, the stand-in for
#    the paper's SFT data), both with the teacher's BPE-8192;
# 2. the teacher: examples/corpus_moe_cpu.yaml, 1500 steps;
# 3. per distillation corpus (DATA=pretrain|sharegpt|mix, mix = half ShareGPT, half the pretraining
#    corpus in its own proportions): FCSD kl on all layers, SFT on all layers,
#    FCSD kl on the last 2 of 4 layers (examples/fcsd_tiny_cpu.yaml, 300 steps each);
# 4. per corpus, the held-out report on WikiText-2 test (perplexity, KL to the teacher, lm-eval
#    columns): RUNS_DIR/fcsd_report_<DATA>.json.
# Finished steps are skipped (a run directory with a summary, a report that exists), so an
# interrupted demonstration resumes. Environment: PYTHON, TORCHRUN (default: .venv's), NPROC (2),
# LM_EVAL_LIMIT (500), STEPS (300), DATASETS ("pretrain sharegpt mix"), TEACHER (RUNS_DIR/corpus_moe_cpu);
# DRY_RUN=1 prints the commands it would run. Shared steps: scripts/fcsd_lib.sh (also used by
# scripts/fcsd_ablations.sh).
set -euo pipefail

SHARED=${1:-../shared/data}
RUNS=${2:-runs}
PYTHON=${PYTHON:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
NPROC=${NPROC:-2}
LM_EVAL_LIMIT=${LM_EVAL_LIMIT:-500}
STEPS=${STEPS:-300}
DATASETS=${DATASETS:-pretrain sharegpt mix}
source "$(dirname "${BASH_SOURCE[0]}")/fcsd_lib.sh"
for data in $DATASETS; do  # before an hour of teacher training, not after it
    fcsd_data_flags "$data" || {
        echo "fcsd_demo.sh: error: unknown distillation corpus '$data' in DATASETS (pretrain, sharegpt, mix)" >&2
        exit 2
    }
done
fcsd_check_positive fcsd_demo.sh STEPS "$STEPS"

fcsd_prepare_data "$SHARED"
TEACHER=${TEACHER:-$RUNS/corpus_moe_cpu}
fcsd_teacher "$TEACHER"

for data in $DATASETS; do
    fcsd_data_flags "$data"
    students=()
    for run in "kl all" "sft all" "kl last:2"; do
        read -r kd farskip <<<"$run"
        out=$RUNS/fcsd_${data}_${kd}_${farskip/:/}
        finished "$out" || run "$TORCHRUN" --standalone --nproc_per_node="$NPROC" -m distill.fcsd \
            --config examples/fcsd_tiny_cpu.yaml --load "$TEACHER" --save "$out" --kd-loss "$kd" \
            --farskip "$farskip" --train-iters "$STEPS" "${data_flags[@]}"
        label="FCSD kl"; [[ $kd == sft ]] && label="SFT"
        students+=(--student "$label, $farskip=$out/best")
    done
    report=$RUNS/fcsd_report_$data.json
    [[ -f $report ]] || run "$PYTHON" -m distill.report --teacher "$TEACHER" \
        --text "$SHARED/pretrain/wikitext-2/test.txt" --out "$report" --untrained all --untrained last:2 \
        "${students[@]}" --unigram-data "$BPE"/{warpeace,tinyshakespeare,wikitext2_valid}_text_document \
        --max-windows 300 --lm-eval-tasks local_arc_easy,local_piqa,local_lambada \
        --include-path examples/lm_eval_tasks --data-dir "$SHARED" --lm-eval-limit "$LM_EVAL_LIMIT"
done
