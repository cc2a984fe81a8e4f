"""Compare a served run's all-to-alls with netsim's replay, step by step.

    python -m tools.profile.replay_steps --spans WORK/serve-standard-run0/a2a_spans --profile serve.profile.json \\
        --variant standard --link-table TABLE/*.csv [--json OUT]

``serve --a2a-spans`` (bench_serve records it) writes every engine step's all-to-alls per rank,
with the step's start and end, its real tokens and the bytes the rank sent. For each step this
takes the measured all-to-all time (per call: the last rank's exit minus the last rank's entry,
so rank skew is left out) and what the replay charges for a step of those tokens
(``netsim.replay.step_all_to_all_s`` on the link table, with the step's measured compute laid
around the calls as the profile says and each rank link's rest carried from step to step). A
tensor-parallel engine's spans also carry its TP all-reduces and gathers (``"tp"``): they count
as measured collectives and the replay adds its own.
Per kind it also sums the steps' wall time (first rank's start to last rank's end) and the
compute used, so what is left (``skew``) is the time ranks spent waiting on each other inside
collectives, which the replay does not model. Steps are grouped as prefill (a rank forwards more tokens than
``max_requests``), decode, and those where one rank runs the dummy forward. Tokens are padded as
the engine pads them (``Engine.padded``; a step of at most ``max_requests`` tokens counts as decode).

Between the steps: the servers also record every loop iteration's phases (``loop_rank<R>.jsonl``,
``megatron.inference.loop.iteration_record``). For the iterations that stepped, grouped by what the
loop exchanged (requests brought: the commands' broadcast; token updates gathered; neither), this
gives each phase's median and mean on each rank and what each replay model version charges for
such an iteration (``netsim.replay.loop_control_s``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def compare(spans_by_rank: list, profile, engine, table) -> dict:
    from netsim.replay import dispatch_flows, rest_links, step_all_to_all_s

    rest = [[math.inf, math.inf] for _ in spans_by_rank]
    prev_end = None
    out: dict = {}
    for steps in zip(*spans_by_rank):
        if any(len(s["spans"]) != len(steps[0]["spans"]) for s in steps):
            raise ValueError("the ranks recorded different collectives in one step")
        calls = list(zip(*(s["spans"] for s in steps)))
        tp_calls = list(zip(*(s.get("tp", []) for s in steps)))  # a TP engine's all-reduces and gathers
        measured = sum(max(c[2] for c in call) - max(c[1] for c in call) for call in calls) \
            + sum(max(c[3] for c in call) - max(c[2] for c in call) for call in tp_calls)
        compute = max((s["end"] - s["t"]) - sum(e - b for _, b, e in s["spans"])
                      - sum(c[3] - c[2] for c in s.get("tp", [])) for s in steps)
        gathered = [c[0][1] for c in tp_calls if c[0][0] == "all_gather"]
        requests = round(gathered[0] / profile.tp_gather_bytes_per_request) if gathered and \
            profile.tp_gather_bytes_per_request else 0
        if prev_end is not None:
            idle = max(0.0, steps[0]["t"] - prev_end)
            rest_links(rest, idle)
        prev_end = steps[0]["end"]
        tokens = [int(s["tokens"]) for s in steps]
        padded = [engine.padded(n, decode_only=n <= engine.max_requests) if n else 0 for n in tokens]
        kind = "dummy" if 0 in tokens else ("prefill" if max(tokens) > engine.max_requests else "decode")
        model = step_all_to_all_s(table, profile, padded, compute, rest, requests=requests, decode=kind == "decode")
        row = out.setdefault(kind, {"steps": 0, "measured_s": 0.0, "replay_s": 0.0, "bytes_measured": 0,
                                    "bytes_model": 0.0, "wall_s": 0.0, "compute_s": 0.0})
        row["steps"] += 1
        row["wall_s"] += max(s["end"] for s in steps) - min(s["t"] for s in steps)
        row["compute_s"] += compute
        row["measured_s"] += measured
        row["replay_s"] += model
        row["bytes_measured"] += max(int(s["bytes"]) for s in steps)
        layers, own, others = dispatch_flows(profile, padded)
        row["bytes_model"] += layers * max(o + b for o, b in zip(own, others))  # each layer: dispatch + combine
    return out


def _open(path: str):
    """``path``, or ``path.gz`` where only that exists (committed records are gzipped)."""
    import gzip

    return open(path) if os.path.exists(path) or not os.path.exists(path + ".gz") else gzip.open(path + ".gz", "rt")


def loop_summary(loops_by_rank: list, charge) -> dict:
    """Per kind of iteration that stepped (``arrived``: brought requests; ``gathered``: only gathered
    token updates; ``neither``), per rank: ``n`` and each phase's and the exchange's (every phase but
    the step) median and mean seconds; ``charge(arrived, gathered)``: version -> the replay's seconds."""
    import statistics

    out: dict = {}
    for rank, records in enumerate(loops_by_rank):
        for r in records:
            if not r["stepped"]:
                continue
            kind = "arrived" if r["arrived"] else ("gathered" if r["gathered"] else "neither")
            row = out.setdefault(kind, {"replay_s": charge(bool(r["arrived"]), bool(r["gathered"])), "ranks": {}})
            cell = row["ranks"].setdefault(str(rank), {})
            phases = dict(r["phases"])
            phases["exchange"] = sum(v for k, v in r["phases"].items() if k != "step")
            for k, v in phases.items():
                cell.setdefault(k, []).append(v)
    for row in out.values():
        for rank, cell in row["ranks"].items():
            row["ranks"][rank] = {"n": len(cell["exchange"]), **{
                k: {"median_s": statistics.median(v), "mean_s": statistics.fmean(v)} for k, v in cell.items()}}
    return out


def loop_totals(spans_by_rank: list, loops_by_rank: list) -> list:
    """Per rank, over the iterations that stepped: their count, the seconds of their engine steps
    (the loop's ``step`` phase: the whole ``RankEngine.step``) and of their exchange (every other
    phase), and how far each step reaches beyond its recorded span (``t`` to ``end``: the forward,
    which the server's ``engine_busy_s`` counts; beyond it, the engine's bookkeeping after the
    forward), median and mean over the steps matched to a span."""
    import bisect
    import statistics

    out = []
    for spans, loops in zip(spans_by_rank, loops_by_rank):
        starts = [s["t"] for s in spans]
        stepped = [r for r in loops if r["stepped"]]
        beyond = []
        for r in stepped:
            begin = r["t"] + sum(v for k, v in r["phases"].items() if k != "step")
            end = begin + r["phases"]["step"]
            i = bisect.bisect_left(starts, begin)
            if i < len(spans) and spans[i]["t"] <= end:
                beyond.append(r["phases"]["step"] - (spans[i]["end"] - spans[i]["t"]))
        out.append({"iterations": len(stepped), "step_s": sum(r["phases"]["step"] for r in stepped),
                    "exchange_s": sum(v for r in stepped for k, v in r["phases"].items() if k != "step"),
                    "beyond_span": {"n": len(beyond), "median_s": statistics.median(beyond) if beyond else None,
                                    "mean_s": statistics.fmean(beyond) if beyond else None}})
    return out


def main(argv=None) -> int:
    from megatron.common.cli import UserError, run_cli, user_input
    from megatron.common.files import write_json

    p = argparse.ArgumentParser(prog="replay_steps.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", required=True, metavar="DIR", help="a served run's a2a_spans directory")
    p.add_argument("--profile", required=True, metavar="JSON", help="a serving compute profile (python -m tools.profile.serving_compute)")
    p.add_argument("--variant", required=True)
    p.add_argument("--link-table", required=True, nargs="+", metavar="CSV")
    p.add_argument("--fit", metavar="JSON", default="examples/netsim/gloo_netns_fit.json",
                   help="the collective fit replay/7 prices the loop's exchange with (netsim validate's --fit)")
    p.add_argument("--json", metavar="OUT")

    def body():
        from netsim.link_table import LinkTable
        from netsim.replay import MODEL_VERSION, Engine, StepProfile

        args = p.parse_args(argv)
        try:
            with open(args.profile) as f:
                prof = json.load(f)
            variant = prof["variants"][args.variant]
            engine = Engine(int(prof["ranks"]), int(prof["engine"]["max_batch_tokens"]),
                            int(prof["engine"]["max_requests"]) // 4 * 4)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"--profile {args.profile}: no variant {args.variant!r} in a readable profile ({err})") from None
        try:
            profile = StepProfile.from_dict(variant)
        except ValueError as err:
            raise UserError(f"--profile {args.profile}: {args.variant!r}: {err}") from None
        spans = []
        for r in range(engine.ranks):
            path = os.path.join(args.spans, f"a2a_spans_rank{r}.jsonl")
            try:
                with _open(path) as f:
                    spans.append([json.loads(line) for line in f if line.strip()])
            except (OSError, ValueError) as err:
                raise UserError(f"--spans {args.spans}: {path} is not readable ({err})") from None
        if any("end" not in s or "tokens" not in s for lines in spans for s in lines):
            raise UserError(f"--spans {args.spans}: lines without the step's end and tokens (recorded by an older "
                            "serve --a2a-spans)")
        with user_input():
            table = LinkTable.from_calibrations(args.link_table)
        out = compare(spans, profile, engine, table)
        loops = []
        for r in range(engine.ranks * profile.tp):
            path = os.path.join(args.spans, f"loop_rank{r}.jsonl")
            if os.path.exists(path) or os.path.exists(path + ".gz"):
                try:
                    with _open(path) as f:
                        loops.append([json.loads(line) for line in f if line.strip()])
                except (OSError, ValueError) as err:
                    raise UserError(f"--spans {args.spans}: {path} is not readable ({err})") from None
        between = totals = None
        if loops:
            from netsim.replay import MODELS, Link, loop_control_s
            from netsim.validation import load_fit

            with user_input():
                link = Link(engine.ranks * profile.tp, load_fit(args.fit))
            between = loop_summary(loops, lambda arrived, gathered: {
                m.name: loop_control_s(m, profile, link, table, arrived, gathered) for m in MODELS.values()})
            totals = loop_totals(spans, loops)
        print(f"{MODEL_VERSION}: collective seconds per kind of step (measured, and the replay's on the link table)")
        print(f"{'steps':<8}{'n':>6}{'measured s':>12}{'replay s':>12}{'MB measured':>13}{'MB model':>10}"
              f"{'wall s':>9}{'compute s':>11}{'skew s':>8}")
        for kind, r in out.items():
            skew = r["wall_s"] - r["compute_s"] - r["measured_s"]
            print(f"{kind:<8}{r['steps']:>6}{r['measured_s']:>12.2f}{r['replay_s']:>12.2f}"
                  f"{r['bytes_measured'] / 1e6:>13.1f}{r['bytes_model'] / 1e6:>10.1f}{r['wall_s']:>9.2f}"
                  f"{r['compute_s']:>11.2f}{skew:>8.2f}")
        if between:
            names = list(next(iter(between.values()))["replay_s"])
            print("the loop's exchange between steps, per kind of iteration that stepped (ms; median / mean)")
            print(f"{'iteration':<10}{'rank':>5}{'n':>6}{'header':>14}{'broadcast':>14}{'gather':>14}{'own work':>14}"
                  f"{'exchange':>14}" + "".join(f"{n:>10}" for n in names))
            for kind, row in between.items():
                for rank, c in row["ranks"].items():
                    def ms(k, c=c):
                        return f"{c[k]['median_s'] * 1e3:.2f} / {c[k]['mean_s'] * 1e3:.2f}"
                    own = {a: c["work"][a] + c["adds"][a] for a in ("median_s", "mean_s")}
                    print(f"{kind:<10}{rank:>5}{c['n']:>6}{ms('header'):>14}{ms('broadcast'):>14}{ms('gather'):>14}"
                          f"{own['median_s'] * 1e3:>6.2f} / {own['mean_s'] * 1e3:.2f}{ms('exchange'):>14}"
                          + "".join(f"{row['replay_s'][n] * 1e3:>10.2f}" for n in names))
            for rank, tot in enumerate(totals):
                b = tot["beyond_span"]
                beyond = "no step matched to a recorded span" if not b["n"] else (
                    f"a step lasts {b['median_s'] * 1e3:.2f} ms (median; mean {b['mean_s'] * 1e3:.2f}) beyond its "
                    "recorded span")
                print(f"rank {rank}: {tot['iterations']} iterations that stepped: steps {tot['step_s']:.2f} s, "
                      f"exchange {tot['exchange_s']:.2f} s; {beyond}")
        if args.json:
            write_json(args.json, {"schema": "replay-steps/1", "model_version": MODEL_VERSION, "spans": args.spans, "profile": args.profile,
                                   "variant": args.variant, "link_table": args.link_table, "by_kind": out,
                                   "between_steps": between, "loop_totals": totals})
            print(f"wrote {args.json}")
        return 0

    return run_cli("replay_steps.py", body)


if __name__ == "__main__":
    sys.exit(main())
