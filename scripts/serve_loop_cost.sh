#!/usr/bin/env bash
# The serving loop's cost per decode step, before and after a change, with and without routing
# statistics (docs/results/serving.md, "Serving-loop cost"):
#
#   scripts/serve_loop_cost.sh OLD_REV OUT_DIR CKPT [CKPT ...]
#
# For each checkpoint, 3 rounds of bench_serve on loopback (2 ranks, EP 2; 24 requests at 1
# request/s, 32-token prompts, 64 greedy tokens each) of: OLD_REV's code (a git worktree; its
# server always counted routing), this checkout with --routing-stats, and this checkout without;
# the order rotates between rounds. Then a table of TPOT p50, engine time per forward (busy
# seconds / forwards per rank, from /metrics) and the rest of each step (TPOT - engine), the
# median and range over the rounds, and OUT_DIR/summary.json. Run it alone on the machine.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 OLD_REV OUT_DIR CKPT [CKPT ...]" >&2; exit 2; }
old_rev=$1; out=$2; shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
mkdir -p "$out"
old=$(mktemp -d)/old
git -C "$here" worktree add -q --detach "$old" "$old_rev"
trap 'git -C "$here" worktree remove --force "$old"' EXIT
common=(--no-netns --ranks 2 --input-len 32 --output-len 64 --request-rates 1 --num-requests 24
        --warmup-requests 4 --no-plots --seed 1234)
for ckpt in "$@"; do
  model=$(basename "$(dirname "$ckpt")")-$(basename "$ckpt")
  for rep in 1 2 3; do
    case $rep in 1) order="old on off";; 2) order="on off old";; 3) order="off old on";; esac
    for code in $order; do
      echo "$(date +%T) load $(cut -d' ' -f1 /proc/loadavg) $model round $rep: $code"
      json="$out/$model-$code-$rep.json"
      case $code in
        old) (cd "$old" && "$py" scripts/bench_serve.py --load "$ckpt" "${common[@]}" --json "$json" > "${json%.json}.log" 2>&1);;
        on)  (cd "$here" && "$py" scripts/bench_serve.py --load "$ckpt" "${common[@]}" --runs 1 --routing-stats --json "$json" > "${json%.json}.log" 2>&1);;
        off) (cd "$here" && "$py" scripts/bench_serve.py --load "$ckpt" "${common[@]}" --runs 1 --no-routing-stats --json "$json" > "${json%.json}.log" 2>&1);;
      esac
    done
  done
done
"$py" - "$out" <<'PY'
import glob, json, os, statistics, sys
root = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(root, "*-[0-9].json"))):
    model, code, _ = os.path.basename(path)[:-5].rsplit("-", 2)
    d = json.load(open(path))
    r = d["variants"]["standard"]["rates"]["1"]
    forwards = (r["engine_steps"] + r["dummy_forwards"]) / d["config"]["ranks"]
    busy = r["engine_busy_s"] / forwards
    rows.setdefault((model, code), []).append({"tpot": r["tpot_s"]["p50"], "busy": busy, "outside": r["tpot_s"]["p50"] - busy,
                                               "load": [d["host"]["start"]["loadavg_1_5_15"][0], d["host"]["end_loadavg_1_5_15"][0]]})
labels = {"old": "before, routing counted", "on": "after, --routing-stats", "off": "after, default"}
out = []
print(f"{'model':24} {'loop':24} {'TPOT p50 ms':>24} {'engine ms/forward':>24} {'rest of the step ms':>24}")
for (model, code), runs in sorted(rows.items()):
    cells = {}
    for key in ("tpot", "busy", "outside"):
        v = [x[key] * 1e3 for x in runs]
        cells[key] = (f"{statistics.median(v):.2f} [{min(v):.2f}, {max(v):.2f}]", v)
    print(f"{model:24} {labels[code]:24} {cells['tpot'][0]:>24} {cells['busy'][0]:>24} {cells['outside'][0]:>24}")
    out.append({"model": model, "loop": labels[code], "tpot_p50_ms": cells["tpot"][1],
                "engine_ms_per_forward": cells["busy"][1], "rest_of_step_ms": cells["outside"][1],
                "loadavg_start_end": [x["load"] for x in runs]})
json.dump({"rows": out}, open(os.path.join(root, "summary.json"), "w"), indent=1)
PY
