"""The replay's versions side by side on the runs a model is built on (``python -m netsim versions``).

A new replay version (``netsim.replay.MODELS``) must first do better in sample, on the runs the
model was built on, before a plan tests it out of configuration. For each validation given (a
``netsim validate --json`` output: it names its run, link table and fit; the profile lies beside
the run) this predicts the run again by every version and reports, per version and figure, the
mean absolute and the median signed relative error and how many points are predicted low, per run
and pooled over the runs. It also accounts for where the time goes: per variant, the replay's time
inside steps (compute and collectives) against the server's ``engine_busy_s``, and the span from
the first request sent to the last answered, both over every repeat and rate of the run. The
server counts a step's forward (its recorded span) and the profile the whole engine step, which
lasts a few milliseconds longer: equal busy times mean served steps slower than profiled ones
(``tools.profile.replay_steps`` measures the difference from the loop's records).
"""

from __future__ import annotations

import os
import statistics
from typing import Optional

from megatron.common.cli import user_input

from .link_table import LinkTable
from .replay import MODELS, Request, model, simulate
from .validation import (FIGURES, load_fit, predict_run, profile_path, rate_phases, read_json, read_validations,
                         replay_setup, validate_run)

__all__ = ["accounting", "compare_versions", "pooled", "compare_all", "format_versions"]


def accounting(run: dict, profiles: dict, constants, table, version: str) -> dict:
    """Per variant: the replay's busy, loop and span seconds over every repeat and rate of ``run``
    against the server's ``engine_busy_s`` and the measured span (first send to last answer)."""
    engine, link, steps = replay_setup(run, profiles, constants, table)
    out = {}
    for v, step in steps.items():
        stats: dict = {}
        span_replay = span_measured = 0.0
        for phase in rate_phases(run, v):
            lists = run["requests"][v][phase]
            for reqs in (lists if run.get("schema") == "bench_serve/2" else [lists]):
                ok = [r for r in reqs if r["ok"]]
                replayed = [Request(float(r["sent"]), int(r["prompt_tokens"]), max(1, int(r["output_tokens"])),
                                    r.get("dp_rank")) for r in ok]
                got = simulate(replayed, engine, step, link, table, model(version), stats)
                start = min(r.arrival_s for r in replayed)
                span_replay += max(r.arrival_s + g[1] for r, g in zip(replayed, got)) - start
                span_measured += max(float(r["sent"]) + float(r["e2e_s"]) for r in ok) - start
        out[v] = {"busy_s": {"replay": stats.get("busy_s", 0.0), "measured": run["variants"][v].get("engine_busy_s")},
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


def compare_all(items: list) -> dict:
    """The ``netsim-versions/1`` document of ``python -m netsim versions``: per ``NAME=VALIDATE_JSON``
    (``validation.read_validations``) ``compare_versions``, and ``pooled`` per version. A fit named by
    an absolute path that is gone is looked for in ``examples/netsim/``."""
    runs = {}
    for name, validation, run, serve in read_validations(items, with_path=True):
        with user_input():
            fit = validation["fit"]
            if not os.path.exists(fit) and os.path.isabs(fit):
                fit = os.path.join("examples", "netsim", os.path.basename(fit))
            profile = read_json(profile_path(serve), f"{name}'s profile")
            constants, table = load_fit(fit), LinkTable.from_calibrations(validation["link_table"])
        runs[name] = compare_versions(run, profile["variants"], constants, table)
    versions = list(MODELS)
    return {"schema": "netsim-versions/1", "versions": versions,
            "pooled": {m: pooled([by[m]["validation"] for by in runs.values()]) for m in versions}, "runs": runs}


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def format_versions(result: dict) -> str:
    """Per run each version's mean absolute error per figure; pooled per version; the accounting."""
    versions, runs = result["versions"], result["runs"]
    lines = [f"{'run':<20}" + "".join(f"{m.split()[0] + ' ' + f[:4]:>15}" for m in versions for f in FIGURES)]
    for name, by in runs.items():
        lines.append(f"{name:<20}" + "".join(
            f"{by[m]['validation']['by_figure'][f]['mean_abs_rel_error'] * 100:>14.1f}%" for m in versions
            for f in FIGURES))
    for m in versions:
        lines.append(f"{m} pooled: " + "; ".join(
            f"{f} {c['mean_abs_rel_error'] * 100:.1f}% (median {_pct(c['median_rel_error'])}, {c['low']}/"
            f"{c['points']} low)" for f, c in result["pooled"][m].items()))
    lines.append("time accounting, replay / measured over every repeat and rate: busy (inside steps) and span "
                 "(first send to last answer)")
    lines.append(f"  {'run':<20}{'variant':<16}" + "".join(f"{m.split()[0] + ' ' + k:>15}" for m in versions
                                                          for k in ("busy", "span")))
    for name, by in runs.items():
        for v in by[versions[0]]["accounting"]:
            cells = []
            for m in versions:
                a = by[m]["accounting"][v]
                for k in ("busy_s", "span_s"):
                    cells.append(a[k]["replay"] / a[k]["measured"] if a[k]["measured"] else float("nan"))
            lines.append(f"  {name:<20}{v:<16}" + "".join(f"{c:>15.2f}" for c in cells))
    return "\n".join(lines)
