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

Fig. 3: the paper plots accuracy of the *untrained* conversion against N for the first N and the
last N layers (no numbers in the text: it finds converting the first layers more harmful); ours
lists the held-out perplexity and KL of ``untrained, farskip first:N`` / ``last:N`` per N.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Optional

from moe_variants.common.cli import positive_int, run_cli
from moe_variants.common.files import write_text

__all__ = ["PAPER_TABLE2", "PAPER_COLUMNS", "table2_markdown", "fig3_markdown", "main"]

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


def _load(path: Optional[str]) -> Optional[dict]:
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _paper_key(label: str) -> str:
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
        rows_by_key.setdefault(_paper_key(row["model"]), []).append(row)
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
    rows = {r.get("farskip"): r for r in (report or {}).get("rows", [])}
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m distill.ablation_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--table2", help="distill.report JSON of the Table 2 students (missing: pending)")
    p.add_argument("--fig3", help="distill.report JSON of the first-N / last-N untrained conversions (missing: pending)")
    p.add_argument("--num-layers", type=positive_int, required=True, help="the teacher's depth")
    p.add_argument("--out", help="write the markdown here too")
    return p


def main(argv=None) -> int:
    def body():
        args = build_parser().parse_args(argv)
        text = ("### Table 2: distillation settings (paper: Qwen-3-30B MoE, 48 layers; ours: "
                f"{args.num_layers} layers)\n\n" + table2_markdown(_load(args.table2), args.num_layers)
                + f"\n\n### Fig. 3: untrained conversion of the first N vs the last N layers (ours, {args.num_layers} layers)\n\n"
                + fig3_markdown(_load(args.fig3), args.num_layers) + "\n")  # fmt: skip
        if args.out:
            write_text(args.out, text)
        print(text, end="")

    return run_cli("distill.ablation_table", body)


if __name__ == "__main__":
    sys.exit(main())
