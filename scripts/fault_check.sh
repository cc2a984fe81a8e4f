#!/usr/bin/env bash
# Fault injection on the tiny default (examples/tiny_moe_cpu.yaml, 2 CPU ranks under torchrun):
# replays the cases of issue 22 end to end and prints one line per case:
#
#   <case> | survived|FAILED | lost steps: N | <what happened / the error line>
#
#   scripts/fault_check.sh [OUTDIR]        (default: a new temporary directory; kept, printed)
#
# Cases: kill -9 a rank during a save; kill -9 the launcher during a save; SIGTERM the launcher;
# a corrupt newest checkpoint; a reused --save directory; a crafted .metadata; then a rank that is
# stopped (SIGSTOP), stuck in native code holding the GIL, spinning in Python, segfaults, aborts,
# or raises, each under torchrun --max-restarts=1 (the job must notice, restart and finish). "lost steps" is the
# number of trained steps not in the checkpoint the next run resumes from. A case "survived" when
# no process outlived the run, nothing was half-written where a run would load it, the resumed run
# (if any) finished, and every refusal was one line. A few minutes on 2 cores.
# Environment: CASES=ranks runs only the rank faults; PYTHON (default: .venv/bin/python of this repository, else python), TORCHRUN
# (default: the torchrun beside PYTHON).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python
    [[ -x $REPO/.venv/bin/python ]] && PYTHON=$REPO/.venv/bin/python
fi
TORCHRUN=${TORCHRUN:-$(dirname "$(command -v "$PYTHON")")/torchrun}
OUT=${1:-$(mktemp -d -t fault_check.XXXXXX)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CACHE=$OUT/data_cache
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
cd "$REPO"
"$PYTHON" -c "import megatron.core, psutil" 2>/dev/null || {
    echo "fault_check.sh: error: $PYTHON cannot import megatron.core; run \`make install\` or set PYTHON" >&2; exit 2; }

TRAIN=(--config examples/tiny_moe_cpu.yaml --log-interval 1 --eval-interval 1000 --eval-iters 1
       --data-cache-path "$CACHE")
STARTED=()   # launchers this script started (killed at exit if still running)
cleanup() {
    local pid
    for pid in "${STARTED[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

py() { "$PYTHON" - "$@"; }

launch() {  # launch <dir> <log> <args...>: a torchrun in the background; its pid in $LAUNCHED
    local dir=$1 log=$2; shift 2
    "$TORCHRUN" --standalone --nproc_per_node=2 -m megatron.training.pretrain_gpt "${TRAIN[@]}" \
        --save "$dir" "$@" >"$log" 2>&1 &
    LAUNCHED=$!
    STARTED+=("$LAUNCHED")
}

run() {  # run <dir> <log> <args...>: a torchrun in the foreground; returns its exit code
    local dir=$1 log=$2; shift 2
    "$TORCHRUN" --standalone --nproc_per_node=2 -m megatron.training.pretrain_gpt "${TRAIN[@]}" \
        --save "$dir" "$@" >"$log" 2>&1
}

checkpoints() {  # checkpoints <dir>: number of checkpoint events in its metrics
    [[ -f $1/metrics.jsonl ]] || { echo 0; return; }
    grep -c '"event": "checkpoint"' "$1/metrics.jsonl" || true
}

wait_for_save() {  # wait_for_save <dir>: after >= 2 checkpoints, until a save is in progress (best
    # effort: $DURING is "during a save" when one was caught, else "between saves")
    local dir=$1 i
    DURING="between saves"
    for ((i = 0; i < 1500; i++)); do (( $(checkpoints "$dir") >= 2 )) && break; sleep 0.1; done
    for ((i = 0; i < 500; i++)); do
        if compgen -G "$dir/.tmp-iter_*" >/dev/null; then DURING="during a save"; return 0; fi
        sleep 0.02
    done
    return 0
}

descendants() {  # descendants <pid>: every process below it
    local child
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$child"; descendants "$child"; done
}

alive() {  # alive <pids...>: those still running after a grace period
    local i pid left
    for ((i = 0; i < 90; i++)); do
        left=""
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && left+="$pid "; done
        [[ -z $left ]] && break
        sleep 1
    done
    echo "$left"
}

state() {  # state <dir>: "<last trained step> <newest complete checkpoint iteration or -1>"
    py "$1" 2>/dev/null <<'EOF' || echo "0 -1"
import json, logging, os, sys
logging.disable(logging.WARNING)
from megatron.training.checkpointing import CheckpointError, find_latest_checkpoint, read_manifest
d = sys.argv[1]
steps = [r["step"] for r in map(json.loads, open(os.path.join(d, "metrics.jsonl"))) if "event" not in r]
try:
    path = find_latest_checkpoint(d)
    it = read_manifest(path, verify=True)["iteration"] if path else -1
except CheckpointError:
    it = -1
print(max(steps, default=0), it)
EOF
}

error_line() {  # error_line <log>: the run's one-line error, or "(none)"
    local line
    line=$(grep -E "^(\[rank[0-9]+\]: )?pretrain_gpt: error: " "$1" | head -1 | sed -E 's/^\[rank[0-9]+\]: //')
    echo "${line:-(none)}"
}

report() {  # report <case> <ok 0|1> <lost> <text>
    local verdict=survived
    [[ $2 == 1 ]] || verdict=FAILED
    printf '%s | %s | lost steps: %s | %s\n' "$1" "$verdict" "$3" "$4"
}

resume_ok() {  # resume_ok <dir> <log> <iteration>: resume two more steps from <dir>
    run "$1" "$2" --load "$1" --train-iters $(($3 + 2))
}

# ---------------------------------------------------------------------------------- kill -9 a rank
case_kill_rank() {
    local dir=$OUT/kill_rank pid ranks family left last saved ok=1 note
    launch "$dir" "$OUT/kill_rank.log" --train-iters 400 --save-interval 3
    pid=$LAUNCHED
    wait_for_save "$dir"
    ranks=$(ps -o pid= --ppid "$pid")
    family="$ranks $(for r in $ranks; do descendants "$r"; done)"
    kill -9 "$(echo "$ranks" | tail -1)"
    wait "$pid" || true
    left=$(alive $family)
    read -r last saved < <(state "$dir")
    note="rank killed $DURING at step $last; resumed from iter $saved"
    [[ -z $left ]] || { ok=0; note+="; processes left: $left"; }
    (( saved >= 0 )) || ok=0
    resume_ok "$dir" "$OUT/kill_rank.resume.log" "$saved" || { ok=0; note+="; resume failed: $(error_line "$OUT/kill_rank.resume.log")"; }
    report "kill -9 a rank during a save" $ok $((last - saved)) "$note"
}

# ------------------------------------------------------------------------------ kill -9 the launcher
case_kill_launcher() {
    local dir=$OUT/kill_launcher pid ranks left last saved ok=1 note
    launch "$dir" "$OUT/kill_launcher.log" --train-iters 400 --save-interval 3
    pid=$LAUNCHED
    wait_for_save "$dir"
    ranks=$(ps -o pid= --ppid "$pid")
    kill -9 "$pid"
    wait "$pid" 2>/dev/null || true
    left=$(alive $ranks)
    read -r last saved < <(state "$dir")
    note="launcher killed $DURING; its ranks stopped on the kernel's SIGTERM and saved iter $saved"
    [[ -z $left ]] || { ok=0; note="ranks still training: $left"; kill -9 $left 2>/dev/null || true; }
    [[ ! -e $dir/writer.lock ]] || { ok=0; note+="; writer.lock left"; }
    resume_ok "$dir" "$OUT/kill_launcher.resume.log" "$saved" || { ok=0; note+="; resume failed: $(error_line "$OUT/kill_launcher.resume.log")"; }
    report "kill -9 the launcher during a save" $ok $((last - saved)) "$note"
}

# ------------------------------------------------------------------------------- SIGTERM the launcher
case_sigterm() {
    local dir=$OUT/sigterm pid ranks left last saved ok=1 note
    launch "$dir" "$OUT/sigterm.log" --train-iters 400 --save-interval 3
    pid=$LAUNCHED
    wait_for_save "$dir"
    ranks=$(ps -o pid= --ppid "$pid")
    kill -TERM "$pid"
    wait "$pid" || true
    left=$(alive $ranks)
    read -r last saved < <(state "$dir")
    note="$DURING: "$(grep -o "stopped by SIGTERM at iteration [0-9]*.*exit code [0-9]*)" "$OUT/sigterm.log" | sed 's/; metrics.*resume/; resume/' || true)
    [[ $note == *stopped* ]] || { ok=0; note="no closing line"; }
    grep -q BrokenPipeError "$OUT/sigterm.log" && { ok=0; note+="; BrokenPipeError"; }
    [[ -z $left ]] || { ok=0; note+="; processes left: $left"; }
    resume_ok "$dir" "$OUT/sigterm.resume.log" "$saved" || { ok=0; note+="; resume failed"; }
    report "SIGTERM the launcher" $ok $((last - saved)) "$note"
}

# ------------------------------------------------------------------------- corrupt newest checkpoint
case_corrupt() {
    local dir=$OUT/corrupt newest shard from ok=1 err
    run "$dir" "$OUT/corrupt.log" --train-iters 6 --save-interval 3 || ok=0
    newest=$(ls -d "$dir"/iter_* | tail -1)
    shard=$(ls "$newest"/*.distcp | head -1)
    truncate -s $(( $(stat -c %s "$shard") / 2 )) "$shard"
    if run "$dir" "$OUT/corrupt.resume.log" --load "$dir" --train-iters 8; then ok=0; fi
    err=$(error_line "$OUT/corrupt.resume.log")
    [[ $err == *"$(basename "$newest") is corrupt"* ]] || ok=0
    run "$dir" "$OUT/corrupt.fallback.log" --load "$dir" --train-iters 8 --load-fallback || ok=0
    compgen -G "$newest.corrupt-*" >/dev/null || ok=0   # moved aside, not deleted
    from=$(grep -o "starting at iteration [0-9]*" "$OUT/corrupt.fallback.log" | grep -o "[0-9]*$" || echo -1)
    report "corrupt newest checkpoint" $ok $(( 10#${newest##*iter_} - from )) \
        "$err; --load-fallback resumed from iter $from, $(basename "$newest") moved aside"
}

# ---------------------------------------------------------------------------------- reuse a save dir
case_reuse() {
    local dir=$OUT/reuse ok=1 err before after
    run "$dir" "$OUT/reuse.log" --train-iters 3 || ok=0
    before=$(ls -l "$dir" | md5sum)
    if run "$dir" "$OUT/reuse.again.log" --train-iters 3 --num-layers 2; then ok=0; fi
    err=$(error_line "$OUT/reuse.again.log")
    after=$(ls -l "$dir" | md5sum)
    [[ $before == "$after" && $err == *"--overwrite-save"* ]] || ok=0
    grep -q "^iter " "$OUT/reuse.again.log" && ok=0   # refused before training
    report "reuse a save dir" $ok 0 "$err"
}

# ----------------------------------------------------------------------------------- crafted .metadata
case_crafted() {
    local dir=$OUT/crafted ok=1 err marker=$OUT/crafted.PWNED
    rm -f "$marker"
    run "$dir" "$OUT/crafted.log" --train-iters 3 || ok=0
    py "$dir/iter_0000003" "$marker" <<'EOF'
import hashlib, json, os, pickle, sys
ckpt, marker = sys.argv[1:]
class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))
with open(os.path.join(ckpt, ".metadata"), "wb") as f:
    pickle.dump(Payload(), f)
data = open(os.path.join(ckpt, ".metadata"), "rb").read()
manifest = json.load(open(os.path.join(ckpt, "manifest.json")))
manifest["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
json.dump(manifest, open(os.path.join(ckpt, "manifest.json"), "w"))
EOF
    if run "$dir" "$OUT/crafted.resume.log" --load "$dir" --train-iters 5; then ok=0; fi
    err=$(error_line "$OUT/crafted.resume.log")
    [[ ! -e $marker && $err == *"unsafe checkpoint"* ]] || ok=0
    [[ -e $marker ]] && err+=" (the payload RAN)"
    report "crafted .metadata" $ok 0 "$err"
}

# ---------------------------------------------------- stopped, stuck, crashing ranks (the watchdog)
# torchrun --max-restarts=1 with --save D --load D: the fault ends the first attempt, the second
# resumes from D's newest checkpoint and finishes. "detected" is the time from the fault (the
# injecting rank's clock, or this script's SIGSTOP) to torchrun seeing the first rank exit.
WATCH=(--heartbeat-timeout 10 --step-timeout 20)

agent_failed_at() {  # agent_failed_at <log>: epoch seconds of torchrun's first "failed (exitcode" line
    py "$1" <<'EOF'
import datetime, re, sys
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"E(\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) .*failed \(exitcode", line)
    if m:
        year = datetime.date.today().year
        t = datetime.datetime.strptime(f"{year}-{m[1]}-{m[2]} {m[3]}", "%Y-%m-%d %H:%M:%S.%f")
        print(f"{t.timestamp():.3f}")
        break
EOF
}

case_rank_fault() {  # case_rank_fault <kind>: stop (SIGSTOP from here) or one of megatron.training.faults.KINDS
    local kind=$1 dir=$OUT/fault_$1 log=$OUT/fault_$1.log pid ranks at="" failed last saved ok=1 note="" code
    mkdir -p "$dir.faults"
    if [[ $kind != stop ]]; then
        py "$dir.faults" "$kind" <<'EOF'
import sys
from megatron.training import faults
faults.request(sys.argv[1], 1, sys.argv[2], 4)
EOF
    fi
    MEGATRON_FAULT_DIR=$dir.faults "$TORCHRUN" --standalone --nproc_per_node=2 --max-restarts=1 \
        -m megatron.training.pretrain_gpt "${TRAIN[@]}" "${WATCH[@]}" --save "$dir" --load "$dir" \
        --train-iters 30 --save-interval 2 >"$log" 2>&1 &
    pid=$!
    STARTED+=("$pid")
    if [[ $kind == stop ]]; then
        for ((i = 0; i < 1500; i++)); do (( $(checkpoints "$dir") >= 2 )) && break; sleep 0.1; done
        ranks=$(ps -o pid= --ppid "$pid")
        kill -STOP "$(echo "$ranks" | tail -1)"
        at=$(date +%s.%N)
    fi
    code=0
    wait "$pid" || code=$?
    [[ $kind == stop ]] || at=$(grep -o "injecting fault '$kind' after iteration [0-9]* at [0-9.]*" "$log" | head -1 | awk '{print $NF}')
    failed=$(agent_failed_at "$log")
    read -r last saved < <(state "$dir")
    (( code == 0 )) || { ok=0; note="exit code $code; "; }
    local detected="?" why from
    if [[ -n $at && -n $failed ]]; then
        detected=$(awk -v a="$at" -v b="$failed" 'BEGIN {printf "%.1f", b - a}')
    else
        ok=0; note+="no fault or no failure seen; "
    fi
    why=$(grep -oE "sent no heartbeat for [0-9.]+ s|no training step finished on rank [0-9]+ for [0-9.]+ s|Fatal Python error: [A-Za-z ]+|RuntimeError: injected fault on rank [0-9]+" "$log" | head -1)
    from=$(grep -o "starting at iteration [0-9]*" "$log" | tail -1 | grep -o "[0-9]*$")
    note+="detected in ${detected} s (${why:-no reason found}); restarted from iter ${from:-?}, finished at $last"
    (( last == 30 )) || ok=0
    local before  # the last step the first attempt logged
    before=$(awk '/starting at iteration/ {n++} n == 1 && /^iter / {split($2, a, "/"); s = a[1]} END {print s + 0}' "$log")
    report "rank fault: $kind" $ok $(( before - ${from:-0} )) "$note"
}

echo "fault_check.sh: runs and logs in $OUT"
if [[ ${CASES:-all} != ranks ]]; then
    case_kill_rank
    case_kill_launcher
    case_sigterm
    case_corrupt
    case_reuse
    case_crafted
fi
for kind in stop gil spin segfault abort error; do case_rank_fault "$kind"; done
