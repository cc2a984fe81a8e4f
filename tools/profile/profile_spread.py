"""How far apart profiles of the same checkpoints are: the stability check of a profiling method.

    python -m tools.profile.profile_spread runs/p1.json runs/p2.json runs/p3.json --json spread.json

Given several ``serving_compute`` profiles of the same checkpoints (taken at different times), this
prints, per variant and per fitted cost, each profile's value, their median and their spread
``max / min - 1``, and says whether every spread is within ``--goal`` (default 5%). A method whose
profiles move by more than the error a model built on them is held to cannot support that model.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys

SCHEMA = "profile-spread/1"
COSTS = ("fixed_s", "per_token_s", "per_request_s", "dummy_s", "iteration_s")


def spread(profiles: list, goal: float) -> dict:
    """Per variant common to all ``profiles`` (``serving-compute-profile/1`` dicts) and per cost in
    ``COSTS``: the values in order, their median, ``max / min - 1`` (``None`` where a value is 0) and
    each profile's own 95% half-width (``half_widths``, where the profiles state one);
    ``within_goal``: every spread of a cost other than ``per_request_s`` (a small term, often fitted
    as 0) is at most ``goal``."""
    variants = [v for v in profiles[0]["variants"] if all(v in p["variants"] for p in profiles)]
    if not variants:
        raise ValueError("the profiles have no variant in common")
    out: dict = {}
    for v in variants:
        out[v] = {}
        for cost in COSTS:
            values = [float(p["variants"][v][cost]) for p in profiles]
            own = [p["variants"][v].get("precision", {}).get("costs", {}).get(cost, {}).get("half_width")
                   for p in profiles]  # each profile's own 95% interval, where it states one
            out[v][cost] = {"values": values, "median": statistics.median(values),
                            "spread": max(values) / min(values) - 1 if min(values) > 0 else None,
                            "half_widths": own if any(h is not None for h in own) else None}
    judged = [c["spread"] for by_cost in out.values() for k, c in by_cost.items() if k != "per_request_s"]
    return {"schema": SCHEMA, "profiles": len(profiles), "goal": goal, "variants": out,
            "largest_spread": max(s for s in judged if s is not None),
            "within_goal": all(s is not None and s <= goal for s in judged)}


def format_table(result: dict) -> str:
    scale = {"fixed_s": (1e3, "ms"), "dummy_s": (1e3, "ms"), "iteration_s": (1e3, "ms"),
             "per_token_s": (1e6, "us"), "per_request_s": (1e6, "us")}
    n = result["profiles"]
    lines = [f"{'variant':<10} {'cost':<14} " + " ".join(f"{'#' + str(i + 1):>8}" for i in range(n))
             + f" {'median':>8} {'spread':>8}"]
    for v, by_cost in result["variants"].items():
        for cost, c in by_cost.items():
            k, unit = scale[cost]
            spread_ = "-" if c["spread"] is None else f"{c['spread']:.1%}"
            lines.append(f"{v:<10} {cost + ' (' + unit + ')':<14} " + " ".join(f"{x * k:>8.2f}" for x in c["values"])
                         + f" {c['median'] * k:>8.2f} {spread_:>8}")
    verdict = "within" if result["within_goal"] else "outside"
    lines.append(f"largest spread {result['largest_spread']:.1%}: {verdict} the {result['goal']:.0%} goal")
    return "\n".join(lines)


def main(argv=None) -> int:
    from megatron.common.cli import UserError, positive_float, run_cli
    from megatron.common.files import write_json

    p = argparse.ArgumentParser(prog="python -m tools.profile.profile_spread", description=__doc__.split("\n\n")[0])
    p.add_argument("profiles", nargs="+", metavar="PROFILE", help="serving_compute profile JSONs, plain or .gz "
                   "(2 or more)")
    p.add_argument("--goal", type=positive_float, default=0.05, help="largest spread allowed (default 0.05)")
    p.add_argument("--json", default=None, help="write the result here")

    def body():
        args = p.parse_args(argv)
        if len(args.profiles) < 2:
            raise UserError("give at least 2 profiles to compare")
        profiles = []
        for path in args.profiles:
            try:
                with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
                    prof = json.load(f)
                if not str(prof.get("schema", "")).startswith("serving-compute-profile/"):
                    raise ValueError("no serving-compute-profile schema")
            except (OSError, ValueError, AttributeError) as err:
                raise UserError(f"{path}: not a serving_compute profile ({err})") from None
            profiles.append(prof)
        try:
            result = spread(profiles, args.goal)
        except (ValueError, KeyError) as err:
            raise UserError(f"the profiles cannot be compared ({err})") from None
        result["files"] = list(args.profiles)
        print(format_table(result))
        if args.json:
            write_json(args.json, result)
            print(f"wrote {args.json}")
        return 0

    return run_cli("python -m tools.profile.profile_spread", body)


if __name__ == "__main__":
    sys.exit(main())
