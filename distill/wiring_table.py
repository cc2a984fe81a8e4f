"""FCSD under FarSkip's two wirings side by side (``scripts/fcsd_wirings.sh``): tables and their JSON.

    python -m distill.wiring_table --seeds RUNS/wirings_report_s{1234,1235,1236}.json \\
        --untrained RUNS/untrained_reference.json RUNS/untrained_paper-text.json --num-layers 8 \\
        [--json OUT.json] [--out OUT.md] [--converged-delta 0.02] [--converged-evals 2]

``--seeds``: one ``distill.report`` per seed (students labelled ``"... [last:4 of 8, paper-text]
(seed N)"``; each row's wiring is its ``farskip_connectivity``, else the label's). ``--untrained``:
reports of untrained conversions (``--untrained SPEC[@MODE]``) under either wiring. Tables:

* students: per row and wiring, held-out perplexity (mean ± sample sd over seeds), gap to the
  teacher, KL, and the change from KL on all layers (``KL (FAR 100%)``) seed by seed (same seed:
  same data order) as the mean and range of the seeds, with its direction: in how many seeds the row
  was better, and whether that is the way the paper's AVG-11 moved;
* the wirings: ``reference`` against ``paper-text`` for the same layers and seed;
* convergence: each student's held-out KL proxy at every evaluation, from its ``metrics.jsonl``;
* Fig. 3 (first N vs last N layers converted untrained, last N per wiring) and the sub-blocks
  (attention only, MoE only, both) per wiring.

Converged: a student whose held-out KL proxy improved on its best by less than ``--converged-delta``
(relative, default 2%, the early-stopping delta of ``examples/fcsd_tiny_cpu.yaml``) over its last
``--converged-evals`` evaluations (default 2), or whose run early stopping ended. A comparison is
worded "direction only" unless every student in it converged in every seed.

A run's ``metrics.jsonl`` is looked for in ``<the report's folder>/<run>/``, then in the folder of the
row's checkpoint (``.../<run>/best``): the committed layout keeps each run's log beside the reports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from typing import Optional, Sequence

from megatron.common.cli import UserError, one_line, positive_int, run_cli
from megatron.common.files import write_text
from distill.ablation_table import DEFAULT_ROW, PAPER_TABLE2, mean_sd, paper_key, rows_by_seed

__all__ = ["WIRINGS", "run_log", "converged", "students_table", "wirings_table", "untrained_tables", "build", "markdown",
           "main"]

WIRINGS = ("reference", "paper-text")
_WIRING_IN_LABEL = re.compile(r"\[[^\]]*, (reference|paper-text)\]")


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such report")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as err:
        raise UserError(f"{path}: not a JSON report ({one_line(err)})") from None


def run_log(checkpoint: Optional[str], report_dir: str) -> Optional[dict]:
    """``{"curve": {step: held-out KL}, "early_stop": ...}`` from the run's ``metrics.jsonl``
    (``<report_dir>/<run>/`` first, then the checkpoint's run folder); None when neither exists."""
    if not checkpoint:
        return None
    run_dir = os.path.dirname(os.path.normpath(checkpoint))
    for path in (os.path.join(report_dir, os.path.basename(run_dir), "metrics.jsonl"), os.path.join(run_dir, "metrics.jsonl")):
        if os.path.isfile(path):
            break
    else:
        return None
    curve, early_stop = {}, None
    with open(path) as f:
        for line in f:
            ev = json.loads(line)
            if ev.get("event") == "valid" and "heldout_kl" in ev:
                curve[int(ev["step"])] = ev["heldout_kl"]
            elif ev.get("event") == "summary" and not ev.get("interrupted"):
                early_stop = ev.get("early_stop")
    return {"curve": curve, "early_stop": early_stop, "metrics": path}


def converged(log: Optional[dict], delta: float, evals: int) -> dict:
    """The convergence rule (module docstring) on one run's log: ``converged`` is True, False or None
    (no log, or fewer than ``evals + 1`` evaluations); ``last_change`` is the relative change of the
    best proxy value over the last ``evals`` evaluations."""
    if log is None:
        return {"converged": None, "last_change": None, "why": "no metrics.jsonl"}
    if log.get("early_stop"):
        return {"converged": True, "last_change": None, "why": "early stopping ended the run"}
    steps = sorted(log["curve"])
    if len(steps) < evals + 1:
        return {"converged": None, "last_change": None, "why": f"{len(steps)} evaluation(s)"}
    before = min(log["curve"][s] for s in steps[:-evals])
    after = min(log["curve"][s] for s in steps[-evals:])
    change = after / before - 1.0 if before else 0.0
    return {"converged": change > -delta, "last_change": change,
            "why": f"best held-out KL {change:+.1%} over the last {evals} evaluations"}


def _wiring(row: dict) -> Optional[str]:
    if row.get("farskip_connectivity"):
        return row["farskip_connectivity"]
    m = _WIRING_IN_LABEL.search(row["model"])
    return m.group(1) if m else None


def _layers(spec: Optional[str], num_layers: int) -> str:
    m = re.fullmatch(r"(first|last):(\d+)", spec or "")
    count = num_layers if spec == "all" else int(m.group(2)) if m else None
    return (spec or "none") + (f" ({100 * count / num_layers:.1f}%)" if count else "")


def _range(values: Sequence[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def _all_converged(verdicts: Sequence[dict]) -> Optional[bool]:
    flags = [v["converged"] for v in verdicts]
    if any(f is False for f in flags):
        return False
    return None if any(f is None for f in flags) else True


def students_table(reports: Sequence[tuple[dict, str]], num_layers: int, delta: float, evals: int) -> list[dict]:
    """One entry per (row, wiring) of the seeded reports, with its per-seed figures, convergence and
    its change from ``DEFAULT_ROW`` seed by seed."""
    by_label = rows_by_seed([r for r, _ in reports])
    report_dir = {}
    for report, folder in reports:
        for row in report.get("rows", []):
            report_dir[row["model"]] = folder
    default_label = next((label for label in by_label if paper_key(label) == DEFAULT_ROW), None)
    entries = []
    for label, seeds in by_label.items():
        ordered = sorted(seeds.items(), key=lambda kv: kv[0] or 0)
        rows = [r for _, r in ordered]
        key = paper_key(label)
        entry = {"row": key, "label": label, "farskip": rows[0].get("farskip"), "wiring": _wiring(rows[0]),
                 "layers": _layers(rows[0].get("farskip"), num_layers), "seeds": [s for s, _ in ordered],
                 "ppl": [r["ppl"] for r in rows], "ppl_gap_to_teacher": [r["ppl_gap_to_teacher"] for r in rows],
                 "kl_to_teacher": [r.get("kl_to_teacher") for r in rows], "checkpoints": [r.get("checkpoint") for r in rows]}
        entry["ppl_stats"], entry["gap_stats"] = mean_sd(entry["ppl"]), mean_sd(entry["ppl_gap_to_teacher"])
        kls = [k for k in entry["kl_to_teacher"] if k is not None]
        entry["kl_stats"] = mean_sd(kls) if kls else None
        if any(entry["checkpoints"]):  # a student: its proxy curve per seed and the convergence verdict
            logs = [run_log(c, report_dir.get(r["model"], ".")) for c, r in zip(entry["checkpoints"], rows)]
            entry["curves"] = {str(s): (log or {}).get("curve") for s, log in zip(entry["seeds"], logs)}
            entry["convergence"] = [converged(log, delta, evals) for log in logs]
            entry["converged"] = _all_converged(entry["convergence"])
        entries.append(entry)
    default = next((e for e in entries if e["label"] == default_label), None)
    for e in entries:
        if default is None or e is default:
            continue
        ref = dict(zip(default["seeds"], default["ppl"]))
        common = [s for s in e["seeds"] if s in ref]
        if not common:
            continue
        rel = [dict(zip(e["seeds"], e["ppl"]))[s] / ref[s] - 1.0 for s in common]
        paper = None
        if e["row"] in PAPER_TABLE2 and e["row"] != DEFAULT_ROW:
            paper = PAPER_TABLE2[e["row"]][-1] - PAPER_TABLE2[DEFAULT_ROW][-1]
        both = _all_converged([{"converged": e.get("converged", True)}, {"converged": default.get("converged")}])
        e["vs_default"] = {"seeds": common, "rel_ppl": rel, **_range(rel), "better": sum(r < 0 for r in rel),
                           "worse": sum(r > 0 for r in rel), "paper_avg11_delta": paper, "converged": both,
                           "verdict": _direction(rel, paper, both, "better", "worse")}
    return entries


def _direction(rel: Sequence[float], paper: Optional[float], both_converged: Optional[bool], low: str, high: str) -> str:
    """``"better in 3/3 seeds, as the paper (direction only)"``: lower (``low``) or higher in every seed,
    else mixed; "direction only" unless every student compared converged."""
    n, below, above = len(rel), sum(r < 0 for r in rel), sum(r > 0 for r in rel)
    if below == n:
        text, ours = f"{low} in {n}/{n} seeds", 1
    elif above == n:
        text, ours = f"{high} in {n}/{n} seeds", -1
    else:
        text, ours = f"mixed ({low} in {below}/{n} seeds)", 0
    if paper and ours:
        text += ", as the paper" if (paper > 0) == (ours > 0) else ", opposite to the paper"
    return text + ("" if both_converged else " (direction only)")


def wirings_table(entries: Sequence[dict]) -> list[dict]:
    """``reference`` against ``paper-text`` for the same row and layers, seed by seed."""
    out = []
    for pt in (e for e in entries if e["wiring"] == "paper-text"):
        ref = next((e for e in entries if e["wiring"] == "reference" and e["row"] == pt["row"]
                    and e["farskip"] == pt["farskip"]), None)  # fmt: skip
        if ref is None:
            continue
        common = [s for s in ref["seeds"] if s in pt["seeds"]]
        if not common:
            continue
        r_ppl, p_ppl = dict(zip(ref["seeds"], ref["ppl"])), dict(zip(pt["seeds"], pt["ppl"]))
        rel = [r_ppl[s] / p_ppl[s] - 1.0 for s in common]
        r_kl, p_kl = dict(zip(ref["seeds"], ref["kl_to_teacher"])), dict(zip(pt["seeds"], pt["kl_to_teacher"]))
        kl = [r_kl[s] - p_kl[s] for s in common if r_kl[s] is not None and p_kl[s] is not None]
        both = _all_converged([{"converged": ref.get("converged")}, {"converged": pt.get("converged")}])
        out.append({"row": pt["row"], "farskip": pt["farskip"], "layers": pt["layers"], "seeds": common,
                    "reference_label": ref["label"], "paper_text_label": pt["label"], "rel_ppl": rel, **_range(rel),
                    "kl_diff": _range(kl) if kl else None, "converged": both,
                    "verdict": _direction(rel, None, both, "reference lower", "reference higher")})
    return out


def untrained_tables(reports: Sequence[dict], num_layers: int) -> dict:
    """Fig. 3 (``first:N`` / ``last:N`` per wiring, N = 1 .. num_layers) and the sub-block rows,
    keyed by (layers, mode, wiring) over every report (the teacher's rows must agree)."""
    rows, teacher = {}, None
    for report in reports:
        for r in report.get("rows", []):
            if r["model"] == "teacher":
                if teacher is not None and abs(r["ppl"] - teacher["ppl"]) > 1e-6 * teacher["ppl"]:
                    raise UserError(f"the untrained reports score different teachers (ppl {teacher['ppl']:.4f} and "
                                    f"{r['ppl']:.4f})")
                teacher = r
            elif r["model"].startswith("untrained"):
                rows[(r.get("farskip"), r.get("farskip_mode"), r.get("farskip_connectivity"))] = r

    def cell(spec, mode, wiring):
        r = rows.get((spec, mode, wiring))
        return None if r is None else {"ppl": r["ppl"], "gap": r["ppl_gap_to_teacher"], "kl": r.get("kl_to_teacher")}

    fig3 = []
    for n in range(1, num_layers + 1):
        spec = "all" if n == num_layers else None
        fig3.append({"n": n, "first": cell(spec or f"first:{n}", None, "reference"),
                     "last": {w: cell(spec or f"last:{n}", None, w) for w in WIRINGS}})
    specs = sorted({s for s, m, _ in rows if m}, key=lambda s: (s == "all", s))
    sub_blocks = []
    for spec in specs:
        for w in WIRINGS:
            parts = {m: rows.get((spec, m, w)) for m in ("attn-only", "mlp-only")}
            if not any(parts.values()):
                continue
            entry = {"layers": spec, "wiring": w, "both": cell(spec, None, w)}
            entry.update({m: cell(spec, m, w) for m in parts})
            sub_blocks.append(entry)
    return {"teacher": None if teacher is None else {"ppl": teacher["ppl"]}, "fig3": fig3, "sub_blocks": sub_blocks}


def build(seed_reports: Sequence[str], untrained_reports: Sequence[str], num_layers: int, delta: float = 0.02,
          evals: int = 2) -> dict:
    """Everything the tables show, from the report files (the JSON written by ``--json``)."""
    seeded = [(_load(p), os.path.dirname(os.path.abspath(p))) for p in seed_reports]
    teachers = {r.get("teacher") for r, _ in seeded} | {_load(p).get("teacher") for p in untrained_reports}
    entries = students_table(seeded, num_layers, delta, evals)
    return {"teachers": sorted(t for t in teachers if t), "num_layers": num_layers, "default_row": DEFAULT_ROW,
            "converged_rule": {"delta": delta, "evals": evals},
            "text": next((r.get("text") for r, _ in seeded), None), "windows": next((r.get("windows") for r, _ in seeded), None),
            "rows": entries, "wirings": wirings_table(entries),
            **untrained_tables([_load(p) for p in untrained_reports], num_layers)}  # fmt: skip


def _pct(x: Optional[float], digits: int = 1) -> str:
    return "" if x is None else f"{100 * x:+.{digits}f}%"


def _pm(stats: Optional[dict], fmt: str, scale: float = 1.0) -> str:
    if not stats:
        return "-"
    mean = format(scale * stats["mean"], fmt)
    return mean if stats["sd"] is None else f"{mean} ± {format(scale * stats['sd'], fmt.lstrip('+'))}"


def _mean_range(r: dict, digits: int = 1) -> str:
    return f"{_pct(r['mean'], digits)} ({_pct(r['min'], digits)}, {_pct(r['max'], digits)})"


def _conv_cell(e: dict, evals: int) -> str:
    verdicts = e.get("convergence")
    if not verdicts:
        return ""
    done = sum(v["converged"] is True for v in verdicts)
    unknown = sum(v["converged"] is None for v in verdicts)
    changes = [v["last_change"] for v in verdicts if v["last_change"] is not None]
    detail = f"; best KL {_pct(min(changes))} to {_pct(max(changes))} over the last {evals} evaluations" if changes else ""
    return f"{done}/{len(verdicts)}" + (f" ({unknown} too short to tell)" if unknown else "") + detail


def markdown(table: dict) -> str:
    """The tables of ``build``'s output."""
    n, evals = table["num_layers"], table["converged_rule"]["evals"]
    out = [f"### Students, per wiring (mean over seeds; changes from {DEFAULT_ROW} seed by seed: mean (range))", "",
           f"| row | layers converted (of {n}) | wiring | seeds | held-out ppl (mean ± sd) | vs teacher | KL | "
           f"ppl vs {DEFAULT_ROW} | direction | converged (seeds) |", "|---|---|---|---:|---:|---:|---:|---|---|---|"]
    for e in table["rows"]:
        vs = e.get("vs_default")
        ref = "(the reference)" if e["row"] == DEFAULT_ROW else ""
        out.append(" | ".join([
            f"| {e['row'] if e['row'] in PAPER_TABLE2 else e['label']}", e["layers"], e["wiring"] or "either",
            str(len(e["seeds"])), _pm(e["ppl_stats"], ".2f"), _pm(e["gap_stats"], "+.1f", 100) + "%",
            _pm(e["kl_stats"], ".3f"), _mean_range(vs) if vs else ref, vs["verdict"] if vs else "", _conv_cell(e, evals)]) + " |")
    if table["wirings"]:
        out += ["", "### reference against paper-text, same layers and seed", "",
                "| row | layers converted | seeds | ppl, reference vs paper-text: mean (range) | "
                "KL, reference - paper-text: mean (range) | direction |", "|---|---|---:|---|---|---|"]
        for w in table["wirings"]:
            kl = w["kl_diff"]
            kl_cell = f"{kl['mean']:+.4f} ({kl['min']:+.4f}, {kl['max']:+.4f})" if kl else "-"
            out.append(f"| {w['row']} | {w['layers']} | {len(w['seeds'])} | {_mean_range(w, 2)} | {kl_cell} | {w['verdict']} |")
    curves = [e for e in table["rows"] if e.get("curves")]
    if curves:
        steps = sorted({int(s) for e in curves for c in e["curves"].values() if c for s in c})
        out += ["", "### Convergence: held-out KL proxy per evaluation, mean over seeds", "",
                "| row | wiring | " + " | ".join(f"step {s}" for s in steps) + " | converged (seeds) |",
                "|---|---|" + "---:|" * len(steps) + "---|"]
        for e in curves:
            cells = []
            for s in steps:
                vals = [c[s] if s in c else c.get(str(s)) for c in e["curves"].values() if c]
                vals = [v for v in vals if v is not None]
                cells.append(f"{statistics.fmean(vals):.4f}" if vals else "")
            out.append(f"| {e['row']} [{e['layers']}] | {e['wiring'] or 'either'} | " + " | ".join(cells)
                       + f" | {_conv_cell(e, evals)} |")
    fig3 = table["fig3"]
    if any(f["first"] or any(f["last"].values()) for f in fig3):

        def pk(c):
            return ["", ""] if c is None else [f"{c['ppl']:.2f} ({_pct(c['gap'])})", f"{c['kl']:.3f}"]

        out += ["", "### Fig. 3: untrained conversion of the first N and the last N layers", "",
                f"| N converted (of {n}) | first N: ppl | first N: KL | last N, reference: ppl | last N, reference: KL | "
                "last N, paper-text: ppl | last N, paper-text: KL |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for f in fig3:
            cells = pk(f["first"]) + pk(f["last"]["reference"]) + pk(f["last"]["paper-text"])
            out.append(f"| {f['n']}{' (all)' if f['n'] == n else ''} | " + " | ".join(cells) + " |")
        if table.get("teacher"):
            out.append(f"| 0 (the teacher) | {table['teacher']['ppl']:.2f} | 0 | | | | |")
    if table["sub_blocks"]:

        def gk(c):  # a KL of -0.0001 (rounding) reads 0.000
            return "" if c is None else f"{_pct(c['gap'])} (KL {abs(c['kl']) if abs(c['kl']) < 5e-4 else c['kl']:.3f})"

        out += ["", "### One sub-block converted, untrained (vs the teacher's perplexity)", "",
                "| converted | wiring | attention only | MoE only | both |", "|---|---|---:|---:|---:|"]
        for s in table["sub_blocks"]:
            out.append(f"| {s['layers']} | {s['wiring']} | {gk(s.get('attn-only'))} | {gk(s.get('mlp-only'))} | {gk(s['both'])} |")
    return "\n".join(out) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m distill.wiring_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", nargs="+", default=[], metavar="REPORT",
                   help="distill.report JSON of the students, one per seed (labels end in ' (seed N)')")
    p.add_argument("--untrained", nargs="+", default=[], metavar="REPORT",
                   help="distill.report JSON(s) of untrained conversions (Fig. 3, sub-blocks), either wiring")
    p.add_argument("--num-layers", type=positive_int, required=True, help="the teacher's depth")
    p.add_argument("--converged-delta", type=float, default=0.02,
                   help="converged: the best held-out KL improved by less than this (relative) over the last evaluations")
    p.add_argument("--converged-evals", type=positive_int, default=2, help="the number of last evaluations it looks at")
    p.add_argument("--json", help="write everything the tables show here")
    p.add_argument("--out", help="write the markdown here too")
    return p


def main(argv=None) -> int:
    def body():
        args = build_parser().parse_args(argv)
        if not args.seeds and not args.untrained:
            raise UserError("give --seeds REPORT ... and/or --untrained REPORT ...")
        if not 0 < args.converged_delta < 1:
            raise UserError(f"--converged-delta must be in (0, 1), got {args.converged_delta}")
        table = build(args.seeds, args.untrained, args.num_layers, args.converged_delta, args.converged_evals)
        text = markdown(table)
        if args.json:
            write_text(args.json, json.dumps(table, indent=1) + "\n")
        if args.out:
            write_text(args.out, text)
        print(text, end="")

    return run_cli("distill.wiring_table", body)


if __name__ == "__main__":
    sys.exit(main())
