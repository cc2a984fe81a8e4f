"""A bounded chaos run: random faults of every kind during tiny-MoE training under torchrun.

Trains ``examples/tiny_moe_cpu.yaml`` (2 CPU ranks, EP=2) twice for ``--train-iters`` steps: once
without faults (the baseline), once under ``torchrun --max-restarts`` with ``--save D --load D``
while this script injects ``--faults`` random faults, one at a time, each ``--gap`` seconds (uniform)
after the job last made progress: ``kill -9`` or ``SIGSTOP`` of a random rank from outside, or a
segfault, ``abort()``, a Python spin, native code holding the GIL or an exception inside it
(``megatron.training.faults``). Prints a table and writes JSON:

- per fault: its kind and rank, the seconds until torchrun saw a rank exit (**detected**) and until
  the restarted job logged its first step (**recovered**), the steps redone;
- **throughput kept**: baseline wall time / chaos wall time for the same steps;
- **loss continuity**: the chaos run's per-step loss against the baseline's at the same steps (the
  resume restores weights, optimizer, data position and RNG, so the curves should coincide).

    scripts/chaos_run.sh OUT_DIR [--faults 20] [--train-iters 1500]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron.training import faults  # noqa: E402

EXTERNAL = ("sigkill", "sigstop")
KINDS = EXTERNAL + ("segfault", "abort", "spin", "gil", "error")


def train_cmd(args, save: str, restarts: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            f"--max-restarts={restarts}", "-m", "megatron.training.pretrain_gpt",
            "--config", "examples/tiny_moe_cpu.yaml", "--train-iters", str(args.train_iters),
            "--save", save, "--load", save, "--save-interval", str(args.save_interval), "--log-interval", "1",
            "--eval-interval", "100000", "--eval-iters", "0", "--data-cache-path", os.path.join(args.out, "cache"),
            "--heartbeat-timeout", str(args.heartbeat_timeout), "--step-timeout", str(args.step_timeout)]


def launch(args, name: str, restarts: int, env: dict):
    log_path = os.path.join(args.out, f"{name}.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(train_cmd(args, os.path.join(args.out, name), restarts), cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **env))
    return proc, log_path


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def attempts(text: str) -> list[list[int]]:
    """The steps each attempt logged, in order ("starting at iteration" opens an attempt)."""
    out = []
    for line in text.splitlines():
        if "starting at iteration" in line:
            out.append([])
        m = re.match(r"iter\s+(\d+)/", line)
        if m and out:
            out[-1].append(int(m[1]))
    return out


def failures_at(text: str) -> list[float]:
    """Epoch times of torchrun's "failed (exitcode" lines (the agent saw a rank exit)."""
    year = datetime.date.today().year
    times = []
    for m in re.finditer(r"^E(\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) .*failed \(exitcode", text, re.M):
        t = datetime.datetime.strptime(f"{year}-{m[1]}-{m[2]} {m[3]}", "%Y-%m-%d %H:%M:%S.%f")
        times.append(t.timestamp())
    return times


def ranks_of(agent: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(agent)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def losses(save: str) -> dict:
    path = os.path.join(save, "metrics.jsonl")
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "event" not in r:
                out[r["step"]] = r["lm_loss"]
    return out


def wait_progress(log_path: str, proc, since_attempts: int, timeout: float = 600) -> bool:
    """Until an attempt after the first ``since_attempts`` has logged a step (or the job ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        a = attempts(read(log_path))
        if len(a) > since_attempts and a[-1]:
            return True
        time.sleep(0.2)
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--train-iters", type=int, default=1500)
    ap.add_argument("--save-interval", type=int, default=20)
    ap.add_argument("--gap", type=float, nargs=2, default=(5.0, 25.0), metavar=("MIN", "MAX"),
                    help="seconds of progress before each fault (uniform)")
    ap.add_argument("--heartbeat-timeout", type=float, default=10.0)
    ap.add_argument("--step-timeout", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-baseline", action="store_true", help="reuse OUT/baseline from an earlier run")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)

    # the fault-free baseline
    if not (args.skip_baseline and os.path.isfile(os.path.join(args.out, "baseline", "metrics.jsonl"))):
        start = time.monotonic()
        proc, log = launch(args, "baseline", 0, {})
        if proc.wait() != 0:
            print(f"chaos_run: the baseline failed; see {log}", file=sys.stderr)
            return 1
        baseline_s = time.monotonic() - start
        with open(os.path.join(args.out, "baseline.json"), "w") as f:
            json.dump({"wall_s": baseline_s}, f)
    with open(os.path.join(args.out, "baseline.json")) as f:
        baseline_s = json.load(f)["wall_s"]

    fault_dir = os.path.join(args.out, "faults")
    os.makedirs(fault_dir, exist_ok=True)
    start = time.monotonic()
    proc, log = launch(args, "chaos", args.faults + 5, {faults.ENV: fault_dir})
    injected = []
    try:
        while len(injected) < args.faults and proc.poll() is None:
            if not wait_progress(log, proc, len(attempts(read(log))) - 1 if injected else 0):
                break
            time.sleep(rng.uniform(*args.gap))
            if proc.poll() is not None:
                break
            kind, rank = rng.choice(KINDS), rng.randrange(2)
            seen = len(attempts(read(log)))
            ranks = ranks_of(proc.pid)
            if len(ranks) < 2:
                continue
            at = time.time()
            if kind == "sigkill":
                os.kill(ranks[rank], signal.SIGKILL)
            elif kind == "sigstop":
                os.kill(ranks[rank], signal.SIGSTOP)
            else:
                faults.request(fault_dir, rank, kind)
            injected.append({"kind": kind, "rank": rank, "at": at, "attempt": seen})
            print(f"chaos_run: fault {len(injected)}/{args.faults}: {kind} on rank {rank}", flush=True)
            # the next fault only once the job has restarted and made progress
            if not wait_progress(log, proc, seen):
                break
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    chaos_s = time.monotonic() - start

    text = read(log)
    runs = attempts(text)
    fails = failures_at(text)
    rows = []
    for i, f in enumerate(injected):
        after = [t for t in fails if t >= f["at"] - 1]
        detected = (after[0] - f["at"]) if after else None
        before = runs[f["attempt"] - 1] if f["attempt"] - 1 < len(runs) else []
        resumed = runs[f["attempt"]] if f["attempt"] < len(runs) else []
        redone = (max(before) - min(resumed) + 1) if before and resumed else None
        rows.append({**f, "detected_s": detected, "steps_redone": redone})
    base, chaos = losses(os.path.join(args.out, "baseline")), losses(os.path.join(args.out, "chaos"))
    common = sorted(set(base) & set(chaos))
    diffs = [abs(base[s] - chaos[s]) for s in common]
    resumed_at = [r[0] for r in runs[1:] if r]
    result = {
        "config": vars(args),
        "exit_code": code,
        "baseline_wall_s": baseline_s,
        "chaos_wall_s": chaos_s,
        "throughput_kept": baseline_s / chaos_s,
        "faults": rows,
        "attempts": len(runs),
        "steps_redone": sum(r["steps_redone"] or 0 for r in rows),
        "final_step": max(chaos) if chaos else None,
        "loss_steps_compared": len(common),
        "loss_max_abs_diff": max(diffs) if diffs else None,
        "loss_max_abs_diff_at_resumes": max((abs(base[s] - chaos[s]) for s in resumed_at if s in base and s in chaos),
                                            default=None),
    }
    with open(os.path.join(args.out, "chaos.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'#':>3} {'fault':<9} {'rank':>4} {'detected s':>10} {'steps redone':>12}")
    for i, r in enumerate(rows, 1):
        det = f"{r['detected_s']:.1f}" if r["detected_s"] is not None else "-"
        print(f"{i:>3} {r['kind']:<9} {r['rank']:>4} {det:>10} {r['steps_redone'] if r['steps_redone'] is not None else '-':>12}")
    print(f"exit code {code}; {len(rows)} faults, {len(runs)} attempts, finished at step {result['final_step']}/"
          f"{args.train_iters}; wall {chaos_s:.0f} s vs {baseline_s:.0f} s fault-free: throughput kept "
          f"{result['throughput_kept']:.2f}; steps redone {result['steps_redone']}; loss vs fault-free over "
          f"{len(common)} steps: max |diff| {result['loss_max_abs_diff']}")
    return 0 if code == 0 and result["final_step"] == args.train_iters else 1


if __name__ == "__main__":
    sys.exit(main())
