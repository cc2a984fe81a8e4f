"""Where a served run's engine-step time goes: expert all-to-alls, tensor-parallel collectives, the rest.

    python -m tools.profile.step_time --spans WORK/serve-standard-run0/a2a_spans [--spans ...] [--json OUT]

``serve --a2a-spans`` records, per engine step and rank, the step's wall time (``t`` to ``end``),
its real tokens, the bytes its expert collectives sent (``bytes``) and every expert collective's
flight (``spans``); a tensor-parallel engine adds each TP collective megatron-core issued (``tp``:
op, input bytes, start, end; ``megatron.compat.tp_collectives``: the row-parallel and embedding
all-reduces, the all-gathers among them the output layer's logits). Per run (one ``--spans``
directory) and rank: the steps' wall time, the time some expert collective was in flight, the time
some TP collective ran and not an expert one, and the rest (compute and host work), each as a share
of the wall time (the all-to-all's split into transfer and rank-skew wait, as bench_serve splits it),
with bytes per real token; per run the mean over ranks. It says why a slower link
does not raise the all-to-all's share of a TP engine's step: the TP collectives cross the same link.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys

from moe_variants.common.comm import BusyTime
from tools.bench.overlap import transfer_skew_steps
from tools.profile.exposed import read_spans_dir


def _union(intervals) -> float:
    busy = BusyTime()
    for start, end in intervals:
        busy.add(start, end)
    return busy.total


def rank_time(records: list) -> dict:
    """One rank's steps: ``{"steps", "tokens", "wall_s", "a2a_s", "tp_s", "rest_s", "a2a_bytes",
    "tp": {op: {"calls", "bytes", "s"}}}`` (``tp_s``: TP collectives outside any expert one's flight)."""
    out = {"steps": 0, "tokens": 0, "wall_s": 0.0, "a2a_s": 0.0, "tp_s": 0.0, "a2a_bytes": 0}
    ops: dict = collections.defaultdict(lambda: {"calls": 0, "bytes": 0, "s": 0.0})
    for rec in records:
        a2a = _union((s, e) for _, s, e in rec.get("spans", []))
        both = _union([(s, e) for _, s, e in rec.get("spans", [])] + [(s, e) for _, _, s, e in rec.get("tp", [])])
        out["steps"] += 1
        out["tokens"] += int(rec.get("tokens", 0))
        out["wall_s"] += rec["end"] - rec["t"]
        out["a2a_s"] += a2a
        out["tp_s"] += both - a2a
        out["a2a_bytes"] += int(rec.get("bytes", 0))
        for op, nbytes, s, e in rec.get("tp", []):
            ops[op]["calls"] += 1
            ops[op]["bytes"] += int(nbytes)
            ops[op]["s"] += e - s
    out["rest_s"] = out["wall_s"] - out["a2a_s"] - out["tp_s"]
    out["tp"] = {op: dict(v) for op, v in sorted(ops.items())}
    return out


def run_time(records_by_rank: list) -> dict:
    """A run's ranks (``rank_time`` each) and their means: shares of the wall time, bytes per real token;
    the all-to-all's share split into transfer and rank-skew wait (``tools.bench.overlap.transfer_skew``,
    steps matched by position) when the ranks recorded the same steps and collectives."""
    ranks = [rank_time(r) for r in records_by_rank]
    split = transfer_skew_steps([[rec.get("spans", []) for rec in r] for r in records_by_rank])
    for rank, x in zip(ranks, split or []):
        rank["transfer_s"], rank["skew_s"] = sum(x["transfer_s"]), sum(x["skew_s"])

    def mean(f):
        return statistics.fmean(f(r) for r in ranks)

    ops = sorted({op for r in ranks for op in r["tp"]})
    return {
        "ranks": ranks,
        "wall_s": mean(lambda r: r["wall_s"]),
        "a2a_share": mean(lambda r: r["a2a_s"] / r["wall_s"]),
        "transfer_share": mean(lambda r: r["transfer_s"] / r["wall_s"]) if split else None,
        "skew_share": mean(lambda r: r["skew_s"] / r["wall_s"]) if split else None,
        "tp_share": mean(lambda r: r["tp_s"] / r["wall_s"]),
        "rest_share": mean(lambda r: r["rest_s"] / r["wall_s"]),
        "a2a_bytes_per_token": mean(lambda r: r["a2a_bytes"] / max(r["tokens"], 1)),
        "tp_bytes_per_token": {op: mean(lambda r: r["tp"].get(op, {"bytes": 0})["bytes"] / max(r["tokens"], 1))
                               for op in ops},
        "tp_bytes_per_token_total": mean(lambda r: sum(v["bytes"] for v in r["tp"].values()) / max(r["tokens"], 1)),
        "tp_op_share": {op: mean(lambda r: r["tp"].get(op, {"s": 0.0})["s"] / r["wall_s"]) for op in ops},
    }


def format_table(runs: list) -> str:
    """A row per run: wall time, the shares, bytes per token and each TP op's share."""
    lines = [f"{'run':<48}{'wall s':>8}{'a2a':>7}{'transfer':>9}{'TP':>7}{'rest':>7}{'a2a B/tok':>11}"
             f"{'TP B/tok':>10}  TP by op"]
    for r in runs:
        name = r["spans"]
        by_op = ", ".join(f"{op} {share:.1%} ({r['tp_bytes_per_token'][op]:,.0f} B/tok)"
                          for op, share in r["tp_op_share"].items())
        transfer = "-" if r["transfer_share"] is None else f"{r['transfer_share']:.1%}"
        lines.append(f"{name[-48:]:<48}{r['wall_s']:>8.1f}{r['a2a_share']:>7.1%}{transfer:>9}{r['tp_share']:>7.1%}"
                     f"{r['rest_share']:>7.1%}{r['a2a_bytes_per_token']:>11,.0f}"
                     f"{r['tp_bytes_per_token_total']:>10,.0f}  {by_op or '-'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from megatron.common.cli import UserError, run_cli
    from megatron.common.files import write_json

    p = argparse.ArgumentParser(prog="python -m tools.profile.step_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", required=True, action="append", metavar="DIR",
                   help="a served run's a2a_spans directory (serve --a2a-spans); more than once: a row per run")
    p.add_argument("--json", metavar="OUT")

    def body():
        args = p.parse_args(argv)
        runs = []
        for spans in args.spans:
            records = read_spans_dir(spans)
            if not all(records) or any("end" not in rec for rank in records for rec in rank):
                raise UserError(f"--spans {spans}: a rank recorded no steps, or steps without their end")
            runs.append({"spans": spans, **run_time(records)})
        print(format_table(runs))
        if args.json:
            keys = ("a2a_share", "tp_share", "rest_share", "a2a_bytes_per_token", "tp_bytes_per_token_total")
            summary = {k: statistics.median(r[k] for r in runs) for k in keys}
            if all(r["transfer_share"] is not None for r in runs):
                summary.update({k: statistics.median(r[k] for r in runs) for k in ("transfer_share", "skew_share")})
            write_json(args.json, {"schema": "step-time/1", "runs": runs,
                                   "median": summary, "n": len(runs)})
            print(f"wrote {args.json}")
        return 0

    return run_cli("python -m tools.profile.step_time", body)


if __name__ == "__main__":
    sys.exit(main())
