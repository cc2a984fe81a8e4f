#!/usr/bin/env bash
# FarSkip's two wirings side by side on one teacher (docs/results/fcsd.md): the FCSD rows whose
# conversion starts right after an MoE layer, where `reference` (the default) and `paper-text` differ.
#
#   scripts/fcsd_wirings.sh [SHARED_DATA_DIR] [RUNS_DIR]
#
# 1. data (scripts/fcsd_lib.sh) and the teacher of the results page's recipe:
#    examples/corpus_dsv2lite_routing_cpu.yaml (8 layers, the first dense) for TEACHER_ITERS (1000)
#    steps into RUNS_DIR/corpus_dsv2lite_routing, then continued to CONTINUE_ITERS (2000) at its
#    final learning rate into RUNS_DIR/corpus_dsv2lite_routing_<CONTINUE_ITERS> (the teacher);
# 2. untrained conversions, one report per wiring on WikiText-2 test (MAX_WINDOWS windows):
#    RUNS_DIR/untrained_<WIRING>.json with last:1 .. last:7 and all, the last layer's sub-blocks
#    (last:1@attn-only, last:1@mlp-only) and, under reference only (the same under both wirings),
#    first:1 .. first:7 and all layers' sub-blocks: Fig. 3 and the sub-block table;
# 3. per seed of SEEDS ("1234 1235 1236"), students of examples/fcsd_tiny_cpu.yaml on the mix
#    corpus, STEPS (60) steps, held-out KL every EVAL_INTERVAL (15) steps: KL on all layers (the
#    same under both wirings: the row the others are compared with) and KL on last:4 and last:6
#    (Table 2's FAR 50% and 75%) under each wiring of WIRINGS ("reference paper-text"), into
#    RUNS_DIR/fcsd_abl_mix_<row>[_<wiring>]_s<SEED> (reference keeps Table 2's names);
# 4. per seed, RUNS_DIR/wirings_report_s<SEED>.json: the teacher, the untrained conversion of all
#    layers and the seed's students on WikiText-2 test.
# Then `python -m distill.wiring_table` turns the reports into the tables (docs/results/fcsd.md).
#
# Every process is one rank started without torchrun (python with the torchrun environment of a
# world of one, EP = 1, the time-based watchdogs off): torchrun starts its workers in sessions of
# their own, and this way stopping the script's process group (kill -STOP -PGID, kill -CONT -PGID)
# pauses all of its work. JOBS (2) students or reports run at once, each with JOB_THREADS (1)
# threads; the teacher runs alone with TEACHER_THREADS (2). Each run appends
# "<UTC time> <name> rc=<exit code> wall_s=<seconds>" to PROGRESS (RUNS_DIR/progress.log); a failed
# run is logged and the others go on (the script exits 1 at the end if a report is missing). PGID_FILE: write the
# script's process-group id there. Finished steps are skipped (a run with a summary, a report that
# exists); an unfinished student's directory is moved aside to <dir>.incomplete-<time> and the run
# starts again: rerun to resume. PYTHON (.venv/bin/python); DRY_RUN=1 prints the commands only.
set -euo pipefail

SHARED=${1:-../shared/data}
RUNS=${2:-runs}
PYTHON=${PYTHON:-.venv/bin/python}
NPROC=1  # scripts/fcsd_lib.sh's launchers are not used: every process is one rank (ONE_RANK below)
SEEDS=${SEEDS:-1234 1235 1236}
STEPS=${STEPS:-60}
EVAL_INTERVAL=${EVAL_INTERVAL:-15}
TEACHER_ITERS=${TEACHER_ITERS:-1000}
CONTINUE_ITERS=${CONTINUE_ITERS:-2000}
MAX_WINDOWS=${MAX_WINDOWS:-300}
WIRINGS=${WIRINGS:-reference paper-text}
JOBS=${JOBS:-2}
JOB_THREADS=${JOB_THREADS:-1}
TEACHER_THREADS=${TEACHER_THREADS:-2}
PROGRESS=${PROGRESS:-$RUNS/progress.log}
LAYERS=8  # examples/corpus_dsv2lite_routing_cpu.yaml
source "$(dirname "${BASH_SOURCE[0]}")/fcsd_lib.sh"
PROG=fcsd_wirings.sh

for name in STEPS EVAL_INTERVAL TEACHER_ITERS CONTINUE_ITERS MAX_WINDOWS JOBS JOB_THREADS TEACHER_THREADS; do
    fcsd_check_positive $PROG "$name" "${!name}"
done
for seed in $SEEDS; do fcsd_check_positive $PROG "a seed in SEEDS" "$seed"; done
[[ -n ${SEEDS// /} ]] || { echo "$PROG: error: SEEDS is empty" >&2; exit 2; }
((CONTINUE_ITERS > TEACHER_ITERS)) || {
    echo "$PROG: error: CONTINUE_ITERS ($CONTINUE_ITERS) must exceed TEACHER_ITERS ($TEACHER_ITERS)" >&2; exit 2; }
for w in $WIRINGS; do
    [[ $w == reference || $w == paper-text ]] || {
        echo "$PROG: error: WIRINGS has '$w', not reference or paper-text" >&2; exit 2; }
done
[[ " $WIRINGS " == *" reference "* ]] || { echo "$PROG: error: WIRINGS must include reference" >&2; exit 2; }
fcsd_data_flags mix

# the time-based watchdogs: a process stopped with its group must not be declared hung when continued
NO_WATCHDOGS=(--heartbeat-timeout 0 --step-timeout 0 --startup-timeout 0 --save-timeout 0 --eval-timeout 0)
TEXT=$SHARED/pretrain/wikitext-2/test.txt
T1=$RUNS/corpus_dsv2lite_routing
TEACHER=${T1}_$CONTINUE_ITERS

if [[ -z ${DRY_RUN:-} ]]; then
    mkdir -p "$RUNS" "$(dirname "$PROGRESS")"
    [[ -z ${PGID_FILE:-} ]] || ps -o pgid= -p $$ | tr -d ' ' > "$PGID_FILE"
fi

# a world of one rank: torchrun's environment without torchrun (port 0: the rank's own store picks one)
ONE_RANK=(env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=0)

timed() {  # timed NAME CMD...: run CMD and log its exit code and wall time to PROGRESS (returns 0)
    local name=$1 start=$SECONDS rc=0
    shift
    run "$@" || rc=$?
    if [[ -z ${DRY_RUN:-} ]]; then
        printf '%s %s rc=%d wall_s=%d\n' "$(date -u +%FT%TZ)" "$name" "$rc" $((SECONDS - start)) >> "$PROGRESS"
    fi
    return 0
}

launch() {  # launch NAME CMD...: timed in the background (at most JOBS at once), output to RUNS/NAME.log
    local name=$1
    shift
    if [[ -n ${DRY_RUN:-} ]]; then
        timed "$name" "$@"
        return
    fi
    while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
    timed "$name" "$@" > "$RUNS/$name.log" 2>&1 &
}
wait_all() { while (($(jobs -rp | wc -l) > 0)); do wait -n || true; done; }

# 1. data and the teacher (the teacher alone: it uses both cores)
fcsd_prepare_data "$SHARED"
if ! finished "$T1"; then
    timed "$(basename "$T1")" "${ONE_RANK[@]}" OMP_NUM_THREADS="$TEACHER_THREADS" "$PYTHON" -m megatron.training.pretrain_gpt \
        --config examples/corpus_dsv2lite_routing_cpu.yaml --expert-model-parallel-size 1 \
        --train-iters "$TEACHER_ITERS" --save "$T1" --load "$T1" "${NO_WATCHDOGS[@]}"
fi
if ! finished "$TEACHER"; then
    from=$T1  # continue from the first run, or resume the continuation
    [[ -f $TEACHER/latest_checkpointed_iteration.txt ]] && from=$TEACHER
    timed "$(basename "$TEACHER")" "${ONE_RANK[@]}" OMP_NUM_THREADS="$TEACHER_THREADS" "$PYTHON" -m megatron.training.pretrain_gpt \
        --config examples/corpus_dsv2lite_routing_cpu.yaml --expert-model-parallel-size 1 \
        --load "$from" --save "$TEACHER" --train-iters "$CONTINUE_ITERS" --lr-decay-iters "$TEACHER_ITERS" \
        --save-interval 500 "${NO_WATCHDOGS[@]}"
fi
if [[ -z ${DRY_RUN:-} ]] && ! finished "$TEACHER"; then
    echo "$PROG: error: the teacher $TEACHER did not finish (see $PROGRESS); rerun to resume" >&2
    exit 1
fi

report() {  # report NAME FLAGS...: a distill.report of the teacher into RUNS/NAME.json, unless it exists
    local name=$1
    shift
    [[ -f $RUNS/$name.json ]] || launch "$name" env OMP_NUM_THREADS="$JOB_THREADS" "$PYTHON" -m distill.report \
        --teacher "$TEACHER" --text "$TEXT" --max-windows "$MAX_WINDOWS" --out "$RUNS/$name.json" "$@"
}

# 2. untrained conversions (Fig. 3 and the sub-blocks), one report per wiring
for wiring in $WIRINGS; do
    specs=()
    for ((n = 1; n < LAYERS; n++)); do
        [[ $wiring == reference ]] && specs+=(--untrained "first:$n")
        specs+=(--untrained "last:$n")
    done
    specs+=(--untrained all --untrained last:1@attn-only --untrained last:1@mlp-only)
    [[ $wiring == reference ]] && specs+=(--untrained all@attn-only --untrained all@mlp-only)
    report "untrained_$wiring" --farskip-connectivity "$wiring" "${specs[@]}"
done

student() {  # student NAME LABEL FLAGS...: one FCSD run of the current $seed into RUNS/fcsd_abl_mix_<NAME>_s<seed>
    local name=fcsd_abl_mix_${1}_s$seed label="$2 (seed $seed)"
    shift 2
    local out=$RUNS/$name
    students+=(--student "$label=$out/best")
    finished "$out" && return 0
    if [[ -e $out && -z ${DRY_RUN:-} ]]; then
        mv "$out" "$out.incomplete-$(date -u +%Y%m%dT%H%M%S)"
    fi
    launch "$name" "${ONE_RANK[@]}" OMP_NUM_THREADS="$JOB_THREADS" "$PYTHON" -m distill.fcsd --config examples/fcsd_tiny_cpu.yaml \
        --load "$TEACHER" --save "$out" --train-iters "$STEPS" --eval-interval "$EVAL_INTERVAL" \
        --expert-model-parallel-size 1 --seed "$seed" "${data_flags[@]}" "$@" "${NO_WATCHDOGS[@]}"
}

# 3. and 4. the students, seed by seed (a pipeline cut short still has whole seeds), then each seed's report
for seed in $SEEDS; do
    students=()
    student kl_all "KL (FAR 100%) [all $LAYERS]" --kd-loss kl --farskip all
    for n in 4 6; do
        pct=$((100 * n / LAYERS))
        for wiring in $WIRINGS; do
            suffix=""
            [[ $wiring == reference ]] || suffix=_$wiring
            student "kl_last$n$suffix" "KL (FAR $pct%) [last:$n of $LAYERS, $wiring]" --kd-loss kl --farskip "last:$n" \
                --farskip-connectivity "$wiring"
        done
    done
    wait_all
    report "wirings_report_s$seed" --untrained all "${students[@]}"
done
wait_all

if [[ -z ${DRY_RUN:-} ]]; then
    missing=()
    for seed in $SEEDS; do [[ -f $RUNS/wirings_report_s$seed.json ]] || missing+=("wirings_report_s$seed.json"); done
    for wiring in $WIRINGS; do [[ -f $RUNS/untrained_$wiring.json ]] || missing+=("untrained_$wiring.json"); done
    if ((${#missing[@]})); then
        echo "$PROG: error: not written: ${missing[*]} (failed runs: lines without rc=0 in $PROGRESS); rerun to resume" >&2
        exit 1
    fi
    echo "$PROG: done: the reports are in $RUNS"
fi
