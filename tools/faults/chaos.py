"""``python -m tools.faults chaos OUT [--faults 20] [--train-iters 1500]``: a bounded chaos run,
random faults of every kind during tiny-MoE training under torchrun.

Trains ``examples/tiny_moe_cpu.yaml`` (2 CPU ranks, EP=2) twice for ``--train-iters`` steps: once
without faults (the baseline), once under ``torchrun --max-restarts`` with ``--save D --load D``
while this command injects ``--faults`` random faults, one at a time, each ``--gap`` seconds
(uniform) after the job last made progress: ``kill -9`` or ``SIGSTOP`` of a random rank from
outside, or a segfault, ``abort()``, a Python spin, native code holding the GIL or an exception
inside it (``tools.faults.inject`` through ``tools.faults.rank``). Prints a table and writes
``OUT/chaos.json``:

- per fault: its kind and rank, the seconds until torchrun saw a rank exit (**detected**), the
  steps redone;
- **throughput kept**: baseline wall time / chaos wall time for the same steps;
- **loss continuity**: the chaos run's per-step loss against the baseline's at the same steps (the
  resume restores weights, optimizer, data position and RNG, so the curves should coincide).

About 2 x (train-iters x step time) + faults x (detection + restart); take it on a quiet machine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

from megatron.common.files import write_json
from tools.faults import inject
from tools.faults.launch import Launches, agent_failures, attempts, rank_pid, read

__all__ = ["KINDS", "chaos_run"]

EXTERNAL = ("sigkill", "sigstop")
KINDS = EXTERNAL + ("segfault", "abort", "spin", "gil", "error")


def _train_args(args, save: str) -> list:
    return ["--config", "examples/tiny_moe_cpu.yaml", "--train-iters", args.train_iters, "--save", save, "--load", save,
            "--save-interval", args.save_interval, "--log-interval", 1, "--eval-interval", 100000, "--eval-iters", 0,
            "--data-cache-path", os.path.join(args.out, "cache"), "--heartbeat-timeout", args.heartbeat_timeout,
            "--step-timeout", args.step_timeout]


def _losses(save: str) -> dict:
    out = {}
    for line in read(os.path.join(save, "metrics.jsonl")).splitlines():
        r = json.loads(line)
        if "event" not in r:
            out[r["step"]] = r["lm_loss"]
    return out


def _wait_progress(log_path: str, proc, since_attempts: int, timeout: float = 600) -> bool:
    """Until an attempt after the first ``since_attempts`` has logged a step (or the job ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        a = attempts(read(log_path))
        if len(a) > since_attempts and a[-1]:
            return True
        time.sleep(0.2)
    return False


def chaos_run(args) -> int:
    """The run ``args`` (the ``chaos`` command's flags) describe; 0 when the chaos run finished."""
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)
    launches = Launches(args.out)
    baseline_json = os.path.join(args.out, "baseline.json")
    try:
        if not (args.skip_baseline and os.path.isfile(os.path.join(args.out, "baseline", "metrics.jsonl"))):
            start = time.monotonic()
            code = launches.run("baseline", ["megatron.training.pretrain_gpt"],
                                _train_args(args, os.path.join(args.out, "baseline")), timeout=24 * 3600)
            if code != 0:
                print(f"chaos: the baseline failed; see {os.path.join(args.out, 'baseline.log')}", file=sys.stderr)
                return 1
            write_json(baseline_json, {"wall_s": time.monotonic() - start})
        with open(baseline_json) as f:
            baseline_s = json.load(f)["wall_s"]

        fault_dir = os.path.join(args.out, "faults")
        os.makedirs(fault_dir, exist_ok=True)
        start = time.monotonic()
        proc, log = launches.start("chaos", ["tools.faults.rank", "pretrain_gpt"],
                                   _train_args(args, os.path.join(args.out, "chaos")),
                                   launcher=[f"--max-restarts={args.faults + 5}"], env={inject.ENV: fault_dir})
        injected = []
        while len(injected) < args.faults and proc.poll() is None:
            if not _wait_progress(log, proc, len(attempts(read(log))) - 1 if injected else 0):
                break
            time.sleep(rng.uniform(*args.gap))
            if proc.poll() is not None:
                break
            kind, rank = rng.choice(KINDS), rng.randrange(2)
            seen = len(attempts(read(log)))
            try:
                pid = rank_pid(proc.pid, rank, timeout=5)
            except RuntimeError:  # between attempts
                continue
            at = time.time()
            if kind in EXTERNAL:
                os.kill(pid, signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
            else:
                inject.request(fault_dir, rank, kind)
            injected.append({"kind": kind, "rank": rank, "at": at, "attempt": seen})
            print(f"chaos: fault {len(injected)}/{args.faults}: {kind} on rank {rank}", flush=True)
            # the next fault only once the job has restarted and made progress
            if not _wait_progress(log, proc, seen):
                break
        code = proc.wait()
    finally:
        launches.close()
    chaos_s = time.monotonic() - start

    text = read(log)
    runs = attempts(text)
    fails = agent_failures(text)
    rows = []
    for f in injected:
        after = [t for t in fails if t >= f["at"] - 1]
        before = runs[f["attempt"] - 1] if f["attempt"] - 1 < len(runs) else []
        resumed = runs[f["attempt"]] if f["attempt"] < len(runs) else []
        rows.append({**f, "detected_s": (after[0] - f["at"]) if after else None,
                     "steps_redone": (max(before) - min(resumed) + 1) if before and resumed else None})
    base, chaos = _losses(os.path.join(args.out, "baseline")), _losses(os.path.join(args.out, "chaos"))
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
    write_json(os.path.join(args.out, "chaos.json"), result)
    print(f"{'#':>3} {'fault':<9} {'rank':>4} {'detected s':>10} {'steps redone':>12}")
    for i, r in enumerate(rows, 1):
        det = f"{r['detected_s']:.1f}" if r["detected_s"] is not None else "-"
        redone = r["steps_redone"] if r["steps_redone"] is not None else "-"
        print(f"{i:>3} {r['kind']:<9} {r['rank']:>4} {det:>10} {redone:>12}")
    print(f"exit code {code}; {len(rows)} faults, {len(runs)} attempts, finished at step {result['final_step']}/"
          f"{args.train_iters}; wall {chaos_s:.0f} s vs {baseline_s:.0f} s fault-free: throughput kept "
          f"{result['throughput_kept']:.2f}; steps redone {result['steps_redone']}; loss vs fault-free over "
          f"{len(common)} steps: max |diff| {result['loss_max_abs_diff']}")
    return 0 if code == 0 and result["final_step"] == args.train_iters else 1
