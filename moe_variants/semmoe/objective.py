"""The co-clustering objective that Algorithm 1 approximates and the MILP baseline solves exactly.

Paper §3.3, with token frequencies normalised (``sum_j a_j = 1``) so every term is a fraction:

    J = theta * sum_d |sum_{j: T(j)=d} a_j - 1/D|                       token (attention) balance
      + (1 - theta) * sum_j a_j * (1 - sum_{k: E(k)=T(j)} Cp[j, k])     expected remote activations
      + lam * sum_d max(0, sum_{k: E(k)=d} w_k - (1 + slack)/D),  w = Cp^T a   expert overload

The last term is our addition: the paper's ILP balances only token counts, while Algorithm 1
penalises cluster load (``gamma_e``) and the paper reports expert-device imbalance (max / median
load); putting it in the objective lets the heuristic and the MILP be compared on the same number.
It charges only the load above ``(1 + slack)`` times the mean, so moderate imbalance is free and
affinity decides, while overload beyond the slack is penalised hard (``slack = 0`` gives half the
L1 deviation from the mean).

The solver's default is ``theta = 0``: online, tokens are balanced over devices by the schedulers
(Algorithm 2's rotating mask, Algorithm 3's equal slices), not by the token table, so T should
name each token's best device. With ``theta = 0`` the optimal T for a placement E is exactly
that (each token's argmax device), which makes the MILP optimum over (T, E) directly comparable
with the heuristic's E and its derived T.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

__all__ = ["ObjectiveTerms", "coclustering_objective"]


@dataclass(frozen=True)
class ObjectiveTerms:
    token_balance: float  # sum_d |token share of d - 1/D|
    remote: float  # expected share of activations computed off the token's device
    expert_balance: float  # sum_d of expert load share above (1 + slack) / D
    total: float


def coclustering_objective(
    cp: sp.csr_matrix,
    a: np.ndarray,
    token2device: np.ndarray,
    expert2device: np.ndarray,
    num_devices: int,
    theta: float,
    lam: float,
    slack: float = 0.0,
) -> ObjectiveTerms:
    """Evaluate J for one layer.

    cp: [V, N] row-normalised activation counts; a: [V] token weights summing to 1;
    token2device: [V] device per token (only tokens with ``a > 0`` matter; they must be >= 0);
    expert2device: [N] device per expert.
    """
    seen = a > 0
    if np.any(token2device[seen] < 0):
        raise ValueError("every token with nonzero frequency needs a device")
    rows = np.repeat(np.arange(cp.shape[0]), np.diff(cp.indptr))
    local_mask = expert2device[cp.indices] == token2device[rows]
    local = float(np.sum(a[rows] * cp.data * local_mask))
    target = 1.0 / num_devices
    tok_load = np.bincount(token2device[seen], weights=a[seen], minlength=num_devices)
    w = cp.T @ a
    exp_load = np.bincount(expert2device, weights=w, minlength=num_devices)
    token_balance = float(np.abs(tok_load - target).sum())
    expert_balance = float(np.maximum(exp_load - (1.0 + slack) * target, 0.0).sum())
    remote = float(a[seen].sum()) - local
    total = theta * token_balance + (1 - theta) * remote + lam * expert_balance
    return ObjectiveTerms(token_balance, remote, expert_balance, total)
