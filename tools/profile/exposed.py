"""Where a served run's exposed expert communication is: per MoE layer and collective.

    python -m tools.profile.exposed --spans WORK/serve-farskip-run0/a2a_spans [--spans ...] [--min-tokens 64] [--json OUT]

``serve --a2a-spans`` records, per engine step and rank, every expert collective in launch order
(``spans``: launch to completion) and when the compute thread asked for each one's result until it
had it (``waits``, one per collective, in the order they were asked for). The k-th span of a name
in a step belongs to the k-th MoE layer; it is paired with the k-th wait of that name. A
collective's exposed time is the part of its flight the thread spent waiting,
``max(0, done - max(asked, launched))`` (``moe_variants.common.timing.span_seconds``, what the
server's counters book). Summed over the steps with at least ``--min-tokens`` real tokens on a rank
(prefill steps, say) and over the ranks, per layer and collective: the time in flight, the time
exposed and the share hidden, ``1 - exposed / in flight``. The sum of the layers' exposed time is
what a schedule has left to hide; the layers and collectives that hold most of it are where. Per
collective kind the same sums (``by_kind``), with the last MoE layer's apart: its combine has no next
layer to hide behind. ``--spans`` given more than once pools runs (their ranks' records side by side).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys


def exposed_by_layer(records_by_rank: list, min_tokens: int = 1) -> dict:
    """``{"collectives": {kind: {layer: {"n", "in_flight_s", "exposed_s"}}}, "steps", "in_flight_s",
    "exposed_s", "hidden"}`` over every rank's records with at least ``min_tokens`` real tokens."""
    from moe_variants.common.timing import span_seconds

    out: dict = collections.defaultdict(lambda: collections.defaultdict(
        lambda: {"n": 0, "in_flight_s": 0.0, "exposed_s": 0.0}))
    steps = 0
    for records in records_by_rank:
        for rec in records:
            if rec.get("tokens", 0) < min_tokens or "waits" not in rec:
                continue
            steps += 1
            waits = collections.defaultdict(list)
            for name, start, end in rec["waits"]:
                waits[name].append(start)
            seen: dict = collections.Counter()
            for name, start, done in rec["spans"]:
                layer = seen[name]
                seen[name] += 1
                asked = waits[name][layer] if layer < len(waits[name]) else done  # never waited for
                _, done, exposed = span_seconds(start, done, asked)
                cell = out[name][layer]
                cell["n"] += 1
                cell["in_flight_s"] += done - start
                cell["exposed_s"] += exposed
    in_flight = sum(c["in_flight_s"] for kind in out.values() for c in kind.values())
    exposed = sum(c["exposed_s"] for kind in out.values() for c in kind.values())
    return {"steps": steps, "in_flight_s": in_flight, "exposed_s": exposed,
            "hidden": 1 - exposed / in_flight if in_flight else None,
            "collectives": {kind: {str(layer): dict(c) for layer, c in sorted(layers.items())}
                            for kind, layers in out.items()}}


def by_kind(result: dict) -> dict:
    """``{kind: {"in_flight_s", "exposed_s", "hidden", "share_of_exposed", "last_layer": {...}}}`` summed
    over the layers of ``exposed_by_layer``'s result; ``last_layer`` is the last MoE layer's cell alone."""
    total = result["exposed_s"]
    out = {}
    for kind, layers in result["collectives"].items():
        in_flight = sum(c["in_flight_s"] for c in layers.values())
        exposed = sum(c["exposed_s"] for c in layers.values())
        last = layers[max(layers, key=int)]
        out[kind] = {"in_flight_s": in_flight, "exposed_s": exposed,
                     "hidden": 1 - exposed / in_flight if in_flight else None,
                     "share_of_exposed": exposed / total if total else None,
                     "last_layer": {"layer": int(max(layers, key=int)), "in_flight_s": last["in_flight_s"],
                                    "exposed_s": last["exposed_s"],
                                    "share_of_exposed": last["exposed_s"] / total if total else None}}
    return out


def read_spans_dir(spans: str) -> list:
    """Every rank's step records in a ``serve --a2a-spans`` directory (``a2a_spans_rank<R>.jsonl``,
    gzipped or not), rank by rank; UserError naming the directory when it has none or one is unreadable."""
    import gzip

    from megatron.common.cli import UserError

    names = sorted(n for n in (os.listdir(spans) if os.path.isdir(spans) else [])
                   if n.startswith("a2a_spans_rank") and n.endswith((".jsonl", ".jsonl.gz")))
    if not names:
        raise UserError(f"--spans {spans}: no a2a_spans_rank<R>.jsonl files there")
    out = []
    try:
        for name in names:
            path = os.path.join(spans, name)
            with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
                out.append([json.loads(line) for line in f if line.strip()])
    except (OSError, ValueError) as err:
        raise UserError(f"--spans {spans}: not readable ({err})") from None
    return out


def format_table(result: dict) -> str:
    """Per collective kind, a row per layer: in flight, exposed (ms) and its share of all exposed."""
    total = result["exposed_s"] or float("nan")
    lines = [f"{'collective':<10}{'layer':>6}{'n':>6}{'in flight ms':>14}{'exposed ms':>12}{'hidden':>8}"
             f"{'share of exposed':>18}"]
    for kind, layers in result["collectives"].items():
        for layer, c in layers.items():
            hidden = 1 - c["exposed_s"] / c["in_flight_s"] if c["in_flight_s"] else float("nan")
            lines.append(f"{kind:<10}{layer:>6}{c['n']:>6}{c['in_flight_s'] * 1e3:>14.1f}{c['exposed_s'] * 1e3:>12.1f}"
                         f"{hidden:>8.1%}{c['exposed_s'] / total:>18.1%}")
    lines.append(f"{'by kind':<10}{'':>6}{'':>6}{'in flight ms':>14}{'exposed ms':>12}{'hidden':>8}"
                 f"{'share of exposed':>18}")
    for kind, c in by_kind(result).items():
        last = c["last_layer"]
        hidden = "-" if c["hidden"] is None else f"{c['hidden']:.1%}"
        lines.append(f"{kind:<10}{'all':>6}{'':>6}{c['in_flight_s'] * 1e3:>14.1f}{c['exposed_s'] * 1e3:>12.1f}"
                     f"{hidden:>8}{c['exposed_s'] / total:>18.1%}")
        lines.append(f"{'':<10}{'last':>6}{last['layer']:>6}{last['in_flight_s'] * 1e3:>14.1f}"
                     f"{last['exposed_s'] * 1e3:>12.1f}{'':>8}{last['exposed_s'] / total:>18.1%}")
    hidden = "-" if result["hidden"] is None else f"{result['hidden']:.1%}"
    lines.append(f"{result['steps']} rank-steps: {result['in_flight_s'] * 1e3:.1f} ms in flight, "
                 f"{result['exposed_s'] * 1e3:.1f} ms exposed, {hidden} hidden")
    return "\n".join(lines)


def main(argv=None) -> int:
    from megatron.common.cli import UserError, positive_int, run_cli
    from megatron.common.files import write_json

    p = argparse.ArgumentParser(prog="python -m tools.profile.exposed", description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", required=True, action="append", metavar="DIR",
                   help="a served run's a2a_spans directory (serve --a2a-spans); more than once: runs pooled")
    p.add_argument("--min-tokens", type=positive_int, default=1,
                   help="only steps with at least this many real tokens on the rank (e.g. above max_requests: "
                   "prefill steps)")
    p.add_argument("--json", metavar="OUT")

    def body():
        args = p.parse_args(argv)
        records = []
        for spans in args.spans:
            run = read_spans_dir(spans)
            if not any("waits" in r for rank in run for r in rank):
                raise UserError(f"--spans {spans}: the records have no waits (recorded by an older serve "
                                "--a2a-spans)")
            records += run
        result = exposed_by_layer(records, args.min_tokens)
        print(format_table(result))
        if args.json:
            write_json(args.json, {"schema": "exposed-by-layer/2", "spans": args.spans, "min_tokens": args.min_tokens,
                                   **result, "by_kind": by_kind(result)})
            print(f"wrote {args.json}")
        return 0

    return run_cli("python -m tools.profile.exposed", body)


if __name__ == "__main__":
    sys.exit(main())
