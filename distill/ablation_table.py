"""FarSkip-Collective's Table 2 and Fig. 3 with the paper's rows beside ours (``scripts/fcsd_ablations.sh``).

    python -m distill.ablation_table --table2 RUNS/fcsd_ablations_report.json --fig3 RUNS/fcsd_fig3.json \\
        --num-layers 8 [--out RUNS/fcsd_ablations.md]

Table 2: the paper distils Qwen-3-30B MoE (48 layers) for 500M tokens and scores downstream tasks
(ARC-C, HumanEval+, GSM-8K, MMLU, the 11-task average; ``../shared/papers/farskip-collective.txt``,
Table 2); ours distils a small MoE (``distill.report`` rows) and scores held-out WikiText-2 test
perplexity, its gap to the teacher and the KL to the teacher (lower is better for all three, where
the paper's accuracies are higher-is-better). Rows are matched by label: a student labelled
``"KL (FAR 75%) [last:6 of 8]"`` is the paper's ``KL (FAR 75%)`` row, the bracket says what ours
converted. A report that does not exist yet gives ``pending`` cells, so the table (and the docs
that print it) can be made before the runs.

Repeats: labels ending in ``" (seed N)"`` (``SEEDS=...`` in the script, one report per seed) make a
seeded Table 2 instead: per row the mean +- sample sd of perplexity and KL over seeds, and the
paired difference from the paper's default recipe, ``KL (FAR 100%)``, seed by seed (same seed: same
data order), as a relative perplexity change with its 95% Student-t interval. A row is "outside the
noise" when that interval excludes 0, and it agrees with the paper only when it is outside the noise
in the direction the paper's AVG-11 moved; otherwise the table makes no claim. ``--convergence``
adds each row's early-stopping proxy (held-out KL) at every evaluation, read from the runs'
``metrics.jsonl``, to show whether the students had stopped improving. ``--runs DIR ...`` prints only
that proxy for run directories that were never scored (a run cut short, or whose checkpoints are
gone): one row per directory name without its ``_s<SEED>``, the mean over the seeds at each step.

Fig. 3: the paper plots accuracy of the *untrained* conversion against N for the first N and the
last N layers (no numbers in the text: it finds converting the first layers more harmful); ours
lists the held-out perplexity and KL of ``untrained, farskip first:N`` / ``last:N`` per N.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from typing import Optional, Sequence

from scipy.stats import t as student_t

from megatron.common.cli import UserError, one_line, positive_int, run_cli
from megatron.common.files import write_text

__all__ = ["PAPER_TABLE2", "PAPER_COLUMNS", "DEFAULT_ROW", "table2_markdown", "fig3_markdown", "split_seed", "rows_by_seed",
           "paired_interval", "seeded_table2", "seeded_table2_markdown", "convergence_markdown", "paper_key", "mean_sd",
           "proxy_curve", "main"]

PAPER_COLUMNS = ("ARC-C", "HEval+", "GSM-8K", "MMLU", "AVG-11")
# FarSkip-Collective, Table 2 (Qwen-3-30B MoE, 500M tokens; higher is better). "KL" and
# "KL (FAR 100%)" are the same run in the paper.
PAPER_TABLE2 = {
    "ORIGINAL": (61.9, 73.8, 86.9, 80.2, 75.9),
    "KL (FAR 50%)": (60.0, 67.1, 83.9, 77.5, 74.6),
    "KL (FAR 75%)": (58.8, 67.7, 85.3, 75.4, 74.3),
    "KL (FAR 90%)": (59.3, 73.8, 85.1, 73.4, 74.1),
    "KL (FAR 100%)": (54.6, 61.6, 79.6, 64.1, 68.2),
    "KL + INTER. L2": (53.8, 48.8, 80.6, 58.9, 65.4),
    "SFT": (44.4, 1.2, 76.0, 64.5, 58.1),
    "KL * EMBED.": (55.5, 56.1, 79.5, 63.3, 67.6),
    "KL 0.25x BS": (53.2, 53.7, 78.4, 60.6, 65.7),
    "KL 4x BS": (54.1, 50.6, 82.5, 62.4, 66.6),
}


DEFAULT_ROW = "KL (FAR 100%)"  # the paper's default recipe, every other row is compared to it
_SEED = re.compile(r"^(.*) \(seed (\d+)\)$")


def _load(path: Optional[str]) -> Optional[dict]:
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as err:
        raise UserError(f"{path}: not a JSON report ({one_line(err)})") from None


def paper_key(label: str) -> str:
    """``"KL (FAR 75%) [last:6 of 8]"`` -> ``"KL (FAR 75%)"``; the teacher row is ``ORIGINAL``."""
    if label == "teacher":
        return "ORIGINAL"
    return label.split(" [", 1)[0].strip()


def _ours(row: Optional[dict]) -> list[str]:
    if row is None:
        return ["pending"] * 3
    kl = row.get("kl_to_teacher")
    return [f"{row['ppl']:.2f}", f"{100 * row['ppl_gap_to_teacher']:+.1f}%", "-" if kl is None else f"{kl:.3f}"]


def table2_markdown(report: Optional[dict], num_layers: int) -> str:
    """The paper's Table 2 rows with ours beside them (``pending`` where ``report`` has no row)."""
    rows_by_key: dict[str, list[dict]] = {}
    for row in (report or {}).get("rows", []):
        rows_by_key.setdefault(paper_key(row["model"]), []).append(row)
    head = ("| row | paper " + " | paper ".join(PAPER_COLUMNS) + " | ours: layers converted | ours: held-out ppl "
            "| vs teacher | KL(teacher‖model) |")  # fmt: skip
    lines = [head, "|---|" + "---:|" * len(PAPER_COLUMNS) + "---|---:|---:|---:|"]
    for key, paper in PAPER_TABLE2.items():
        ours = rows_by_key.get(key) or [None]
        for row in ours:
            what = _what(key, row, num_layers)
            cells = " | ".join(f"{v:.1f}" for v in paper)
            lines.append(f"| {key} | {cells} | {what} | " + " | ".join(_ours(row)) + " |")
    extra = [r for k, rs in rows_by_key.items() if k not in PAPER_TABLE2 for r in rs]
    for row in extra:  # e.g. the untrained conversion: ours only
        lines.append(f"| {row['model']} | " + " | ".join("" for _ in PAPER_COLUMNS) + f" | {row.get('farskip') or 'none'} | "
                     + " | ".join(_ours(row)) + " |")  # fmt: skip
    return "\n".join(lines)


def _what(key: str, row: Optional[dict], num_layers: int) -> str:
    """What our row converted and the fraction of ``num_layers`` it is (the paper's: of 48 layers),
    plus the setting in the label's bracket after the layer part (``"[all, coefficient 0.1]"``)."""
    if key == "ORIGINAL":
        return "none (the teacher)"
    if row is None:
        pct = re.search(r"FAR (\d+)%", key)
        if pct and pct.group(1) != "100":  # the planned run: the script's rounding (half up)
            return f"last:{(num_layers * int(pct.group(1)) + 50) // 100} of {num_layers} (planned)"
        return f"all {num_layers} (planned)"
    spec = row.get("farskip") or "none"
    m = re.fullmatch(r"(first|last):(\d+)", spec)
    count = num_layers if spec == "all" else int(m.group(2)) if m else None
    text = spec + (f" ({100 * count / num_layers:.1f}%)" if count else "")
    bracket = re.search(r"\[(.*)\]", row["model"])
    detail = bracket.group(1).split(", ", 1)[1] if bracket and ", " in bracket.group(1) else ""
    return text + (f"; {detail}" if detail else "")


def fig3_markdown(report: Optional[dict], num_layers: int) -> str:
    """Untrained conversions of the first N and the last N layers, side by side per N."""
    # whole-layer conversions only: a sub-block row (``last:1@mlp-only``) has the same layers
    rows = {r.get("farskip"): r for r in (report or {}).get("rows", []) if not r.get("farskip_mode")}
    lines = ["| N converted (of %d) | first N: held-out ppl | first N: KL | last N: held-out ppl | last N: KL |" % num_layers,
             "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for n in range(1, num_layers + 1):
        cells = []
        for side in ("first", "last"):
            row = rows.get("all" if n == num_layers else f"{side}:{n}")
            cells += _ours(row)[0:3:2] if row else ["pending", "pending"]
        lines.append(f"| {n}{' (all)' if n == num_layers else ''} | " + " | ".join(cells) + " |")
    teacher = rows.get("none") or next((r for r in (report or {}).get("rows", []) if r["model"] == "teacher"), None)
    if teacher is not None:
        lines.append(f"| 0 (the teacher) | {teacher['ppl']:.2f} | 0 | {teacher['ppl']:.2f} | 0 |")
    return "\n".join(lines)


def split_seed(label: str) -> tuple[str, Optional[int]]:
    """``"KL (FAR 75%) [last:6 of 8] (seed 1235)"`` -> ``("KL (FAR 75%) [last:6 of 8]", 1235)``; no suffix: None."""
    m = _SEED.match(label)
    return (m.group(1), int(m.group(2))) if m else (label, None)


def rows_by_seed(reports: Sequence[dict]) -> dict[str, dict[Optional[int], dict]]:
    """``{label without its seed: {seed: row}}`` over several ``distill.report`` JSONs, in first-seen
    order. Rows without a seed (the teacher, untrained conversions) are the same in every report and
    are kept once per report under the seeds that report's students carry, so that they pair too."""
    out: dict[str, dict[Optional[int], dict]] = {}
    for report in reports:
        rows = report.get("rows", [])
        seeds = {split_seed(r["model"])[1] for r in rows} - {None}
        if len(seeds) > 1:
            raise UserError(f"a report holds students of several seeds {sorted(seeds)}; give one report per seed")
        report_seed = next(iter(seeds), None)
        for row in rows:
            label, seed = split_seed(row["model"])
            seed = report_seed if seed is None else seed
            if seed in out.setdefault(label, {}):
                raise UserError(f"two rows for {label!r} at seed {seed}")
            out[label][seed] = row
    return out


def paired_interval(diffs: Sequence[float], level: float = 0.95) -> dict:
    """Mean, sample sd and the two-sided Student-t interval of paired differences (n >= 2; with one
    difference the interval is None)."""
    n = len(diffs)
    if n == 0:
        raise ValueError("no paired differences")
    mean = statistics.fmean(diffs)
    if n < 2:
        return {"n": 1, "mean": mean, "sd": None, "lo": None, "hi": None}
    sd = statistics.stdev(diffs)
    half = student_t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half}


def mean_sd(values: Sequence[float]) -> dict:
    return {"n": len(values), "mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else None}


def _paper_delta(key: str) -> Optional[float]:
    """The paper's AVG-11 change from its default recipe (higher is better), None for rows it lacks."""
    if key not in PAPER_TABLE2 or key == DEFAULT_ROW:
        return None
    return PAPER_TABLE2[key][-1] - PAPER_TABLE2[DEFAULT_ROW][-1]


def _verdict(interval: Optional[dict], paper_delta: Optional[float]) -> tuple[str, str]:
    """(noise, paper) verdicts for a relative perplexity change (lower is better) with its interval."""
    if interval is None or interval["lo"] is None:
        return "n < 2", "no claim"
    if interval["lo"] > 0:
        ours = "worse"
    elif interval["hi"] < 0:
        ours = "better"
    else:
        return "within the noise", "no claim"
    if paper_delta is None or paper_delta == 0:
        return f"{ours} (outside the noise)", "no paper row"
    paper = "better" if paper_delta > 0 else "worse"
    return f"{ours} (outside the noise)", "agrees" if ours == paper else "opposite to the paper"


def seeded_table2(reports: Sequence[dict], num_layers: int) -> dict:
    """Per row: seeds, per-seed figures, mean +- sd, and the paired relative perplexity (and KL)
    change from ``DEFAULT_ROW`` with its 95% interval and verdicts (the JSON behind the table)."""
    by_label = rows_by_seed(reports)
    default = next((seeds for label, seeds in by_label.items() if paper_key(label) == DEFAULT_ROW), None)
    rows = []
    for label, seeds in by_label.items():
        key = paper_key(label)
        ordered = sorted(seeds.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
        first = ordered[0][1]
        entry = {"row": key, "label": label, "what": _what(key, {**first, "model": label}, num_layers),
                 "seeds": [s for s, _ in ordered], "ppl": [r["ppl"] for _, r in ordered],
                 "kl_to_teacher": [r.get("kl_to_teacher") for _, r in ordered],
                 "ppl_gap_to_teacher": [r["ppl_gap_to_teacher"] for _, r in ordered],
                 "checkpoints": [r.get("checkpoint") for _, r in ordered]}  # fmt: skip
        entry["ppl_stats"] = mean_sd(entry["ppl"])
        entry["gap_stats"] = mean_sd(entry["ppl_gap_to_teacher"])
        kls = [k for k in entry["kl_to_teacher"] if k is not None]
        entry["kl_stats"] = mean_sd(kls) if kls else None
        entry["paper_avg11_delta"] = _paper_delta(key)
        common = [s for s, _ in ordered if default is not None and s in default]
        if default is not None and key != DEFAULT_ROW and common:
            rel = [seeds[s]["ppl"] / default[s]["ppl"] - 1.0 for s in common]
            entry["vs_default"] = {"seeds": common, "rel_ppl": paired_interval(rel)}
            if all(seeds[s].get("kl_to_teacher") is not None and default[s].get("kl_to_teacher") is not None
                   for s in common):  # fmt: skip
                entry["vs_default"]["kl"] = paired_interval(
                    [seeds[s]["kl_to_teacher"] - default[s]["kl_to_teacher"] for s in common])
            noise, paper = _verdict(entry["vs_default"]["rel_ppl"], entry["paper_avg11_delta"])
            entry["vs_default"].update(noise=noise, paper=paper)
        rows.append(entry)
    order = {k: i for i, k in enumerate(PAPER_TABLE2)}
    rows.sort(key=lambda e: order.get(e["row"], len(order)))
    return {"default_row": DEFAULT_ROW, "level": 0.95, "rows": rows}


def _pm(stats: Optional[dict], fmt: str, scale: float = 1.0) -> str:
    if not stats:
        return "-"
    mean = format(scale * stats["mean"], fmt)
    return mean if stats["sd"] is None else f"{mean} ± {format(scale * stats['sd'], fmt.lstrip('+'))}"


def seeded_table2_markdown(table: dict) -> str:
    """The seeded Table 2 (see ``seeded_table2``) as markdown."""
    lines = ["| row | paper AVG-11 | paper vs KL (FAR 100%) | ours: layers converted | seeds | held-out ppl (mean ± sd) "
             "| vs teacher | KL(teacher‖model) | ppl vs KL (FAR 100%), paired [95% CI] | outside the noise? | vs the paper |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]  # fmt: skip
    for e in table["rows"]:
        paper = PAPER_TABLE2.get(e["row"])
        delta = e["paper_avg11_delta"]
        vs = e.get("vs_default")
        if vs:
            r = vs["rel_ppl"]
            ci = f"{100 * r['mean']:+.1f}%" + (f" [{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}]" if r["lo"] is not None else "")
            noise, claim = vs["noise"], vs["paper"]
        else:
            ci, noise, claim = ("(the reference)", "", "") if e["row"] == DEFAULT_ROW else ("-", "", "")
        lines.append(" | ".join([
            f"| {e['row'] if paper else e['label']}", f"{paper[-1]:.1f}" if paper else "",
            "" if delta is None else f"{delta:+.1f}", e["what"], str(len(e["seeds"])),
            _pm(e["ppl_stats"], ".2f"), _pm(e["gap_stats"], "+.1f", 100) + "%", _pm(e["kl_stats"], ".3f"),
            ci, noise, claim]) + " |")  # fmt: skip
    return "\n".join(lines)


def proxy_curve(checkpoint: Optional[str]) -> Optional[dict[int, float]]:
    """``{step: held-out KL}`` of the run's evaluations in its ``metrics.jsonl`` (``.../RUN/best`` ->
    ``.../RUN``); None when the file is missing."""
    if not checkpoint:
        return None
    path = os.path.join(os.path.dirname(os.path.normpath(checkpoint)), "metrics.jsonl")
    if not os.path.exists(path):
        return None
    curve: dict[int, float] = {}
    with open(path) as f:
        for line in f:
            ev = json.loads(line)
            if ev.get("event") == "valid" and "heldout_kl" in ev:
                curve[int(ev["step"])] = ev["heldout_kl"]
    return curve or None


def convergence_markdown(table: dict) -> str:
    """Each student row's held-out KL proxy at every evaluation step, mean over its seeds (the
    steps every seed evaluated), and the last interval's relative change."""
    curves = []
    for e in table["rows"]:
        per_seed = [c for c in (proxy_curve(p) for p in e["checkpoints"]) if c]
        if per_seed:
            steps = sorted(set.intersection(*(set(c) for c in per_seed)))
            curves.append((e, steps, {s: statistics.fmean(c[s] for c in per_seed) for s in steps}))
    if not curves:
        return "(no run metrics found)"
    all_steps = sorted({s for _, steps, _ in curves for s in steps})
    lines = ["| row | seeds | " + " | ".join(f"step {s}" for s in all_steps) + " | last interval |",
             "|---|---:|" + "---:|" * (len(all_steps) + 1)]
    for e, steps, mean in curves:
        cells = [f"{mean[s]:.4f}" if s in mean else "" for s in all_steps]
        last = f"{100 * (mean[steps[-1]] / mean[steps[-2]] - 1):+.1f}%" if len(steps) >= 2 and mean[steps[-2]] else ""
        lines.append(f"| {e['row'] if e['row'] in PAPER_TABLE2 else e['label']} ({e['what']}) | {len(e['seeds'])} | "
                     + " | ".join(cells) + f" | {last} |")  # fmt: skip
    return "\n".join(lines)


_RUN_SEED = re.compile(r"^(.*)_s(\d+)$")


def _finished(run_dir: str) -> bool:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return any((ev := json.loads(line)).get("event") == "summary" and not ev.get("interrupted") for line in f)


def runs_convergence_markdown(run_dirs: Sequence[str]) -> str:
    """The held-out KL proxy of FCSD run directories per evaluation step, without reports: rows are
    the directory names without ``_s<SEED>`` (first-seen order); a cell is the mean over the seeds
    that reached that step, with their number in brackets where it is not every seed of the row;
    "finished" counts the seeds whose run wrote its summary; the last interval is the relative change
    of the mean over the seeds that have both of the row's last two steps."""
    rows: dict[str, dict[str, dict[int, float]]] = {}
    done: dict[str, int] = {}
    for d in run_dirs:
        m = _RUN_SEED.match(os.path.basename(os.path.normpath(d)))
        name, seed = (m.group(1), m.group(2)) if m else (os.path.basename(os.path.normpath(d)), "")
        curve = proxy_curve(os.path.join(d, "best")) or {}
        rows.setdefault(name, {})[seed] = curve
        done[name] = done.get(name, 0) + _finished(d)
    all_steps = sorted({s for seeds in rows.values() for c in seeds.values() for s in c})
    if not all_steps:
        return "(no run metrics found)"
    lines = ["| run | seeds | finished | " + " | ".join(f"step {s}" for s in all_steps) + " | last interval |",
             "|---|---:|---:|" + "---:|" * (len(all_steps) + 1)]
    for name, seeds in rows.items():
        cells = []
        for s in all_steps:
            vals = [c[s] for c in seeds.values() if s in c]
            cells.append("" if not vals else f"{statistics.fmean(vals):.4f}" + ("" if len(vals) == len(seeds) else f" ({len(vals)})"))
        reached = [sorted(c) for c in seeds.values() if len(c) >= 2]
        last = ""
        if reached:
            a, b = max(r[-2] for r in reached), max(r[-1] for r in reached)
            pair = [c for c in seeds.values() if a in c and b in c]
            before = statistics.fmean(c[a] for c in pair) if pair else 0.0
            if before:
                last = f"{100 * (statistics.fmean(c[b] for c in pair) / before - 1):+.1f}%"
        lines.append(f"| {name} | {len(seeds)} | {done[name]} | " + " | ".join(cells) + f" | {last} |")
    return "\n".join(lines)


def plot(table: dict, fig3: Optional[dict], num_layers: int, path: str) -> None:
    """Left: each row's paired perplexity change from ``DEFAULT_ROW`` (mean, 95% interval as error
    bars, each seed a dot). Right (when ``fig3`` is given): the untrained conversion of the first N
    and the last N layers against N, the paper's Fig. 3."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [e for e in table["rows"] if e.get("vs_default") and e["row"] not in ("ORIGINAL",)
            and not e["label"].startswith("untrained")]  # fmt: skip
    fig, axes = plt.subplots(1, 2 if fig3 else 1, figsize=(11 if fig3 else 6.5, 4.5), squeeze=False)
    ax = axes[0][0]
    for i, e in enumerate(rows):
        r = e["vs_default"]["rel_ppl"]
        err = None if r["lo"] is None else [[100 * (r["mean"] - r["lo"])], [100 * (r["hi"] - r["mean"])]]
        ax.errorbar(100 * r["mean"], i, xerr=err, fmt="o", color="k", capsize=3)
        seeds = e["vs_default"]["seeds"]
        by_seed = dict(zip(e["seeds"], e["ppl"]))
        default = next(d for d in table["rows"] if d["row"] == DEFAULT_ROW)
        ref = dict(zip(default["seeds"], default["ppl"]))
        ax.plot([100 * (by_seed[s] / ref[s] - 1) for s in seeds], [i] * len(seeds), "x", color="tab:blue", alpha=0.6)
    ax.axvline(0, color="gray", lw=1)
    ax.set_yticks(range(len(rows)), [e["label"].replace(" [", "\n[") for e in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"held-out perplexity vs {DEFAULT_ROW}, same seed (%)")
    ax.set_title("mean and 95% interval over seeds (x: each seed)", fontsize=9)
    if fig3:
        ax = axes[0][1]
        by_spec = {r.get("farskip"): r for r in fig3.get("rows", [])}
        teacher = next((r for r in fig3.get("rows", []) if r["model"] == "teacher"), None)
        for side in ("first", "last"):
            ns = [n for n in range(1, num_layers + 1) if by_spec.get("all" if n == num_layers else f"{side}:{n}")]
            ax.plot(ns, [by_spec["all" if n == num_layers else f"{side}:{n}"]["ppl"] for n in ns], "o-", label=f"{side} N")
        if teacher is not None:
            ax.axhline(teacher["ppl"], color="gray", ls="--", lw=1, label="teacher")
        ax.set_xlabel(f"N layers converted without training (of {num_layers})")
        ax.set_ylabel("held-out perplexity")
        ax.set_title("Fig. 3: first N vs last N", fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m distill.ablation_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--table2", nargs="+", help="distill.report JSON(s) of the Table 2 students (missing: pending); "
                   "one per seed for a seeded table")
    p.add_argument("--fig3", help="distill.report JSON of the first-N / last-N untrained conversions (missing: pending)")
    p.add_argument("--num-layers", type=positive_int, required=True, help="the teacher's depth")
    p.add_argument("--out", help="write the markdown here too")
    p.add_argument("--json", help="seeded table: write its statistics (per-seed figures, intervals, verdicts) here")
    p.add_argument("--plot", help="seeded table: a PNG of each row's paired change with its interval, and Fig. 3")
    p.add_argument("--convergence", action="store_true",
                   help="seeded table: add each row's held-out KL proxy per evaluation step from the runs' metrics")
    p.add_argument("--runs", nargs="+", metavar="RUN_DIR",
                   help="print only the held-out KL proxy per evaluation of these FCSD run directories (no reports)")
    return p


def main(argv=None) -> int:
    def body():
        args = build_parser().parse_args(argv)
        if args.runs:
            mixed = [f for f, v in (("--table2", args.table2), ("--fig3", args.fig3), ("--json", args.json),
                                    ("--plot", args.plot), ("--convergence", args.convergence)) if v]  # fmt: skip
            if mixed:
                raise UserError(f"--runs prints only the runs' convergence; drop {', '.join(mixed)}")
            missing = [d for d in args.runs if not os.path.isdir(d)]
            if missing:
                raise UserError(f"--runs: no such run directory {missing[0]}")
            text = ("### Convergence: held-out KL to the teacher (the early-stopping proxy) per evaluation\n\n"
                    + runs_convergence_markdown(args.runs) + "\n")
            if args.out:
                write_text(args.out, text)
            print(text, end="")
            return
        reports = [r for r in (_load(p) for p in args.table2 or []) if r is not None]
        seeded = any(split_seed(row["model"])[1] is not None for r in reports for row in r.get("rows", []))
        head = ("### Table 2: distillation settings (paper: Qwen-3-30B MoE, 48 layers; ours: "
                f"{args.num_layers} layers)\n\n")  # fmt: skip
        if seeded:
            table = seeded_table2(reports, args.num_layers)
            text = head + seeded_table2_markdown(table)
            if args.convergence:
                text += ("\n\n### Convergence: held-out KL to the teacher (the early-stopping proxy) per evaluation, "
                         "mean over seeds\n\n" + convergence_markdown(table))  # fmt: skip
            if args.json:
                write_text(args.json, json.dumps(table, indent=1) + "\n")
            if args.plot:
                plot(table, _load(args.fig3), args.num_layers, args.plot)
        else:
            if len(args.table2 or []) > 1:
                raise UserError("several --table2 reports need students labelled '... (seed N)', one seed per report")
            if args.json or args.convergence or args.plot:
                raise UserError("--json, --plot and --convergence need seeded reports (students labelled '... (seed N)')")
            text = head + table2_markdown(reports[0] if reports else None, args.num_layers)
        text += (f"\n\n### Fig. 3: untrained conversion of the first N vs the last N layers (ours, {args.num_layers} layers)\n\n"
                 + fig3_markdown(_load(args.fig3), args.num_layers) + "\n")  # fmt: skip
        if args.out:
            write_text(args.out, text)
        print(text, end="")

    return run_cli("distill.ablation_table", body)


if __name__ == "__main__":
    sys.exit(main())
