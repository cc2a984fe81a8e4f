"""The co-clustering objective that Algorithm 1 approximates and the MILP baseline solves exactly.

Paper §3.3, with token frequencies normalised (``sum_j a_j = 1``) so every term is a fraction:

    J = theta * sum_d |sum_{j: T(j)=d} a_j - 1/D|                       token (attention) balance
      + (1 - theta) * sum_j a_j * (1 - sum_{k: E(k)=T(j)} Cp[j, k])     expected remote activations
      + lam * sum_d |sum_{k: E(k)=d} w_k - 1/D|,  w = Cp^T a              expert (MoE) load balance

The last term is our addition: the paper's ILP balances only token counts, while Algorithm 1
penalises cluster load (``gamma_e``) and the paper reports expert-device imbalance; putting it in
the objective lets the heuristic and the MILP be compared on the same number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

__all__ = ["ObjectiveTerms", "coclustering_objective"]


@dataclass(frozen=True)
class ObjectiveTerms:
    token_balance: float
    remote: float
    expert_balance: float
    total: float


def coclustering_objective(
    cp: sp.csr_matrix,
    a: np.ndarray,
    token2device: np.ndarray,
    expert2device: np.ndarray,
    num_devices: int,
    theta: float,
    lam: float,
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
    expert_balance = float(np.abs(exp_load - target).sum())
    remote = float(a[seen].sum()) - local
    total = theta * token_balance + (1 - theta) * remote + lam * expert_balance
    return ObjectiveTerms(token_balance, remote, expert_balance, total)
