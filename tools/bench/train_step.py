"""Training step time of checkouts side by side, at several ``--log-interval``s
(``python -m tools.bench.train_step``, or ``scripts/bench_train_step.py``).

Each run trains ``examples/tiny_moe_cpu.yaml`` on 2 ranks under torchrun from one checkout and
reads the loop's own clock from its metrics: seconds per step between step ``--skip`` and the
last step (the first steps pay for warm-up). Runs rotate over (checkout, interval) in a different
order each repeat; the table and JSON give the median and its interval per cell (the range of the
runs, or at 5 runs or more a 95% bootstrap interval: ``tools.bench.discipline.median_ci``; the JSON's
``ci95_ms`` holds it whatever its ``interval_kind``) and the ratio to the first checkout at the same
interval.

    git worktree add /tmp/before <commit before the change>
    scripts/bench_train_step.py --checkout before=/tmp/before --checkout after=. \\
        --log-intervals 1,10 --runs 5 --json docs/figures/train_step_log_interval.json

Take it on a quiet machine (nothing else running): it prints the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from tools import repo_root
from tools.bench.discipline import interval_name, median_ci


def one_run(checkout: str, interval: int, args) -> float:
    """Seconds per step of one training run from ``checkout``."""
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "megatron.training.pretrain_gpt", "--config", os.path.join(repo_root(), "examples/tiny_moe_cpu.yaml"),
               "--train-iters", str(args.train_iters), "--log-interval", str(interval), "--eval-interval", "100000",
               "--eval-iters", "0", "--metrics-file", metrics, "--data-cache-path", args.cache]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.abspath(checkout))
        proc = subprocess.run(cmd, cwd=os.path.abspath(checkout), env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{checkout} --log-interval {interval} failed:\n{proc.stderr[-2000:]}")
        records = [json.loads(line) for line in open(metrics) if line.strip()]
        steps = {r["step"]: r["elapsed_s"] for r in records if "event" not in r and "elapsed_s" in r}
        first = min(s for s in steps if s >= args.skip)
        last = max(steps)
        return (steps[last] - steps[first]) / (last - first)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_train_step.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--log-intervals", default="1,10")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--train-iters", type=int, default=100)
    ap.add_argument("--skip", type=int, default=10, help="first step of the timed span")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    checkouts = dict(c.split("=", 1) for c in args.checkout)
    intervals = [int(x) for x in args.log_intervals.split(",")]
    if args.skip % max(intervals) != 0:
        raise SystemExit("bench_train_step: --skip must be a multiple of every --log-intervals value")
    args.cache = tempfile.mkdtemp(prefix="bench-step-cache-")
    cells = [(name, i) for name in checkouts for i in intervals]
    load_before = os.getloadavg()
    times = {cell: [] for cell in cells}
    for r in range(args.runs):
        order = cells[r % len(cells):] + cells[: r % len(cells)]
        for name, interval in order:
            times[(name, interval)].append(one_run(checkouts[name], interval, args))
            print(f"run {r + 1}/{args.runs}: {name} --log-interval {interval}: {times[(name, interval)][-1] * 1e3:.1f} ms/step",
                  flush=True)
    load_after = os.getloadavg()
    base = list(checkouts)[0]
    rows = []
    for name, interval in cells:
        t = times[(name, interval)]
        ci = median_ci(t)
        lo, hi = ci["ci_low"], ci["ci_high"]
        ratio = statistics.median(t) / statistics.median(times[(base, interval)])
        rows.append({"checkout": name, "log_interval": interval, "ms_per_step": [x * 1e3 for x in t],
                     "median_ms": statistics.median(t) * 1e3, "ci95_ms": [lo * 1e3, hi * 1e3],
                     "interval_kind": ci["interval_kind"], f"ratio_to_{base}": ratio})
    print(f"{'checkout':<10} {'log-interval':>12} {'median ms/step':>15} {'interval':>18} {'vs ' + base:>10}")
    for row in rows:
        lo, hi = row["ci95_ms"]
        print(f"{row['checkout']:<10} {row['log_interval']:>12} {row['median_ms']:>15.1f} "
              f"{f'{lo:.1f}-{hi:.1f}':>18} {row[f'ratio_to_{base}']:>10.3f}")
    print(f"interval: {interval_name(args.runs)}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {**vars(args), "checkouts": checkouts}, "load_before": load_before,
                       "load_after": load_after, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
