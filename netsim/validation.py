"""A measured serving run against the replay: ``python -m netsim predict`` / ``validate``.

``predict_run`` replays every variant and request rate of a ``bench_serve.py --mode serve`` run
(``netsim.replay.simulate``) from its workload alone (send times, prompt and output lengths, the
link rate, the engine sizes, each variant's measured LAR); ``validate_run`` sets the predicted
TTFT, TPOT and throughput beside what the run measured. ``code_version`` names the git commit of
the replay's code, which ``validate`` prints and records with ``MODEL_VERSION``.
"""

from __future__ import annotations

import math
import os
import subprocess
from typing import Sequence

import numpy as np

from megatron.common.cli import UserError, user_input

from .collectives import AlphaBeta
from .link_table import LinkTable
from .replay import MODEL_VERSION, Engine, Link, Request, StepProfile, model, simulate

__all__ = ["FIGURES", "OFFERED_LOAD_FRACTION", "phase_figures", "read_json", "profile_path", "load_fit",
           "replay_setup", "predict_run", "validate_run", "read_validations", "offered_load_bound", "code_version"]

FIGURES = ("ttft_p50_s", "tpot_p50_s", "output_tokens_per_s")

# A rate whose measured request rate is at least this fraction of the offered rate is bound by
# the offered load (the server keeps up): its throughput says nothing about the model.
OFFERED_LOAD_FRACTION = 0.8

# The replay's code: ``code_version`` says whether these differ from the commit it names.
MODEL_FILES = ("link_table.py", "replay.py", "validation.py")


def phase_figures(ttft: Sequence[float], e2e: Sequence[float], output_tokens: Sequence[int],
                  arrivals: Sequence[float]) -> dict:
    """TTFT and TPOT medians and output tokens/s of one phase (the benchmark's definitions:
    throughput over the phase's start, time 0, to the last completion)."""
    tpot = [(e - f) / (n - 1) for f, e, n in zip(ttft, e2e, output_tokens) if n > 1]
    end = max(a + e for a, e in zip(arrivals, e2e))
    start = 0.0
    return {
        "ttft_p50_s": float(np.median(ttft)),
        "tpot_p50_s": float(np.median(tpot)) if tpot else None,
        "output_tokens_per_s": float(sum(output_tokens) / (end - start)) if end > start else None,
    }


def read_json(path: str, flag: str):
    """A JSON file, gzipped where its name ends in ``.gz`` (docs/figures keeps the runs it replays
    so); a one-line error naming ``flag`` when it cannot be read."""
    import gzip
    import json

    try:
        with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
            return json.load(f)
    except (OSError, EOFError, ValueError) as err:
        raise ValueError(f"{flag} {path}: {getattr(err, 'strerror', None) or err}") from None


def profile_path(run_path: str) -> str:
    """Where ``profile_serving_compute.py``'s output for a run lies by default: ``<run>.profile.json``
    beside ``<run>.json`` or ``<run>.json.gz``."""
    return run_path.removesuffix(".gz").removesuffix(".json") + ".profile.json"


def load_fit(path) -> AlphaBeta:
    """Constants of a ``python -m netsim fit`` JSON (the replay takes the loop's latency from them)."""
    import json

    try:
        with open(path) as f:
            d = json.load(f)
        return AlphaBeta.from_dict(d["constants"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--fit {path}: not a readable netsim fit JSON ({err})") from None


def run_requests(run: dict, variant: str, phase: str) -> list:
    """The requests of one measured phase as the replay's input (actual send times, prompt and
    output lengths): what the client did, not what the server answered. A run of several
    (``bench_serve/2``: one request list per run) replays its first run."""
    requests = run["requests"][variant][phase]
    if run.get("schema") == "bench_serve/2":
        requests = requests[0]
    return [Request(float(r["sent"]), int(r["prompt_tokens"]), max(1, int(r["output_tokens"])), r.get("dp_rank"))
            for r in requests if r["ok"]]


def recorded_assignment(run: dict, variant: str) -> bool:
    """Whether every request of the variant's rate phases records the engine that served it."""
    for phase in rate_phases(run, variant):
        reqs = run["requests"][variant][phase]
        for r in (reqs[0] if run.get("schema") == "bench_serve/2" else reqs):
            if r["ok"] and r.get("dp_rank") is None:
                return False
    return True


def rate_phases(run: dict, variant: str) -> list:
    return [p for p in run["requests"][variant] if p.startswith("rate-")]


def replay_setup(run: dict, profiles: dict, constants: AlphaBeta, table: LinkTable) -> tuple:
    """``(engine, link, {variant: StepProfile})`` a bench_serve run (``--mode serve``, shaped link) is
    replayed with, on the link ``table`` calibrated at its rate; one-line ``UserError``s for what the
    replay cannot model. ``profiles``: variant -> profile dict (``scripts/profile_serving_compute.py``).
    Off-rank bytes follow the LAR the run measured: ``bytes x (1 - lar_run) / (1 - lar_profile)``."""
    if run.get("mode") != "serve":
        raise UserError("only --mode serve runs can be predicted (TTFT, TPOT, throughput under load)")
    net = run["network"]
    if not net.get("shaped"):
        raise UserError("the run is on unshaped loopback: there is no link to model")
    ranks = int(run["config"]["ranks"])
    tp = int(run["config"].get("tensor_model_parallel_size") or 1)
    ep = int(run["config"].get("expert_model_parallel_size") or ranks)
    if tp > 1 and not tp == ep == ranks:
        raise UserError(f"the run serves TP {tp} x EP {ep} on {ranks} ranks: the replay models tensor parallelism "
                        "only where TP = EP = the ranks (one engine)")
    if run["config"].get("expert_comm", "alltoall") != "alltoall" or (run["config"].get("semmoe_tables") and tp > 1):
        raise UserError("the replay models all-to-all experts with every TP rank dispatching its copy; not "
                        "--expert-comm allreduce or Sem-MoE's Algorithm 3")
    server = run["config"]["server"]
    engine = Engine(ranks // tp, int(server["max_batch_tokens"]), int(server["max_requests"]) // 4 * 4)
    link, gbit = Link(ranks, constants), float(net["link"]["gbit"])
    if table.ranks != ranks or not math.isclose(table.gbit, gbit, rel_tol=1e-3):
        raise UserError(f"the link table was measured with {table.ranks} ranks at {table.gbit:g} Gbit/s; the run "
                        f"served {ranks} ranks at {gbit:g} Gbit/s")
    steps = {}
    for v in run["config"]["variants"]:
        if v not in profiles:
            raise UserError(f"the profile has no variant {v!r} (it has {', '.join(profiles)})")
        prof = dict(profiles[v])
        lar_run, lar_prof = run["variants"][v].get("lar"), prof.get("lar")
        if lar_run is not None and lar_prof is not None and lar_prof < 1:
            prof["a2a_bytes_per_token"] *= (1 - lar_run) / (1 - lar_prof)
        try:
            steps[v] = StepProfile.from_dict(prof)
        except ValueError as err:
            raise UserError(f"the profile of {v!r}: {err}") from None
        if steps[v].tp != tp:
            raise UserError(f"the profile of {v!r} was taken at TP {steps[v].tp}; the run served TP {tp}")
    return engine, link, steps


def predict_run(run: dict, profiles: dict, constants: AlphaBeta, table: LinkTable,
                model_version: str = MODEL_VERSION) -> dict:
    """Predicted ``FIGURES`` per variant and request rate of a bench_serve run, replayed
    (``replay_setup``) by the replay model of ``model_version`` (``netsim.replay.MODELS``)."""
    try:
        replay_model = model(model_version)
    except ValueError as err:
        raise UserError(str(err)) from None
    engine, link, steps = replay_setup(run, profiles, constants, table)
    out = {}
    for v, step in steps.items():
        out[v] = {}
        for phase in rate_phases(run, v):
            reqs = run_requests(run, v, phase)
            got = simulate(reqs, engine, step, link, table, replay_model)
            out[v][phase.split("-", 1)[1]] = phase_figures([g[0] for g in got], [g[1] for g in got],
                                                           [g[2] for g in got], [r.arrival_s for r in reqs])
    return out


@user_input()
def read_validations(items: list, with_path: bool = False) -> list:
    """``(name, validation, run)`` of each ``NAME=VALIDATE_JSON`` (and the run's path, ``with_path``):
    the run is the ``serve.json.gz`` beside the validation where there is one (the committed layout),
    else the one it names; bad files are one-line errors."""
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
        run = read_json(serve, f"{name}'s bench_serve")
        out.append((name, validation, run, serve) if with_path else (name, validation, run))
    return out


def code_version() -> str:
    """The git commit the replay's code is at, ``-dirty`` added when one of its files
    (``MODEL_FILES``) differs from that commit; ``unknown`` outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args) -> str:
        return subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--", *MODEL_FILES)
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return sha + ("-dirty" if dirty else "")


def offered_load_bound(stats: dict) -> bool:
    """Whether a measured rate kept up with its offered load (``requests_per_s`` at least
    ``OFFERED_LOAD_FRACTION`` of ``offered_rate``; an unbounded rate never is): below saturation
    throughput equals the offered load whatever the model predicts."""
    offered, achieved = stats.get("offered_rate"), stats.get("requests_per_s")
    if offered is None or achieved is None or not math.isfinite(float(offered)):
        return False
    return float(achieved) >= OFFERED_LOAD_FRACTION * float(offered)


def measured_figures(stats: dict) -> dict:
    """``FIGURES`` of one measured rate (``variants.<v>.rates.<rate>`` of the run's JSON)."""
    return {"ttft_p50_s": stats["ttft_s"]["p50"], "tpot_p50_s": stats["tpot_s"]["p50"],
            "output_tokens_per_s": stats["output_tokens_per_s"]}


def validate_run(run: dict, predicted: dict, model_version: str = MODEL_VERSION) -> dict:
    """Relative error ``(predicted - measured) / measured`` of every figure, and their mean absolute
    per figure. Throughput counts only at rates above saturation (``offered_load_bound`` false):
    below it both sides equal the offered load and would dilute the mean. ``mean_abs_rel_error``
    is over the counted points; ``mean_abs_rel_error_all_points`` counts every point. The result
    names ``model_version``, the model that made ``predicted``."""
    rows, unmodelled = [], {}
    for v, rates in predicted.items():
        scheduler = run["variants"][v].get("request_scheduler")
        if scheduler not in (None, "round-robin") and not recorded_assignment(run, v):
            unmodelled[v] = f"{scheduler} request scheduling (the replay assigns requests round-robin)"
        for rate, pred in rates.items():
            stats = run["variants"][v]["rates"][rate]
            meas = measured_figures(stats)
            bound = offered_load_bound(stats)
            for fig in FIGURES:
                p, m = pred[fig], meas[fig]
                rel = (p - m) / m if p is not None and m else None
                counted = rel is not None and not (fig == "output_tokens_per_s" and bound)
                rows.append({"variant": v, "rate": rate, "figure": fig, "measured": m, "predicted": p,
                             "relative_error": rel, "offered_load_bound": bound, "counted": counted})

    def summary(selected):
        errs = [abs(r["relative_error"]) for r in selected]
        return {"mean_abs_rel_error": float(np.mean(errs)) if errs else None,
                "max_abs_rel_error": float(np.max(errs)) if errs else None, "points": len(errs)}

    counted = [r for r in rows if r["counted"]]
    everything = summary([r for r in rows if r["relative_error"] is not None])
    return {"rows": rows, **summary(counted),
            "by_figure": {fig: summary([r for r in counted if r["figure"] == fig]) for fig in FIGURES},
            "mean_abs_rel_error_all_points": everything["mean_abs_rel_error"], "all_points": everything["points"],
            "unmodelled": unmodelled, "model_version": model(model_version).version}
