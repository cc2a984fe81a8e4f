#!/usr/bin/env bash
# The link table netsim's replay reads (`python -m netsim validate --link-table`): gloo all-to-alls
# on the shaped network namespaces at one link rate, both ways and one way (only rank 0 sends),
# after rests of GAPS milliseconds before each call (the shaper's bucket refills while the link
# rests), and gloo all-reduces (every rank sends; what a tensor-parallel run's attention and
# embedding reductions cost) after the same rests. docs/design/netsim.md ("The replay model").
#
#   sudo scripts/calibrate_link_table.sh 0.06654 runs/link_0.06654
#   python -m netsim validate --bench-serve serve.json --link-table runs/link_0.06654/*.csv
#
# Environment: RANKS (default 2), SIZES (input bytes per rank, default 8 KiB..4 MiB), GAPS (ms,
# default "0 2 5 10 20 40 80"; keep the longest above 1.5 x the bucket's refill time, 64 KiB at the
# rate), REPEATS (default 10), PY (default .venv/bin/python). Files that exist are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:?usage: scripts/calibrate_link_table.sh GBIT OUT_DIR}
OUT=${2:?usage: scripts/calibrate_link_table.sh GBIT OUT_DIR}
RANKS=${RANKS:-2}
SIZES=${SIZES:-8192,16384,32768,65536,131072,262144,524288,1048576,2097152,4194304}
GAPS=${GAPS:-0 2 5 10 20 40 80}
REPEATS=${REPEATS:-10}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
for gap in $GAPS; do
  for way in both one ar; do
    op=all_to_all; csv="$OUT/a2a_${way}_${RATE}_r${RANKS}_gap${gap}.csv"
    [ "$way" = ar ] && { op=all_reduce; csv="$OUT/ar_both_${RATE}_r${RANKS}_gap${gap}.csv"; }
    [ -f "$csv" ] && continue
    flag=(); [ "$way" = one ] && flag=(--one-way)
    $PY scripts/bench_ep.py --collectives --link-gbit "$RATE" --calibration-ranks "$RANKS" --ops "$op" \
      --sizes "$SIZES" --repeats "$REPEATS" --gap-ms "$gap" "${flag[@]}" --csv "$csv" > "$OUT/log_${way}_gap$gap.txt"
    echo "wrote $csv"
  done
done
