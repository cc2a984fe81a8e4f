"""Early stopping for FCSD (paper §3.1: evaluate a proxy every N steps, patience 20, delta 2%).

Pure logic, no I/O: feed it each evaluation; it says whether the value is a new best (keep that
checkpoint) and whether to stop. Any improvement makes a new best; only an improvement by more
than ``min_delta x |reference|`` (relative) over the last such significant value resets the
patience, so a slow drift of tiny gains does not keep an unstable run alive forever.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

__all__ = ["EarlyStopping"]


@dataclasses.dataclass
class EarlyStopping:
    patience: int = 20
    min_delta: float = 0.02
    mode: str = "min"  # "min" for losses/perplexity/KL, "max" for accuracies
    best: Optional[float] = None
    best_step: Optional[int] = None
    reference: Optional[float] = None  # the last value that reset the patience
    bad_evals: int = 0
    history: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.patience < 1:
            raise ValueError(f"--patience must be >= 1, got {self.patience}")
        if self.min_delta < 0:
            raise ValueError(f"--min-delta must be >= 0, got {self.min_delta}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"early-stopping mode must be min or max, got {self.mode!r}")

    def _better(self, value: float, than: Optional[float], margin: float) -> bool:
        if than is None:
            return True
        return value < than - margin if self.mode == "min" else value > than + margin

    def update(self, step: int, value: float) -> tuple[bool, bool]:
        """Record an evaluation; returns ``(is_new_best, should_stop)``. NaN never improves."""
        self.history.append((step, value))
        if math.isnan(value):
            self.bad_evals += 1
            return False, self.bad_evals >= self.patience
        new_best = self._better(value, self.best, 0.0)
        if new_best:
            self.best, self.best_step = value, step
        margin = 0.0 if self.reference is None else self.min_delta * abs(self.reference)
        if self._better(value, self.reference, margin):
            self.reference, self.bad_evals = value, 0
        else:
            self.bad_evals += 1
        return new_best, self.bad_evals >= self.patience
