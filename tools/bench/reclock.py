"""Time to quality from quality curves and a separately measured step clock.

A run's perplexity against its *step* does not depend on the machine that trained it (the same
model, data order and schedule; only the rounding differs), while its *time* per step depends on
the link. So the comparison "perplexity against wall-clock at an all-to-all share of 0.6" can be
taken in two measured parts: the quality curves from runs trained anywhere (several seeds, on a GPU
or an unshaped CPU), and each variant's step time from ``scripts/time_to_quality.py`` on the shaped
link at that share (``over_runs[variant]["mean_step_s"]``: a median over runs with its interval).
The clock at step ``s`` is then ``s x step time``. This holds as long as a variant's step time does
not drift over training; the note beside each figure says how the clock was taken.

Per seed, paired with the baseline's run of the same seed:

* ``target_ppl``: the baseline's final validation perplexity (the paper's "target perplexity" is
  the fine-grained model's);
* ``to_target``: when the variant first reaches it (``tools.bench.ttq.time_to_target``,
  interpolated in perplexity between evaluations), and ``speedup_to_target`` = the baseline's time
  to its own final perplexity over the variant's (None where the variant never reaches it);
* ``speedup_to_own_final``: the other way round, the baseline's time to reach the *variant's* final
  perplexity over the variant's time to it (None where the baseline never reaches it);
* ``baseline_ppl_at_variant_end``: the baseline's perplexity when the variant's clock ends
  (interpolated in clock between evaluations): the two at equal wall-clock.

The command, ``python -m tools.bench.reclock`` (``scripts/ttq_reclock.py``): time to the
baseline's final perplexity on a measured link clock, over seeds. Quality curves come from runs
trained anywhere (``metrics.jsonl`` of pretrain_gpt or time_to_quality, one per variant and seed,
found by ``--pattern``); the step clock of each variant from a ``scripts/time_to_quality.py`` run
on the shaped link (``--clock OUT/ttq.json``, e.g. 30 steps at ``--target-comm-fraction 0.6 --runs
3``). Per seed each variant is paired with the first ``--variants`` entry (the baseline) of the
same seed.

    python -m tools.bench.reclock --clock runs/bigmac_paper_clock/ttq.json \\
        --pattern 'runs/bigmac_paper_cf12/seed{seed}/{variant}/metrics.jsonl' \\
        --seeds 1234,1235,1236 --variants standard,bigmac --json bigmac_cf12.json

``--clock-of NAME=CLOCK_VARIANT`` times a variant with another's clock (an init ablation, or a
longer schedule, has the same step as the layer it varies); ``--pattern-of NAME=PATTERN`` finds one
variant's runs elsewhere (``{seed}`` only). ``--plot PNG`` draws perplexity against the clock: each
variant's median over the seeds, the seeds' range shaded, the target dashed. Besides the medians on
the median clock, the speed-up to target is recomputed at the clock intervals' ends (baseline slow
and variant fast, and the reverse), so the table shows how much the clock's own uncertainty moves it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from tools.bench.aggregate import format_rows
from tools.bench.discipline import interval_name, median_ci
from tools.bench.ttq import Curve, load_curve, time_to_target

__all__ = ["reclocked_points", "ppl_at_clock", "compare_pair", "summarize_pairs", "clock_from_ttq", "SEED_FIGURES",
           "main"]

PROG = "ttq_reclock.py"
SEED_FIGURES = ("final_ppl", "final_vs_baseline", "to_target_step", "to_target_clock_s", "speedup_to_target",
                "speedup_to_own_final", "baseline_ppl_at_variant_end")


def reclocked_points(curve: Curve, step_s: float) -> list[tuple[int, float, float]]:
    """``(step, step x step_s, ppl)`` per evaluation of ``curve``, in step order."""
    if not step_s > 0:
        raise ValueError(f"step time must be positive, got {step_s}")
    return [(step, step * step_s, curve.evals[step]) for step in sorted(curve.evals)]


def ppl_at_clock(points: Sequence[tuple[int, float, float]], clock_s: float) -> Optional[float]:
    """The curve's perplexity at ``clock_s``, linear between the evaluations around it; None outside
    the evaluated span."""
    prev = None
    for _, t, p in points:
        if t == clock_s:
            return p
        if t > clock_s:
            if prev is None:
                return None
            t0, p0 = prev
            return p0 + (p - p0) * (clock_s - t0) / (t - t0)
        prev = (t, p)
    return None


def compare_pair(base: Sequence[tuple[int, float, float]], var: Sequence[tuple[int, float, float]]) -> dict:
    """The figures of one seed (see the module docstring) from two reclocked curves."""
    if not base or not var:
        raise ValueError("both curves need at least one evaluation")
    target = base[-1][2]
    base_hit = time_to_target(base, target)
    var_hit = time_to_target(var, target)
    own = var[-1][2]
    base_own = time_to_target(base, own)
    var_own = time_to_target(var, own)
    return {
        "target_ppl": target,
        "final_ppl": own,
        "final_vs_baseline": own / target,
        "to_target_step": var_hit["step"] if var_hit else None,
        "to_target_clock_s": var_hit["clock_s"] if var_hit else None,
        "baseline_to_target_clock_s": base_hit["clock_s"],
        "speedup_to_target": base_hit["clock_s"] / var_hit["clock_s"] if var_hit else None,
        "speedup_to_own_final": base_own["clock_s"] / var_own["clock_s"] if base_own else None,
        "baseline_ppl_at_variant_end": ppl_at_clock(base, var[-1][1]),
        "variant_clock_s": var[-1][1],
        "baseline_clock_s": base[-1][1],
    }


def summarize_pairs(per_seed: dict) -> dict:
    """``{figure: median_ci over the seeds that have it}`` plus ``reached_target``: "k/n"."""
    rows = list(per_seed.values())
    out = {"seeds": len(rows), "reached_target": f"{sum(r['speedup_to_target'] is not None for r in rows)}/{len(rows)}"}
    for fig in SEED_FIGURES:
        values = [r[fig] for r in rows if r[fig] is not None]
        out[fig] = median_ci(values) if values else None
    return out


def clock_from_ttq(path: str) -> dict:
    """``{variant: {"median", "ci_low", "ci_high", "n"}}`` step seconds from a time_to_quality JSON
    (its ``over_runs``; a single-run file gives the run's mean step with no interval)."""
    with open(path) as f:
        ttq = json.load(f)
    over = ttq.get("over_runs") or {}
    out = {}
    for name, v in ttq["variants"].items():
        ci = (over.get(name) or {}).get("mean_step_s")
        if ci:
            out[name] = {k: ci[k] for k in ("median", "ci_low", "ci_high", "n")}
        elif v.get("mean_step_s"):
            out[name] = {"median": v["mean_step_s"], "ci_low": v["mean_step_s"], "ci_high": v["mean_step_s"], "n": 1}
    if not out:
        raise ValueError(f"{path}: no variant has a step time")
    return out


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description="Time to the baseline's final perplexity on a measured "
                                 "link clock, over seeds (see tools/bench/reclock.py).")
    ap.add_argument("--clock", required=True, help="time_to_quality JSON with each variant's step time on the link")
    ap.add_argument("--pattern", required=True, help="metrics.jsonl path with {variant} and {seed}")
    ap.add_argument("--seeds", required=True, help="comma-separated seeds")
    ap.add_argument("--variants", required=True, help="comma-separated; the first is the baseline")
    ap.add_argument("--clock-of", action="append", default=[], metavar="NAME=CLOCK_VARIANT")
    ap.add_argument("--pattern-of", action="append", default=[], metavar="NAME=PATTERN")
    ap.add_argument("--json", help="write the per-seed figures and the summary here")
    ap.add_argument("--plot", metavar="PNG", help="perplexity against the link clock")
    ap.add_argument("--title", default="", help="the plot's title")
    return ap


def _pairs(ap, flag: str, items) -> dict:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            ap.error(f"{flag}: expected NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def plot(curves: dict, step_s: dict, variants, seeds, target: float, path: str, title: str = "") -> None:
    """Each variant's median perplexity over the seeds against the reclocked time (minutes), the
    seeds' range shaded; the baseline's median final perplexity dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in variants:
        steps = sorted(set.intersection(*(set(curves[v, s].evals) for s in seeds)))
        ppl = np.array([[curves[v, s].evals[k] for k in steps] for s in seeds])
        t = np.array(steps) * step_s[v]["median"] / 60.0
        (line,) = ax.plot(t, np.median(ppl, axis=0), label=f"{v} ({step_s[v]['median'] * 1e3:.0f} ms/step)")
        ax.fill_between(t, ppl.min(axis=0), ppl.max(axis=0), color=line.get_color(), alpha=0.2)
    ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:.1f}")
    ax.set_yscale("log")
    ax.set_ylim(top=min(ax.get_ylim()[1], 4 * target))
    ax.set_xlabel("training time on the link clock (min)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(title or f"median of {len(seeds)} seeds, range shaded", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ci(x, fmt="{:.3f}"):
    if x is None:
        return "-"
    if x["n"] == 1:
        return fmt.format(x["median"])
    return f"{fmt.format(x['median'])} [{fmt.format(x['ci_low'])}-{fmt.format(x['ci_high'])}]"


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds:
        ap.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
    variants = [v for v in args.variants.split(",") if v]
    if len(variants) < 2:
        ap.error("--variants needs a baseline and at least one variant")
    if "{variant}" not in args.pattern or "{seed}" not in args.pattern:
        ap.error("--pattern must contain {variant} and {seed}")
    clock_of, pattern_of = _pairs(ap, "--clock-of", args.clock_of), _pairs(ap, "--pattern-of", args.pattern_of)
    for name, pattern in pattern_of.items():
        if "{seed}" not in pattern:
            ap.error(f"--pattern-of {name}: the pattern must contain {{seed}}")
    try:
        clock = clock_from_ttq(args.clock)
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"--clock {args.clock}: {e}")
    step_s = {}
    for v in variants:
        src = clock_of.get(v, v)
        if src not in clock:
            ap.error(f"--clock {args.clock} has no step time for {src!r} (has: {', '.join(sorted(clock))})")
        step_s[v] = clock[src]

    curves = {}
    for seed in seeds:
        for v in variants:
            path = pattern_of[v].format(seed=seed) if v in pattern_of else args.pattern.format(variant=v, seed=seed)
            if not os.path.exists(path):
                ap.error(f"no metrics for {v} seed {seed}: {path}")
            try:
                curves[v, seed] = load_curve(path)
            except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
                ap.error(f"{path}: unreadable metrics ({e})")
            if not curves[v, seed].evals:
                ap.error(f"{path}: no validation evaluation")

    base = variants[0]
    result = {"clock": args.clock, "step_s": step_s, "pattern": args.pattern, "pattern_of": pattern_of,
              "baseline": base, "variants": {},
              "curves": {v: {str(s): [[k, curves[v, s].evals[k]] for k in sorted(curves[v, s].evals)] for s in seeds}
                         for v in variants}}
    for v in variants[1:]:
        per_seed, bounds = {}, {"variant_fast": [], "variant_slow": []}
        for seed in seeds:
            b, x = curves[base, seed], curves[v, seed]
            per_seed[str(seed)] = compare_pair(reclocked_points(b, step_s[base]["median"]),
                                               reclocked_points(x, step_s[v]["median"]))
            per_seed[str(seed)]["final_step"] = {"baseline": max(b.evals), "variant": max(x.evals)}
            # one clock for both (an ablation): its ends move them together, not apart
            same = clock_of.get(v, v) == clock_of.get(base, base)
            ends = (("variant_fast", "ci_high", "ci_high" if same else "ci_low"),
                    ("variant_slow", "ci_low", "ci_low" if same else "ci_high"))
            for key, bs, vs in ends:
                r = compare_pair(reclocked_points(b, step_s[base][bs]), reclocked_points(x, step_s[v][vs]))
                if r["speedup_to_target"] is not None:
                    bounds[key].append(r["speedup_to_target"])
        summary = summarize_pairs(per_seed)
        summary["speedup_to_target_at_clock_bounds"] = {k: median_ci(vals) if vals else None for k, vals in bounds.items()}
        summary["speedup_per_step"] = step_s[base]["median"] / step_s[v]["median"]
        result["variants"][v] = {"per_seed": per_seed, "summary": summary}

    header = ("variant", "final ppl / baseline", "reached", "step to target", "speed-up to target",
             "(clock ends)", "speed-up to own final", "baseline ppl at its end", "per step")
    rows = []
    base_final = median_ci([curves[base, s].evals[max(curves[base, s].evals)] for s in seeds])
    rows.append((base, f"final ppl {_ci(base_final, '{:.1f}')}", "-", "-", "1", "-", "1", "-",
                 f"{step_s[base]['median'] * 1e3:.0f} ms"))
    for v, r in result["variants"].items():
        s = r["summary"]
        ends = s["speedup_to_target_at_clock_bounds"]
        lo, hi = ends["variant_slow"], ends["variant_fast"]
        rows.append((v, _ci(s["final_vs_baseline"]), s["reached_target"], _ci(s["to_target_step"], "{:.0f}"),
                     _ci(s["speedup_to_target"], "{:.2f}"),
                     f"{lo['median']:.2f}-{hi['median']:.2f}" if lo and hi else "-",
                     _ci(s["speedup_to_own_final"], "{:.2f}"), _ci(s["baseline_ppl_at_variant_end"], "{:.1f}"),
                     f"{s['speedup_per_step']:.2f}x ({step_s[v]['median'] * 1e3:.0f} ms)"))
    print(format_rows(header, rows))
    print(f"medians over seeds [{interval_name(len(seeds), unit='seed')}]")
    if args.plot:
        plot(curves, step_s, variants, seeds, base_final["median"], args.plot, args.title)
        print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
