#!/usr/bin/env bash
# The second pre-registered out-of-configuration round of netsim's replay (replay/8), as its plan says
# (docs/figures/netsim_validation/plan_round2.md): two base configurations and, for each, four
# what-if configurations that change one setting (link rate x4, EP x2, model width, prompt set).
#
#   sudo scripts/netsim_round2.sh [RUNS_DIR]        # default runs/round2; about two hours
#
# Per configuration: serve it (3 runs, rates 2, 4, 8 requests/s, 32 requests each), profile it right
# after where it needs its own profile (the bases, EP x2, width), validate it with the profile the
# plan names, then the report with the what-if pairs. Three link tables are calibrated first (0.32 and
# 0.2 Gbit/s on 2 ranks, 0.05 Gbit/s on 4 ranks). Finished steps are skipped (rerun to resume); each
# step appends "<UTC time> <step> rc=<code>" to RUNS_DIR/progress.log. Run it alone on the machine.
set -uo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-runs/round2}
PY=${PY:-.venv/bin/python}
PROMPTS=${PROMPTS:-../shared/data/prompts}
SHAREGPT=$PROMPTS/sharegpt/ShareGPT_V3_filtered_500.json
CAL=examples/calibration
mkdir -p "$RUNS"
log() { printf '%s %s\n' "$(date -u +%FT%TZ)" "$*" >> "$RUNS/progress.log"; }
step() {  # step NAME DONE_FILE CMD...: run CMD unless DONE_FILE exists; log its exit code
    local name=$1 done=$2; shift 2
    [[ -e $done ]] && return 0
    "$@" > "$RUNS/$name.log" 2>&1
    local rc=$?
    log "$name rc=$rc"
    return 0
}
log "start at $(git rev-parse --short HEAD)"

# link tables at the new rates (examples/calibration/link_table_{0.08,0.08_r4,0.05} exist)
step cal_0.32 "$CAL/link_table_0.32/ar_both_0.32_r2_gap80.csv" scripts/calibrate_link_table.sh 0.32 $CAL/link_table_0.32
step cal_0.2 "$CAL/link_table_0.2/ar_both_0.2_r2_gap80.csv" scripts/calibrate_link_table.sh 0.2 $CAL/link_table_0.2
step cal_0.05_r4 "$CAL/link_table_0.05_r4/ar_both_0.05_r4_gap80.csv" env RANKS=4 scripts/calibrate_link_table.sh 0.05 \
    $CAL/link_table_0.05_r4
step prompts "data/round2_prompts/boolq_eval.jsonl" $PY -m tools.semmoe.prompts --data-dir "$PROMPTS" \
    --datasets arc,boolq --out-dir data/round2_prompts

B1=(--config examples/bench_bigmac_top8_cpu.yaml --num-layers 3 --hidden-size 160 --num-experts 16
    --moe-ffn-hidden-size 80 --moe-router-topk 2 --seed 5151)
B2=(--config examples/bench_bigmac_top8_cpu.yaml --num-layers 4 --hidden-size 128 --num-experts 32
    --moe-ffn-hidden-size 64 --moe-router-topk 4 --seed 6262)
COMMON=(--variants standard,bigmac --request-rates 2,4,8 --num-requests 32 --runs 3 --slo-ttft 0.5 --slo-tpot 0.075)

# configuration: ID, link rate, link table, the profile it is validated with (own, or a base's), flags
serve_one() {
    local id=$1 rate=$2 table=$3 profile_of=$4; shift 4
    local w=$RUNS/$id
    mkdir -p "$w"
    step "${id}_serve" "$w/serve.json" $PY scripts/bench_serve.py "$@" "${COMMON[@]}" --link-gbit "$rate" \
        --work-dir "$w/work" --json "$w/serve.json"
    if [[ $profile_of == "$id" ]]; then
        step "${id}_profile" "$w/serve.profile.json" $PY -m tools.profile.serving_compute \
            --bench-serve "$w/serve.json" --out "$w/serve.profile.json" --precision 1
    fi
    step "${id}_validate" "$w/validate.json" $PY -m netsim validate --bench-serve "$w/serve.json" \
        --profile "$RUNS/$profile_of/serve.profile.json" --link-table "$table"/*.csv --json "$w/validate.json"
}

for base in B1 B2; do
    if [[ $base == B1 ]]; then
        flags=("${B1[@]}"); rate=0.08; table=$CAL/link_table_0.08; fast=0.32; fast_table=$CAL/link_table_0.32
        ep_table=$CAL/link_table_0.08_r4; width=256; prompts=arc
    else
        flags=("${B2[@]}"); rate=0.05; table=$CAL/link_table_0.05; fast=0.2; fast_table=$CAL/link_table_0.2
        ep_table=$CAL/link_table_0.05_r4; width=192; prompts=boolq
    fi
    serve_one $base $rate $table $base "${flags[@]}" --prompts "$SHAREGPT"
    serve_one $base-link $fast $fast_table $base "${flags[@]}" --prompts "$SHAREGPT"
    serve_one $base-prompts $rate $table $base "${flags[@]}" --prompts data/round2_prompts/${prompts}_eval.jsonl \
        --output-len 64
    serve_one $base-ep $rate $ep_table $base-ep "${flags[@]}" --prompts "$SHAREGPT" --ranks 4 --global-batch-size 32
    serve_one $base-width $rate $table $base-width "${flags[@]}" --hidden-size $width --prompts "$SHAREGPT"
done

names=()
for id in B1 B1-link B1-ep B1-width B1-prompts B2 B2-link B2-ep B2-width B2-prompts; do
    names+=("$id=$RUNS/$id/validate.json")
done
step report "$RUNS/report.json" $PY -m netsim report "${names[@]}" --goal 0.10 --json "$RUNS/report.json" \
    --pairs B1:B1-link B1:B1-ep B1:B1-width B1:B1-prompts B2:B2-link B2:B2-ep B2:B2-width B2:B2-prompts
log done
