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


def main(argv=None) -> int:
    from megatron.common.cli import UserError, run_cli, user_input
    from megatron.common.files import write_json

    p = argparse.ArgumentParser(prog="replay_steps.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", required=True, metavar="DIR", help="a served run's a2a_spans directory")
    p.add_argument("--profile", required=True, metavar="JSON", help="a serving compute profile (python -m tools.profile.serving_compute)")
    p.add_argument("--variant", required=True)
    p.add_argument("--link-table", required=True, nargs="+", metavar="CSV")
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
                with open(path) as f:
                    spans.append([json.loads(line) for line in f if line.strip()])
            except (OSError, ValueError) as err:
                raise UserError(f"--spans {args.spans}: {path} is not readable ({err})") from None
        if any("end" not in s or "tokens" not in s for lines in spans for s in lines):
            raise UserError(f"--spans {args.spans}: lines without the step's end and tokens (recorded by an older "
                            "serve --a2a-spans)")
        with user_input():
            table = LinkTable.from_calibrations(args.link_table)
        out = compare(spans, profile, engine, table)
        print(f"{MODEL_VERSION}: collective seconds per kind of step (measured, and the replay's on the link table)")
        print(f"{'steps':<8}{'n':>6}{'measured s':>12}{'replay s':>12}{'MB measured':>13}{'MB model':>10}"
              f"{'wall s':>9}{'compute s':>11}{'skew s':>8}")
        for kind, r in out.items():
            skew = r["wall_s"] - r["compute_s"] - r["measured_s"]
            print(f"{kind:<8}{r['steps']:>6}{r['measured_s']:>12.2f}{r['replay_s']:>12.2f}"
                  f"{r['bytes_measured'] / 1e6:>13.1f}{r['bytes_model'] / 1e6:>10.1f}{r['wall_s']:>9.2f}"
                  f"{r['compute_s']:>11.2f}{skew:>8.2f}")
        if args.json:
            write_json(args.json, {"schema": "replay-steps/1", "model_version": MODEL_VERSION, "spans": args.spans, "profile": args.profile,
                                   "variant": args.variant, "link_table": args.link_table, "by_kind": out})
            print(f"wrote {args.json}")
        return 0

    return run_cli("replay_steps.py", body)


if __name__ == "__main__":
    sys.exit(main())
