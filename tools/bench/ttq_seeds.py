"""Time to quality over several seeds: ``scripts/time_to_quality.py`` once per seed, then intervals
(``python -m tools.bench.ttq_seeds``, or ``scripts/ttq_seeds.py``).

``time_to_quality.py --runs N`` repeats one seed (the curves repeat; only the clocks vary). A claim
about quality (final perplexity, whether a variant reaches standard's) needs different seeds, i.e.
different initial weights and data order. This runs the comparison once per ``--seeds`` entry in
``OUT/seed<S>/`` (resumable: time_to_quality skips finished variants and resumes the others), the
variant order rotated by one per seed (time_to_quality's ``--rotate``), and summarizes per variant:

* ``final_ppl``, ``best_ppl``: the last and the lowest validation perplexity of each seed's run;
* ``final_ppl_vs_standard``: the per-seed (paired) ratio of the variant's final perplexity to
  standard's (same seed, so the same initial weights where the model shapes agree, and the same data);
* ``speedup_to_target``: standard's time to its own best perplexity over the variant's (None in a
  seed where the variant does not reach it; the count that reached is reported);
* ``speedup_per_step``, ``mean_step_s``, ``a2a_share_median``;

each as the median over seeds with the range of the seeds, or at 5 seeds or more a 95% bootstrap
interval (``tools.bench.discipline.median_ci``).

    sudo .venv/bin/python -m tools.bench.ttq_seeds --out runs/ttq_farskip --seeds 1234,1235,1236 \\
        --variants standard,farskip -- --config examples/corpus_moe_cpu.yaml --link-gbit 0.1824 \\
        --fixed-link --steps 300 --eval-interval 50

Arguments after ``--`` go to time_to_quality.py (not ``--out``, ``--seed``, ``--variants``, ``--runs``).
``--variants`` defaults to time_to_quality's (``tools.bench.ttq.default_variants``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from tools import repo_root
from tools.bench.aggregate import format_rows
from tools.bench.discipline import interval_name, median_ci
from tools.bench.ttq import default_variants

PROG = "ttq_seeds.py"

FIGURES = ("final_ppl", "best_ppl", "final_ppl_vs_standard", "speedup_to_target", "speedup_per_step",
           "mean_step_s", "a2a_share_median")
RESERVED = ("--out", "--seed", "--variants", "--rotate", "--runs", "--report-only")


def seed_figures(ttq: dict) -> dict:
    """Per variant, the figures of one seed's ``ttq.json`` (its first run)."""
    base = ttq["variants"]["standard"]
    base_final = base["evaluations"][-1]["ppl"] if base["evaluations"] else None
    out = {}
    for name, v in ttq["variants"].items():
        final = v["evaluations"][-1]["ppl"] if v["evaluations"] else None
        out[name] = {"final_ppl": final, "best_ppl": v["best_ppl"], "done": v["done"],
                     "final_ppl_vs_standard": final / base_final if final and base_final else None,
                     "speedup_to_target": v["speedup_to_target"], "speedup_per_step": v["speedup_per_step"],
                     "mean_step_s": v["mean_step_s"], "a2a_share_median": v["a2a_share_median"]}
    return out


def summarize(per_seed: dict) -> dict:
    """``{variant: {figure: median_ci over the seeds that have it, "reached_target": k of n}}``."""
    variants = sorted({name for figs in per_seed.values() for name in figs})
    out = {}
    for name in variants:
        rows = [figs[name] for figs in per_seed.values() if name in figs]
        out[name] = {"seeds": len(rows), "reached_target": sum(r["speedup_to_target"] is not None for r in rows)}
        for fig in FIGURES:
            values = [r[fig] for r in rows if r[fig] is not None]
            out[name][fig] = median_ci(values) if values else None
    return out


def table(summary: dict) -> str:
    def ci(x, fmt):
        if x is None:
            return "-"
        return f"{fmt.format(x['median'])} [{fmt.format(x['ci_low'])}-{fmt.format(x['ci_high'])}]"

    rows = [(name, str(s["seeds"]), ci(s["final_ppl"], "{:.1f}"), ci(s["final_ppl_vs_standard"], "{:.3f}"),
             ci(s["best_ppl"], "{:.1f}"), f"{s['reached_target']}/{s['seeds']}", ci(s["speedup_to_target"], "{:.2f}"),
             ci(s["speedup_per_step"], "{:.2f}"), ci(s["a2a_share_median"], "{:.3f}"))
            for name, s in summary.items()]
    header = ("variant", "seeds", "final ppl", "final / standard's", "best ppl", "reached target",
              "speedup to target", "speedup per step", "a2a share")
    return format_rows(header, rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="1234,1235,1236")
    ap.add_argument("--variants", default=",".join(default_variants()), help="comma-separated bench presets, "
                    "standard first (default: time_to_quality's)")
    ap.add_argument("--report-only", action="store_true", help="summarize the seeds run so far")
    args, ttq_args = ap.parse_known_args(argv)
    ttq_args = [a for a in ttq_args if a != "--"]
    for a in ttq_args:
        if a.split("=")[0] in RESERVED:
            ap.error(f"{a.split('=')[0]} is set by {PROG}; drop it after --")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or variants[0] != "standard":
        ap.error("--variants must start with standard (the target and the paired baseline)")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
    per_seed = {}
    for i, seed in enumerate(seeds):
        out = os.path.join(args.out, f"seed{seed}")
        if not args.report_only:
            cmd = [sys.executable, os.path.join(repo_root(), "scripts", "time_to_quality.py"), "--out", out,
                   "--seed", str(seed), "--variants", ",".join(variants), "--rotate", str(i), "--runs", "1",
                   *ttq_args]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        path = os.path.join(out, "ttq.json")
        if os.path.exists(path):
            with open(path) as f:
                per_seed[seed] = seed_figures(json.load(f))
    if not per_seed:
        print("ttq_seeds: no seed has a ttq.json yet", file=sys.stderr)
        return 1
    summary = summarize(per_seed)
    print(table(summary))
    print(f"medians over seeds [{interval_name(len(per_seed), unit='seed')}]; "
          f"per seed: {os.path.join(args.out, 'seeds.json')}")
    with open(os.path.join(args.out, "seeds.json"), "w") as f:
        json.dump({"command": sys.argv, "seeds": seeds, "per_seed": per_seed, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
