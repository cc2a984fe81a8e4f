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
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from tools.bench.discipline import median_ci
from tools.bench.ttq import Curve, time_to_target

__all__ = ["reclocked_points", "ppl_at_clock", "compare_pair", "summarize_pairs", "clock_from_ttq", "SEED_FIGURES"]

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
