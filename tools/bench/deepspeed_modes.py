"""DeepSpeed-MoE in its usual modes beside megatron-core's (``python -m tools.bench.deepspeed_modes``,
or ``scripts/deepspeed_modes.py``).

For each mode (dropless, and each capacity factor with token dropping) and each seed, one
``bench_ep.py --variants standard,deepspeed-moe --set moe_expert_capacity_factor=CF`` run on the same
shaped link: ``standard`` is megatron-core's own alltoall dispatcher in that mode (uneven splits of
the kept rows; its ``probs`` drop policy), ``deepspeed-moe`` is DeepSpeed's layer with the same
weights (``drop_tokens=True`` at the same capacity, every expert's buffer padded to it; see
``tools/bench/peers/deepspeed_moe.py``). Seeds vary the initial weights and data order; the variant
order alternates and the mode order rotates between seeds.

Per (mode, stack): step time (median over ranks x steps per run, then the median over seeds with
the range of the seeds, or at 5 seeds or more a 95% bootstrap interval), all-to-all MiB per step
(forward dispatch + combine, per rank), the dropped fraction of routed (token, expert) pairs, the
buffer padding factor, and the LM loss at the end of the short run (rank 0's mean over the last 5
steps; median and range over seeds, and per seed its difference from megatron-core's dropless run
of the same seed: the seeds' spread is larger than the modes' effect at this length, the paired
difference is not).

    sudo .venv/bin/python -m tools.bench.deepspeed_modes --out runs/ds_modes --json docs/figures/deepspeed_modes.json

Resumable: a (mode, seed) whose JSON exists in ``--out`` is not rerun. Extra arguments after ``--``
go to bench_ep (model options such as ``--config``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from tools import repo_root
from tools.bench.aggregate import format_rows
from tools.bench.discipline import interval_name, median_ci

PROG = "deepspeed_modes.py"

STACKS = ("standard", "deepspeed-moe")
LAST = 5  # steps averaged for the end-of-run loss


def mode_name(cf: str) -> str:
    return "dropless" if cf == "none" else f"cf{cf}"


def run_one(args, cf: str, seed: int, order: list, extra: list) -> str:
    path = os.path.join(args.out, f"{mode_name(cf)}-seed{seed}.json")
    if os.path.exists(path):
        return path
    cmd = [sys.executable, os.path.join(repo_root(), "scripts", "bench_ep.py"), "--variants", ",".join(order),
           "--runs", "1", "--seed", str(seed), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--json", path + ".tmp", *extra]
    cmd += ["--link-gbit", str(args.link_gbit)] if args.link_gbit else ["--no-netns"]
    if cf != "none":
        cmd += ["--set", f"moe_expert_capacity_factor={cf}"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    os.replace(path + ".tmp", path)
    return path


def summarize(paths_by_mode: dict) -> dict:
    out = {}
    for mode, paths in paths_by_mode.items():
        runs = [json.load(open(p)) for p in paths]
        out[mode] = {}
        for stack in STACKS:
            steps, mib, losses, loaded = [], [], [], False
            routed = kept = buffer = 0
            for data in runs:
                v = data["variants"][stack]
                steps.append(v["step_time_s"]["median"] * 1e3)
                mib.append(v["a2a_bytes"]["median"] / 2**20)
                rows = v.get("dispatch_rows", {})
                routed += rows.get("routed", 0)
                kept += rows.get("kept", 0)
                buffer += rows.get("buffer", 0)
                rank0 = next(r for r in data["per_rank"][stack][0] if r["rank"] == 0)
                losses.append(statistics.fmean(rank0["extra"]["lm_loss"][-LAST:]))
                loaded |= any(run["load"][stack]["loaded"] for run in data["runs"])
            out[mode][stack] = {
                "step_ms": median_ci(steps), "a2a_mib_per_step": statistics.median(mib),
                "dropped_fraction": 1 - kept / routed if routed else None,
                "padding_factor": buffer / routed if buffer and routed else None,
                "final_lm_loss": {"median": statistics.median(losses), "min": min(losses), "max": max(losses),
                                  "values": losses},
                "loaded": loaded, "seeds": len(runs),
            }
    ref = out.get("dropless", {}).get("standard")
    for stacks in out.values():  # the loss paired by seed with megatron-core's dropless run of that seed
        for s in stacks.values():
            if ref is not None:
                diffs = [a - b for a, b in zip(s["final_lm_loss"]["values"], ref["final_lm_loss"]["values"])]
                s["loss_vs_dropless_standard"] = {"values": diffs, "median": statistics.median(diffs),
                                                  "min": min(diffs), "max": max(diffs)}
    return out


def _paired(d) -> str:
    return "-" if d is None else " ".join(f"{v:+.4f}" for v in d["values"])


def table(summary: dict) -> str:
    rows, seeds = [], 1
    for mode, stacks in summary.items():
        base = stacks["standard"]["step_ms"]["median"]
        for stack, s in stacks.items():
            ci, loss = s["step_ms"], s["final_lm_loss"]
            seeds = max(seeds, ci["n"])
            rows.append((mode, stack + ("*" if s["loaded"] else ""),
                         f"{ci['median']:.1f} [{ci['ci_low']:.1f}-{ci['ci_high']:.1f}]",
                         f"{base / ci['median']:.2f}", f"{s['a2a_mib_per_step']:.3f}",
                         "-" if s["dropped_fraction"] is None else f"{s['dropped_fraction'] * 100:.2f}",
                         "-" if s["padding_factor"] is None else f"{s['padding_factor']:.3f}",
                         f"{loss['median']:.4f} [{loss['min']:.4f}-{loss['max']:.4f}]",
                         _paired(s.get("loss_vs_dropless_standard"))))
    header = ("mode", "stack", f"step ms [{interval_name(seeds, unit='seed')}]", "std/this", "a2a MiB/step",
              "dropped %", "buffer x", f"loss, last {LAST} steps [min-max]", "loss - dropless standard's, per seed")
    return format_rows(header, rows, left=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the bench JSONs (resumable)")
    ap.add_argument("--modes", default="none,1.0,1.25", help="capacity factors; 'none' is dropless")
    ap.add_argument("--seeds", default="1234,1235,1236")
    ap.add_argument("--link-gbit", type=float, default=0.46, help="shaped link per rank (0: unshaped loopback)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", help="write the summary here")
    args, extra = ap.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        bad = [cf for cf in modes if cf != "none" and not float(cf) > 0]
    except ValueError as e:
        ap.error(f"--modes/--seeds: {e}")
    if bad or not modes:
        ap.error(f"--modes: capacity factors > 0 or 'none', got {args.modes!r}")
    os.makedirs(args.out, exist_ok=True)
    paths = {mode_name(cf): [] for cf in modes}
    for i, seed in enumerate(seeds):
        rotated = modes[i % len(modes):] + modes[:i % len(modes)]
        order = list(STACKS) if i % 2 == 0 else list(reversed(STACKS))
        for cf in rotated:
            paths[mode_name(cf)].append(run_one(args, cf, seed, order, extra))
    summary = summarize(paths)
    print(table(summary))
    print(f"step ms: median over {len(seeds)} seeds of each run's median over ranks x steps; std/this: "
          "standard's median step over this row's; * a run taken on a loaded machine")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "link_gbit": args.link_gbit, "warmup": args.warmup,
                       "steps": args.steps, "seeds": seeds, "modes": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
