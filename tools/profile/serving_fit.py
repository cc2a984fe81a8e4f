"""The serving compute profile's statistics: the step-cost fit, its precision, and the check that
refuses an imprecise profile (``tools.profile.serving_compute``).

A profile times every shape once per round, in a shuffled order, over several rounds per launch,
and drops the rounds the machine disturbed (``undisturbed``). The fit takes each shape's median over
the rounds (a few slow steps, from the machine or the collector, do not move it) and fits
``fixed + per_token x tokens + per_request x requests`` by least squares on relative residuals. The
ranks are launched several times (the machine's speed during a launch moves every step of it
alike), so the precision comes from launches and rounds: the fit is redone on launches drawn with
replacement and, in each, rounds drawn with replacement (a two-stage bootstrap), and each cost's 95%
percentile interval is reported as a half-width relative to the cost.
"""

from __future__ import annotations

import statistics

CHECKED = ("fixed_s", "per_token_s", "dummy_s")  # the costs a profile must pin down to be used
# ``per_request_s`` is a small correction (often fitted as 0); its interval is reported, and what it
# contributes is judged through the fitted smallest and largest steps (``step_*_s``).


def fit(rows: list, engine) -> dict:
    """Least-squares ``fixed + per_token x tokens + per_request x requests`` over the per-shape
    medians, tokens as the engine pads them (``netsim.replay.Engine.padded``); relative errors."""
    import numpy as np

    shapes: dict = {}
    for r in rows:
        if r["kind"] != "dummy":
            padded = engine.padded(r["tokens"], decode_only=r["kind"] == "decode")
            shapes.setdefault((r["kind"], padded, r["requests"]), []).append(r["compute_s"])
    keys = sorted(shapes)
    X = np.array([[1.0, t, q] for _, t, q in keys])
    y = np.array([statistics.median(shapes[k]) for k in keys])
    theta = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)[0]  # relative residuals
    theta = np.maximum(theta, 0.0)
    pred = X @ theta
    rel = (pred - y) / y
    return {"fixed_s": float(theta[0]), "per_token_s": float(theta[1]), "per_request_s": float(theta[2]),
            "points": [{"kind": k, "tokens": t, "requests": q, "compute_s": float(v), "fit_s": float(p)}
                       for (k, t, q), v, p in zip(keys, y, pred)],
            "fit_mean_abs_rel_error": float(np.mean(np.abs(rel))), "fit_max_abs_rel_error": float(np.max(np.abs(rel)))}


def undisturbed(rows: list, limit: float = 1.25) -> tuple:
    """The rows of the rounds the machine ran at its usual speed, and the number of rounds dropped.

    A round's speed is the slower of its reference workloads (``ref_python_s`` at its start,
    ``ref_python_end_s`` at its end where recorded); the usual speed is the 25th percentile over the
    rounds; a round more than ``limit`` times slower than that shared the machine with something
    else (a virtual machine's host takes its CPUs for seconds at a time, doubling every step), and
    its steps say nothing about the checkpoint."""
    import numpy as np

    speed: dict = {}
    for r in rows:
        key = (r.get("launch", 0), r["round"])
        speed[key] = max(speed.get(key, 0.0), r["ref_python_s"], r.get("ref_python_end_s") or 0.0)
    usual = float(np.percentile(list(speed.values()), 25))
    kept = [r for r in rows if speed[(r.get("launch", 0), r["round"])] <= limit * usual]
    return kept, sum(1 for v in speed.values() if v > limit * usual)


def costs(rows: list, engine) -> dict:
    """The fitted costs of ``rows``, the dummy step's median and the fitted smallest and largest steps."""
    fitted = fit(rows, engine)
    dummy = [r["compute_s"] for r in rows if r["kind"] == "dummy"]
    points = fitted["points"]
    small, large = min(points, key=lambda p: p["tokens"]), max(points, key=lambda p: p["tokens"])
    return {**{k: fitted[k] for k in ("fixed_s", "per_token_s", "per_request_s")},
            "dummy_s": statistics.median(dummy) if dummy else None,
            "step_smallest_s": small["fit_s"], "step_largest_s": large["fit_s"]}


def precision(rows: list, engine, draws: int = 400, seed: int = 0) -> dict:
    """Per cost of ``costs``: the fit on all rows, and the 95% percentile interval of the fit redone
    on ``draws`` resamples, as a half-width relative to the fit (``None`` for a cost fitted as 0).
    The resample is two-stage, as the measurement: launches drawn with replacement, then each drawn
    launch's rounds with replacement (rows carry their ``round`` and ``launch``, default 0), so that
    what one launch or one round shares counts in the interval. Fewer than 2 rounds is an error."""
    import numpy as np

    launches: dict = {}
    for r in rows:
        launches.setdefault(r.get("launch", 0), {}).setdefault(r["round"], []).append(r)
    groups = [list(by_round.values()) for _, by_round in sorted(launches.items())]
    rounds = sum(len(g) for g in groups)
    if rounds < 2:
        raise ValueError(f"a precision needs at least 2 rounds, got {rounds}")
    point = costs(rows, engine)
    rng = np.random.default_rng(seed)
    samples: dict = {k: [] for k in point}
    for _ in range(draws):
        drawn = []
        for li in rng.integers(0, len(groups), len(groups)):
            group = groups[li]
            drawn += [row for ri in rng.integers(0, len(group), len(group)) for row in group[ri]]
        for k, v in costs(drawn, engine).items():
            samples[k].append(v)
    out = {}
    for k, v in point.items():
        if v is None:
            continue
        lo, hi = (float(x) for x in np.percentile(samples[k], [2.5, 97.5]))
        out[k] = {"value": v, "low": lo, "high": hi, "half_width": (hi - lo) / 2 / v if v > 0 else None}
    return {"launches": len(groups), "rounds": rounds, "draws": draws,
            "interval": "95% percentile, bootstrap over launches and their rounds", "costs": out}


def fitted(rows: list, engine, disturbed: float = 1.25) -> dict:
    """A variant's profile entry from its samples: the rounds the machine did not disturb
    (``undisturbed``), their fit, the idle step's median, the precision, the machine's usual
    reference speed, and how many rounds were dropped of how many."""
    kept, dropped = undisturbed(rows, disturbed)
    rounds = len({(r.get("launch", 0), r["round"]) for r in rows})
    if rounds - dropped < max(2, rounds / 2):
        raise ValueError(f"{dropped} of {rounds} rounds ran over {disturbed}x the machine's usual speed")
    entry = fit(kept, engine)
    entry.update(dummy_s=statistics.median(r["compute_s"] for r in kept if r["kind"] == "dummy"),
                 precision=precision(kept, engine),
                 reference_python_s=statistics.median(r["ref_python_s"] for r in kept),
                 reference_gemm_s=statistics.median(r["ref_gemm_s"] for r in kept),
                 rounds=rounds, disturbed_rounds=dropped)
    return entry


def imprecise(prec: dict, limit: float) -> list:
    """The checked costs (``CHECKED``, and the fitted steps) whose relative half-width exceeds ``limit``,
    as ``(cost, half_width)``."""
    keys = (*CHECKED, "step_smallest_s", "step_largest_s")
    return [(k, c["half_width"]) for k, c in prec["costs"].items()
            if k in keys and c["half_width"] is not None and c["half_width"] > limit]
