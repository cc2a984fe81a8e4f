"""The replay's versions side by side on the runs a model is built on (``python -m netsim versions``).

A new replay version (``netsim.replay.MODELS``) must first do better in sample, on the runs the
model was built on, before a plan tests it out of configuration. For each validation given (a
``netsim validate --json`` output: it names its run, link table and fit; the profile lies beside
the run) this predicts the run again by every version and reports, per version and figure, the
mean absolute and the median signed relative error and how many points are predicted low, per run
and pooled over the runs. It also accounts for where the time goes: per variant, the engine's busy
time (compute and collectives inside steps) the replay gives against the server's
``engine_busy_s``, and the span from the first request sent to the last answered, both over every
repeat and rate of the run: a replay whose busy time matches but whose span is short leaves out
time between the steps.
"""

from __future__ import annotations

import statistics
from typing import Optional

from .cli import UserError, command, user_input
from .replay import MODELS, Engine, Link, StepProfile, simulate
from .validation import FIGURES, predict_run, rate_phases, validate_run

__all__ = ["accounting", "compare_versions", "pooled"]


def accounting(run: dict, profiles: dict, constants, table, version: str) -> dict:
    """Per variant: the replay's busy, loop and span seconds over every repeat and rate of ``run``
    against the server's ``engine_busy_s`` and the measured span (first send to last answer)."""
    from .validation import Request, model

    ranks = int(run["config"]["ranks"])
    tp = int(run["config"].get("tensor_model_parallel_size") or 1)
    server = run["config"]["server"]
    engine = Engine(ranks // tp, int(server["max_batch_tokens"]), int(server["max_requests"]) // 4 * 4)
    out = {}
    for v in run["config"]["variants"]:
        prof = dict(profiles[v])
        lar_run, lar_prof = run["variants"][v].get("lar"), prof.get("lar")
        if lar_run is not None and lar_prof is not None and lar_prof < 1:
            prof["a2a_bytes_per_token"] *= (1 - lar_run) / (1 - lar_prof)
        step, stats = StepProfile.from_dict(prof), {}
        span_replay = span_measured = 0.0
        for phase in rate_phases(run, v):
            lists = run["requests"][v][phase]
            for reqs in (lists if run.get("schema") == "bench_serve/2" else [lists]):
                ok = [r for r in reqs if r["ok"]]
                replayed = [Request(float(r["sent"]), int(r["prompt_tokens"]), max(1, int(r["output_tokens"])),
                                    r.get("dp_rank")) for r in ok]
                got = simulate(replayed, engine, step, Link(ranks, constants), table, model(version), stats)
                start = min(r.arrival_s for r in replayed)
                span_replay += max(r.arrival_s + g[1] for r, g in zip(replayed, got)) - start
                span_measured += max(float(r["sent"]) + float(r["e2e_s"]) for r in ok) - start
        busy = run["variants"][v].get("engine_busy_s")
        out[v] = {"busy_s": {"replay": stats.get("busy_s", 0.0), "measured": busy},
                  "loop_s": stats.get("loop_s", 0.0), "steps": stats.get("steps", 0),
                  "span_s": {"replay": span_replay, "measured": span_measured}}
    return out


def compare_versions(run: dict, profiles: dict, constants, table, versions=None) -> dict:
    """version -> ``{"validation": validate_run(...), "accounting": accounting(...)}``."""
    out = {}
    for version in versions or list(MODELS):
        pred = predict_run(run, profiles, constants, table, version)
        out[version] = {"validation": validate_run(run, pred, version),
                        "accounting": accounting(run, profiles, constants, table, version)}
    return out


def pooled(validations: list) -> dict:
    """Per figure over the counted points of ``validations``: n, mean absolute and median signed
    relative error, and how many are predicted low."""
    out = {}
    for fig in FIGURES:
        errs = [r["relative_error"] for v in validations for r in v["rows"] if r["counted"] and r["figure"] == fig]
        out[fig] = {"points": len(errs), "low": sum(e < 0 for e in errs),
                    "mean_abs_rel_error": statistics.fmean(abs(e) for e in errs) if errs else None,
                    "median_rel_error": statistics.median(errs) if errs else None}
    return out


@user_input()
def _inputs(items: list) -> list:
    """``(name, run, profile, constants, table)`` of each ``NAME=VALIDATE_JSON``. The run is the
    ``serve.json.gz`` beside the validation where there is one (``docs/figures/netsim_validation/``
    keeps its runs that way), else the one it names; a fit named by an absolute path that is gone
    is looked for in ``examples/netsim/``."""
    import os

    from .link_table import LinkTable
    from .validation import load_fit, profile_path, read_json

    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserError(f"{item!r}: expected NAME=VALIDATE_JSON")
        validation = read_json(path, name)
        if not isinstance(validation, dict) or validation.get("schema") != "netsim-validate/1":
            raise UserError(f"{name}: {path} is not a `python -m netsim validate --json` output")
        serve = os.path.join(os.path.dirname(path), "serve.json.gz")
        serve = serve if os.path.exists(serve) else validation["bench_serve"]
        fit = validation["fit"]
        if not os.path.exists(fit) and os.path.isabs(fit):
            fit = os.path.join("examples", "netsim", os.path.basename(fit))
        out.append((name, read_json(serve, f"{name}'s run"), read_json(profile_path(serve), f"{name}'s profile"),
                    load_fit(fit), LinkTable.from_calibrations(validation["link_table"])))
    return out


def _configure(p):
    p.add_argument("validations", nargs="+", metavar="NAME=VALIDATE_JSON",
                   help="each run as `python -m netsim validate --json` wrote it (its run, link table and fit; the "
                   "profile beside the run)")
    p.add_argument("--json", metavar="OUT", help="write the comparison here")


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


@command("versions", "every replay model version on the runs given: errors per run and pooled, and the time "
         "accounting", _configure)
def _versions(args) -> int:
    from megatron.common.files import write_json

    runs = {name: compare_versions(run, profile["variants"], constants, table)
            for name, run, profile, constants, table in _inputs(args.validations)}
    versions = list(MODELS)
    print(f"{'run':<20}" + "".join(f"{m.split()[0] + ' ' + f[:4]:>15}" for m in versions for f in FIGURES))
    for name, by in runs.items():
        print(f"{name:<20}" + "".join(
            f"{by[m]['validation']['by_figure'][f]['mean_abs_rel_error'] * 100:>14.1f}%" for m in versions
            for f in FIGURES))
    total = {m: pooled([by[m]["validation"] for by in runs.values()]) for m in versions}
    for m in versions:
        print(f"{m} pooled: " + "; ".join(
            f"{f} {c['mean_abs_rel_error'] * 100:.1f}% (median {_pct(c['median_rel_error'])}, {c['low']}/{c['points']} "
            "low)" for f, c in total[m].items()))
    print("time accounting, replay / measured over every repeat and rate: busy (inside steps) and span (first "
          "send to last answer)")
    print(f"  {'run':<20}{'variant':<16}" + "".join(f"{m.split()[0] + ' ' + k:>15}" for m in versions
                                                  for k in ("busy", "span")))
    for name, by in runs.items():
        for v in by[versions[0]]["accounting"]:
            cells = []
            for m in versions:
                a = by[m]["accounting"][v]
                for k in ("busy_s", "span_s"):
                    cells.append(a[k]["replay"] / a[k]["measured"] if a[k]["measured"] else float("nan"))
            print(f"  {name:<20}{v:<16}" + "".join(f"{c:>15.2f}" for c in cells))
    if args.json:
        write_json(args.json, {"schema": "netsim-versions/1", "versions": versions, "pooled": total, "runs": runs})
        print(f"wrote {args.json}")
    return 0
