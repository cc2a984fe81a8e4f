"""Pick the link rate at which a workload spends a target fraction of its step in all-to-all.

The fraction ``f(g)`` falls as the rate ``g`` rises. For a step of fixed compute ``C`` and
all-to-all volume ``B``, ``f = (B/g) / (B/g + C)``, so ``logit(f) = log(B/C) - log(g)``: linear in
``log g`` with slope -1. The search therefore works in ``(x, y) = (log g, logit f - logit F)``:

1. probe the start rate; step to the rate this model predicts (slope -1), and keep stepping
   (at most x30 per probe) until the target is bracketed or a bound of ``[lo, hi]`` is reached;
2. shrink the bracket with regula falsi in ``(x, y)`` (Illinois variant, so a bad side cannot
   stall it), each step kept 10% inside the bracket, i.e. a safeguarded bisection.

It stops when a probe lands within ``tol`` of ``F`` or after ``max_probes`` probes and returns the
closest probe. Measured fractions are noisy; a probe is only as good as its few steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

from megatron.common.cli import UserError

__all__ = ["Probe", "TuneResult", "find_rate"]

_EPS = 1e-4
_MAX_STEP = math.log(30.0)


@dataclasses.dataclass
class Probe:
    gbit: float
    fraction: float


@dataclasses.dataclass
class TuneResult:
    gbit: float
    fraction: float
    target: float
    converged: bool
    probes: list
    message: str = ""

    def as_dict(self) -> dict:
        return {
            "target": self.target,
            "gbit": self.gbit,
            "fraction": self.fraction,
            "converged": self.converged,
            "probes": [dataclasses.asdict(p) for p in self.probes],
            "message": self.message,
        }


def _logit(f: float) -> float:
    f = min(max(f, _EPS), 1 - _EPS)
    return math.log(f / (1 - f))


def find_rate(
    measure: Callable[[float], float],
    target: float,
    lo: float = 0.01,
    hi: float = 40.0,
    start: float = 1.0,
    tol: float = 0.03,
    max_probes: int = 8,
    log: Optional[Callable[[str], None]] = None,
) -> TuneResult:
    """Find ``g`` in ``[lo, hi]`` Gbit/s with ``measure(g)`` within ``tol`` of ``target``.

    ``measure`` returns the measured fraction (0..1) at rate ``g`` and must be (noisily)
    non-increasing in ``g``. Raises ``ValueError`` for a target outside (0, 1).
    """
    if not 0 < target < 1:
        raise UserError(f"--target-comm-fraction must be in (0, 1), got {target}")
    if not 0 < lo < hi:
        raise ValueError(f"rate bounds must satisfy 0 < lo < hi, got {lo}, {hi}")
    if max_probes < 1:
        raise ValueError("max_probes must be >= 1")
    t = _logit(target)
    probes: list[Probe] = []

    def probe(x: float) -> float:
        g = math.exp(x)
        f = float(measure(g))
        probes.append(Probe(g, f))
        if log:
            log(f"probe {len(probes)}: {g:.4g} Gbit/s -> comm fraction {f:.3f} (target {target})")
        return _logit(f) - t

    def done(converged: bool, message: str = "") -> TuneResult:
        best = min(probes, key=lambda p: abs(p.fraction - target))
        return TuneResult(best.gbit, best.fraction, target, converged, probes, message)

    x_lo, x_hi = math.log(lo), math.log(hi)
    x = min(max(math.log(start), x_lo), x_hi)
    y = probe(x)
    if abs(probes[-1].fraction - target) <= tol:
        return done(True)
    # Phase 1: bracket. y > 0 means too much communication: go faster (x up).
    pos: Optional[tuple[float, float]] = None  # (x, y) with y > 0
    neg: Optional[tuple[float, float]] = None  # (x, y) with y < 0
    if y > 0:
        pos = (x, y)
    else:
        neg = (x, y)
    while pos is None or neg is None:
        if len(probes) >= max_probes:
            return done(False, "probe budget spent before the target was bracketed")
        step = min(max(abs(y), math.log(1.5)), _MAX_STEP)  # model: slope -1 in (log g, logit f)
        x_new = min(x + step, x_hi) if y > 0 else max(x - step, x_lo)
        if x_new == x:
            bound = "upper" if y > 0 else "lower"
            return done(False, f"comm fraction {probes[-1].fraction:.3f} at the {bound} rate bound "
                               f"{math.exp(x):.4g} Gbit/s cannot reach {target}")  # fmt: skip
        x = x_new
        y = probe(x)
        if abs(probes[-1].fraction - target) <= tol:
            return done(True)
        if y > 0:
            pos = (x, y)
        else:
            neg = (x, y)
    # Phase 2: safeguarded regula falsi (Illinois) inside the bracket.
    last_side = None
    (xp, yp), (xn, yn) = pos, neg
    while len(probes) < max_probes:
        x_new = xp - yp * (xn - xp) / (yn - yp)
        margin = 0.1 * abs(xn - xp)
        x_new = min(max(x_new, min(xp, xn) + margin), max(xp, xn) - margin)
        y = probe(x_new)
        if abs(probes[-1].fraction - target) <= tol:
            return done(True)
        if y > 0:
            xp, yp = x_new, y
            if last_side == "pos":
                yn /= 2
            last_side = "pos"
        else:
            xn, yn = x_new, y
            if last_side == "neg":
                yp /= 2
            last_side = "neg"
    return done(False, f"no probe within {tol} of the target after {max_probes} probes")
