"""Per-collective overlap of one step from an EP-benchmark Chrome trace (``bench_ep.py --trace DIR``).

    python -m tools.bench.trace_overlap DIR/trace_farskip_rank0.json [--json out.json]

For every all-to-all of the step (forward dispatch/combine, their backward, the routing-probability
``meta`` exchange) it prints the time in flight, the time the compute thread waited for it
(exposed), and the *window*: how long the compute thread worked between the launch and the
wait (traces without a wait for a collective count its time in flight). Summed per kind; per direction the time
in flight is the wall time with any all-to-all in flight (concurrent ones count once, as in the
benchmark's overlap fraction). With the forward's compute phases (FarSkip layers record them), so one can see which collective is exposed
and whether the window or the collective is too short; per direction, the bound the schedule's
windows allow (paper Eq. 9; ``tools/bench/overlap.py`` defines it).
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron.common.cli import run_cli, user_input
from megatron.common.files import write_json
from tools.bench.overlap import summarize

PROG = "trace_overlap.py"


def load_trace(path: str) -> list[dict]:
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read trace ({e})") from None
    try:
        lanes = {e["tid"]: e["args"]["name"] for e in trace.get("traceEvents", []) if e.get("ph") == "M"}
        events = []
        for e in trace.get("traceEvents", []):
            if e.get("ph") == "X":
                start = e["ts"] / 1e3
                events.append({"name": e["name"], "lane": lanes.get(e["tid"], "?"), "start": start,
                               "end": start + e["dur"] / 1e3})
    except (AttributeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a Chrome trace of bench_ep.py --trace (bad event: {e!r})") from None
    if not events:
        raise ValueError(f"{path}: no events (was it written by bench_ep.py --trace?)")
    return events


def format_summary(s: dict) -> str:
    lines = [f"step {s['step_ms']:.1f} ms" if s["step_ms"] else "step: not recorded"]
    for name, d in s["directions"].items():
        ov = "-" if d["overlap"] is None else f"{100 * d['overlap']:.1f}%"
        bound = "-" if d["bound"] is None else f"{100 * d['bound']:.1f}%"
        lines.append(f"{name:9s} in flight {d['in_flight_ms']:8.1f} ms  exposed {d['exposed_ms']:8.1f} ms  overlap {ov}"
                     f"  bound {bound} (compute in windows {d['window_compute_ms']:.1f} ms)")
    lines.append("")
    lines.append(f"{'collective':16s} {'n':>3s} {'exposed n':>9s} {'in flight ms':>13s} {'window ms':>10s} "
                 f"{'exposed ms':>11s}")
    for name, k in s["kinds"].items():
        lines.append(f"{name:16s} {k['count']:3d} {k['exposed_count']:9d} {k['in_flight_ms']:13.1f} "
                     f"{k['window_ms']:10.1f} {k['exposed_ms']:11.1f}")
    if s["forward_phases_ms"]:
        lines.append("")
        lines.append("forward phases (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in s["forward_phases_ms"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a trace_<variant>_rank<r>.json written by bench_ep.py --trace")
    ap.add_argument("--json", help="also write the summary (with every collective) here")

    def body():
        args = ap.parse_args(argv)
        with user_input():
            events = load_trace(args.trace)
        summary = summarize(events)
        print(format_summary(summary))
        if args.json:
            write_json(args.json, summary)

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
