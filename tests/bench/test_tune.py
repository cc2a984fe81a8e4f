"""The link-rate search on monotone synthetic functions (no processes, no timing).

Each case states how many probes it may use; the tolerances are the search's own ``tol``.
"""

import math
import random

import pytest

from tools.bench.tune import find_rate


def _model(c):
    """The comm share of a step with fixed compute: f = 1 / (1 + g / c)."""
    return lambda g: 1.0 / (1.0 + g / c)


def test_converges_on_the_model_in_few_probes():
    calls = []

    def measure(g):
        calls.append(g)
        return _model(0.3)(g)

    res = find_rate(measure, 0.6, start=1.0, tol=0.01, max_probes=8)
    assert res.converged
    assert abs(res.fraction - 0.6) <= 0.01
    assert res.gbit == pytest.approx(0.3 * (1 / 0.6 - 1), rel=0.05)  # exact answer: 0.2
    assert len(calls) <= 3  # the model is what the search assumes: start + one step (+ slack)


@pytest.mark.parametrize("target", [0.1, 0.5, 0.9])
def test_converges_on_a_non_logistic_monotone_function(target):
    # Piecewise-linear in g with a kink and a flat-ish tail; decreasing on [0.01, 40].
    def f(g):
        return max(0.02, 0.98 - 0.4 * g) if g < 2 else max(0.02, 0.18 - 0.004 * g)

    res = find_rate(f, target, start=1.0, tol=0.02, max_probes=25)
    assert res.converged, res.message
    assert abs(res.fraction - target) <= 0.02
    assert len(res.probes) <= 25


def test_noisy_measurements_still_land_near_the_target():
    rng = random.Random(0)
    base = _model(2.0)

    def noisy(g):
        return min(max(base(g) + rng.uniform(-0.02, 0.02), 0.0), 1.0)

    res = find_rate(noisy, 0.6, start=1.0, tol=0.03, max_probes=8)
    assert res.converged
    assert abs(base(res.gbit) - 0.6) <= 0.05  # noise +-0.02 plus tolerance 0.03


def test_unreachable_target_reports_the_bound():
    res = find_rate(lambda g: 0.05, 0.6, lo=0.01, hi=40.0, start=1.0, max_probes=10)
    assert not res.converged
    assert "lower rate bound" in res.message
    assert min(p.gbit for p in res.probes) == pytest.approx(0.01)
    res = find_rate(lambda g: 0.95, 0.6, lo=0.01, hi=40.0, start=1.0, max_probes=10)
    assert not res.converged and "upper rate bound" in res.message


def test_probe_budget_is_respected():
    calls = []

    def measure(g):
        calls.append(g)
        # monotone, flat at the root (cubic in log g): no secant step can hit 0.5 exactly
        return min(max(0.5 - 0.05 * math.log(g / 0.37) ** 3, 0.0), 1.0)

    res = find_rate(measure, 0.5, start=10.0, tol=1e-9, max_probes=4)
    assert len(calls) == 4 and len(res.probes) == 4
    assert not res.converged


def test_rejects_bad_targets():
    with pytest.raises(ValueError, match="--target-comm-fraction"):
        find_rate(lambda g: 0.5, 1.2)
