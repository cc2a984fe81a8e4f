"""Validation results per configuration, with the spread over a run's repeats.

``python -m netsim validate`` compares the replay's prediction with the figures bench_serve pooled
over all of a run's repeats (``--runs N``). A reader also needs to know how much that error moves
from one repeat to the next: this module takes the same counted points (the same rule, read from
the validation JSON) and computes each figure's mean absolute relative error against every repeat
on its own. It reports; it does not predict (the prediction is the one in the validation JSON).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .validation import FIGURES

__all__ = ["RUN_KEYS", "configuration_report", "format_report", "whatif_pair", "format_pairs", "format_validation"]

# the per-repeat figure in bench_serve's ``runs[i].variants.<v>.<rate>`` for each validated figure
RUN_KEYS = {"ttft_p50_s": "ttft_s.p50", "tpot_p50_s": "tpot_s.p50", "output_tokens_per_s": "output_tokens_per_s"}


def _mean_abs(errors: list) -> Optional[float]:
    return float(np.mean(np.abs(errors))) if errors else None


def configuration_report(name: str, validation: dict, run: dict) -> dict:
    """One configuration: the pooled errors of ``validation`` (a ``netsim-validate/1`` document)
    and, per figure, the mean absolute relative error against each repeat of ``run`` (the
    bench_serve JSON it validated) over the same counted points, with their range."""
    counted = [r for r in validation["rows"] if r["counted"]]
    repeats = run.get("runs") or []
    per_run = {fig: [] for fig in FIGURES}
    overall = []
    loaded = 0
    for rep in repeats:
        errors_all = []
        for fig in FIGURES:
            errors = []
            for r in (r for r in counted if r["figure"] == fig):
                measured = rep["variants"][r["variant"]][r["rate"]].get(RUN_KEYS[fig])
                if measured:
                    errors.append((r["predicted"] - measured) / measured)
            per_run[fig].append(_mean_abs(errors))
            errors_all += errors
        overall.append(_mean_abs(errors_all))
        loaded += sum(bool(v.get("loaded")) for v in rep.get("load", {}).values())
    figures = {}
    for fig in FIGURES:
        pooled = validation["by_figure"].get(fig, {})
        runs = [e for e in per_run[fig] if e is not None]
        figures[fig] = {"pooled": pooled.get("mean_abs_rel_error"), "max_point": pooled.get("max_abs_rel_error"),
                        "points": pooled.get("points"), "per_run": per_run[fig],
                        "run_range": [min(runs), max(runs)] if runs else None}
    runs = [e for e in overall if e is not None]
    return {"name": name, "bench_serve": validation.get("bench_serve"), "model_version": validation.get("model_version"),
            "code_version": validation.get("code_version"), "repeats": len(repeats),
            "loaded_marks": loaded, "measurements": sum(len(rep.get("load", {})) for rep in repeats),
            "figures": figures,
            "all": {"pooled": validation.get("mean_abs_rel_error"), "max_point": validation.get("max_abs_rel_error"),
                    "points": validation.get("points"), "per_run": overall,
                    "run_range": [min(runs), max(runs)] if runs else None}}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_report(reports: list, goal: float = 0.15) -> str:
    """A markdown table: per configuration and figure the pooled error, the range over the
    repeats and the largest single point; and whether every pooled figure meets ``goal``."""
    lines = ["| configuration | figure | pooled error | range over repeats | largest point | points |",
             "|---|---|---|---|---|---|"]
    missed = []
    for rep in reports:
        for fig, f in (*rep["figures"].items(), ("all counted", rep["all"])):
            rng = f["run_range"]
            spread = "-" if rng is None else f"{_pct(rng[0])} - {_pct(rng[1])} (n = {rep['repeats']})"
            lines.append(f"| {rep['name']} | {fig} | {_pct(f['pooled'])} | {spread} | {_pct(f['max_point'])} | "
                         f"{f['points'] or 0} |")
            if f["pooled"] is not None and f["pooled"] > goal:
                missed.append(f"{rep['name']} {fig}")
    versions = sorted({rep["model_version"] for rep in reports})
    loads = ", ".join(f"{rep['name']} {rep['loaded_marks']}/{rep['measurements']}" for rep in reports)
    lines.append("")
    lines.append(f"model {', '.join(map(str, versions))}; measurements marked loaded: {loads}")
    lines.append(f"goal (every pooled figure <= {_pct(goal)}): " + ("met" if not missed else "missed by " + ", ".join(missed)))
    return "\n".join(lines)


def whatif_pair(base: str, base_validation: dict, whatif: str, whatif_validation: dict) -> dict:
    """A what-if question (one setting changed from a base configuration): per variant, rate and
    figure counted in both validations, the change the runs measured (``whatif / base``), the change
    the model predicted, and the error of the predicted change (``predicted / measured - 1``); per
    figure their mean absolute value. A model can be off in both runs alike and still answer the
    question: this is the error a user asking it sees."""
    def rows(validation):
        return {(r["variant"], r["rate"], r["figure"]): r for r in validation["rows"] if r["counted"]}

    a, b = rows(base_validation), rows(whatif_validation)
    points = []
    for key in sorted(a.keys() & b.keys()):
        ra, rb = a[key], b[key]
        if not (ra["measured"] and ra["predicted"] and rb["measured"]):
            continue
        measured, predicted = rb["measured"] / ra["measured"], rb["predicted"] / ra["predicted"]
        points.append({"variant": key[0], "rate": key[1], "figure": key[2], "measured_change": measured,
                       "predicted_change": predicted, "error": predicted / measured - 1})
    figures = {fig: _mean_abs([p["error"] for p in points if p["figure"] == fig]) for fig in FIGURES}
    return {"base": base, "whatif": whatif, "points": points, "figures": figures}


def format_pairs(pairs: list) -> str:
    """A markdown table: per what-if pair and figure the mean absolute error of the predicted change."""
    lines = ["| what-if | figure | measured change (range) | error of the predicted change | points |",
             "|---|---|---|---|---|"]
    for pair in pairs:
        for fig in FIGURES:
            pts = [p for p in pair["points"] if p["figure"] == fig]
            if not pts:
                continue
            changes = [p["measured_change"] for p in pts]
            lines.append(f"| {pair['whatif']} vs {pair['base']} | {fig} | x{min(changes):.2f}-x{max(changes):.2f} | "
                         f"{_pct(pair['figures'][fig])} | {len(pts)} |")
    return "\n".join(lines)


def format_validation(res: dict) -> str:
    """One validation (``validate_run``'s result) as the table ``netsim validate`` prints: every
    point, then the error per figure and over all counted points."""
    lines = [f"{'variant':<12}{'rate':>6}  {'figure':<20}{'measured':>10}{'predicted':>11}{'rel err':>9}"]
    for r in res["rows"]:
        scale, unit = (1e3, "ms") if r["figure"].endswith("_s") and not r["figure"].endswith("per_s") else (1.0, "")
        m = "-" if r["measured"] is None else f"{r['measured'] * scale:.1f}{unit}"
        p = "-" if r["predicted"] is None else f"{r['predicted'] * scale:.1f}{unit}"
        e = "-" if r["relative_error"] is None else f"{r['relative_error'] * 100:+.1f}%"
        note = "  (offered-load bound: not counted)" if r["relative_error"] is not None and not r["counted"] else ""
        lines.append(f"{r['variant']:<12}{r['rate']:>6}  {r['figure']:<20}{m:>10}{p:>11}{e:>9}{note}")
    for fig, f in res["by_figure"].items():
        lines.append(f"{fig:<20} mean absolute relative error {_pct(f['mean_abs_rel_error'])} over {f['points']} "
                     f"points (max {_pct(f['max_abs_rel_error'])})")
    lines.append(f"mean absolute relative error over {res['points']} points: {_pct(res['mean_abs_rel_error'])} "
                 f"(max {_pct(res['max_abs_rel_error'])}); every point, throughput below saturation included: "
                 f"{_pct(res['mean_abs_rel_error_all_points'])} over {res['all_points']}")
    lines += [f"note: {v} was served with {why}" for v, why in res["unmodelled"].items()]
    return "\n".join(lines)
