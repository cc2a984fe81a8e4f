"""``tools.profile.serving_fit``: the step-cost fit recovers known costs, the bootstrap's intervals
cover them and narrow with less noise, rounds the machine disturbed are dropped, and the precision
check names the costs it refuses."""

import numpy as np
import pytest

from netsim.replay import Engine
from tools.profile.serving_fit import costs, fit, fitted, imprecise, precision, undisturbed

ENGINE = Engine(ranks=2, max_batch_tokens=512, max_requests=16)
FIXED, PER_TOKEN, PER_REQUEST, DUMMY = 0.020, 80e-6, 0.5e-3, 0.017
SHAPES = [("decode", 16, q) for q in (1, 2, 4, 8, 16)] + [("prefill", n, n // 64) for n in (64, 128, 256, 512)]


def _rows(rounds: int, noise: float, seed: int = 0) -> list:
    """Profile rows of known costs, each step's time times a log-normal factor of sigma ``noise``."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(1, rounds + 1):
        for kind, tokens, requests in SHAPES:
            true = FIXED + PER_TOKEN * ENGINE.padded(tokens, kind == "decode") + PER_REQUEST * requests
            rows.append({"kind": kind, "tokens": tokens, "requests": requests, "round": r,
                         "compute_s": true * float(np.exp(rng.normal(0, noise)))})
        rows += [{"kind": "dummy", "tokens": 0, "requests": 0, "round": r,
                  "compute_s": DUMMY * float(np.exp(rng.normal(0, noise)))} for _ in range(3)]
    return rows


def test_fit_recovers_noise_free_costs():
    got = fit(_rows(3, 0.0), ENGINE)
    assert got["fixed_s"] == pytest.approx(FIXED, rel=1e-9)
    assert got["per_token_s"] == pytest.approx(PER_TOKEN, rel=1e-9)
    assert got["per_request_s"] == pytest.approx(PER_REQUEST, rel=1e-9)
    assert got["fit_max_abs_rel_error"] < 1e-9
    assert costs(_rows(3, 0.0), ENGINE)["dummy_s"] == pytest.approx(DUMMY)


def test_bootstrap_intervals_cover_the_truth_and_narrow_with_less_noise():
    noisy = precision(_rows(15, 0.08), ENGINE, draws=200)
    quiet = precision(_rows(15, 0.02), ENGINE, draws=200)
    assert noisy["rounds"] == 15
    for key, true in (("fixed_s", FIXED), ("per_token_s", PER_TOKEN), ("dummy_s", DUMMY)):
        c = noisy["costs"][key]
        assert c["low"] <= true <= c["high"], (key, c)
        assert quiet["costs"][key]["half_width"] < c["half_width"] / 2, key


def test_the_check_names_what_is_too_wide():
    prec = precision(_rows(15, 0.08), ENGINE, draws=200)
    wide = dict(imprecise(prec, 0.001))
    assert {"fixed_s", "per_token_s", "dummy_s", "step_smallest_s", "step_largest_s"} <= set(wide)
    assert "per_request_s" not in wide  # judged through the fitted steps, not on its own
    assert imprecise(prec, 1.0) == []


def test_one_round_has_no_precision():
    with pytest.raises(ValueError, match="at least 2 rounds"):
        precision(_rows(1, 0.05), ENGINE)


def test_a_launch_effect_widens_the_interval():
    """Four launches, each 10% faster or slower as a whole: the interval over launches and rounds
    is wider than one over the same rows taken as rounds of one launch."""
    rng = np.random.default_rng(3)
    rows = []
    for launch in range(4):
        factor = float(np.exp(rng.normal(0, 0.1)))
        for row in _rows(5, 0.02, seed=launch):
            rows.append({**row, "launch": launch, "compute_s": row["compute_s"] * factor})
    pooled = [{**row, "launch": 0, "round": (row["launch"], row["round"])} for row in rows]
    by_launch = precision(rows, ENGINE, draws=200)["costs"]["fixed_s"]["half_width"]
    as_rounds = precision(pooled, ENGINE, draws=200)["costs"]["fixed_s"]["half_width"]
    assert by_launch > 1.5 * as_rounds


def _disturbed(rounds: int, slow: set, factor: float = 2.0) -> list:
    """Rows whose rounds in ``slow`` ran ``factor`` times slower, steps and reference workload alike."""
    rows = []
    for row in _rows(rounds, 0.01):
        f = factor if row["round"] in slow else 1.0
        rows.append({**row, "compute_s": row["compute_s"] * f, "ref_python_s": 1.5e-3 * f, "ref_gemm_s": 1e-3,
                     "ref_python_end_s": 1.5e-3 * (f if row["round"] != 2 else 1.0)})
    return rows


def test_rounds_the_machine_disturbed_are_dropped():
    rows = _disturbed(12, {2, 5, 9})
    kept, dropped = undisturbed(rows)
    assert dropped == 3 and {r["round"] for r in kept} == set(range(1, 13)) - {2, 5, 9}
    clean = fitted(rows, ENGINE)
    assert (clean["rounds"], clean["disturbed_rounds"]) == (12, 3)
    assert clean["fixed_s"] == pytest.approx(FIXED, rel=0.03) and clean["dummy_s"] == pytest.approx(DUMMY, rel=0.03)
    assert fit(rows, ENGINE)["fixed_s"] > clean["fixed_s"]  # the slow rounds pull a plain fit up
    # a round slow only at its end counts too; a machine disturbed most of the time is refused
    late = [{**r, "ref_python_end_s": 3e-3} if r["round"] == 7 else r for r in _disturbed(12, set())]
    assert undisturbed(late)[1] == 1
    busy = [{**r, "ref_python_s": 3e-3} if r["round"] <= 7 else r for r in _disturbed(12, set())]
    with pytest.raises(ValueError, match="7 of 12 rounds"):
        fitted(busy, ENGINE)


def test_refit_fits_a_profile_again_from_its_samples(tmp_path):
    """``--refit``: the costs come from the samples alone (disturbed rounds dropped); a profile
    without samples, or a precision its samples cannot meet, is refused in one line."""
    import json
    import subprocess
    import sys

    from tests.serving.conftest import REPO

    entry = {"samples": _disturbed(12, {4}), "a2a_bytes_per_token": 1.0, "a2a_calls": 6, "wall_s": 1.0}
    prof = {"schema": "serving-compute-profile/1", "ranks": 2, "launches": 1, "repeats": 12,
            "engine": {"max_batch_tokens": 512, "max_requests": 16}, "variants": {"standard": entry}}
    src = tmp_path / "p.json"
    src.write_text(json.dumps(prof))

    def refit(*flags, path=src):
        return subprocess.run([sys.executable, "-m", "tools.profile.serving_compute", "--refit", str(path),
                               "--out", str(tmp_path / "q.json"), *flags], cwd=REPO, capture_output=True,
                              text=True, timeout=120)

    proc = refit("--precision", "0.5")
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "q.json").read_text())["variants"]["standard"]
    assert got["fixed_s"] == pytest.approx(FIXED, rel=0.03) and got["disturbed_rounds"] == 1
    proc = refit("--precision", "1e-9")
    assert proc.returncode == 2 and "wider than --precision" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert (tmp_path / "q.rejected.json").exists()
    proc = refit("--disturbed", "0.5")
    assert proc.returncode == 2 and "--disturbed 0.5" in proc.stderr and len(proc.stderr.splitlines()) == 1
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({**prof, "variants": {"standard": {"fixed_s": 0.02}}}))
    proc = refit(path=bare)
    assert proc.returncode == 2 and "cannot be fitted again" in proc.stderr and len(proc.stderr.splitlines()) == 1
