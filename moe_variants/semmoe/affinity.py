"""Affinity-aware EPLB: EPLB's load balancing with co-activated experts grouped on one device.

The serving stacks' take on expert affinity (an SGLang fork's expert-affinity-aware EPLB, which
builds an expert co-activation matrix from the router's top-k and keeps co-activated experts
together after EPLB's balancing), written here from that description over numpy as a baseline
for Sem-MoE. It places experts only: tokens are not scheduled, so what co-location buys is fewer
distinct devices per token (a dispatcher that sends a token once per destination device, such as
DeepEP's, sends less), not a higher local activation rate.

Per layer:

1. **Replicas** as EPLB's ``replicate_experts``: each extra physical slot goes to the expert with
   the highest load per replica (the heaviest first); the replica budget is ``P - N`` slots.
2. **Cap**: every device may carry at most ``cap = max((1 + slack) * total / D, m)`` load, ``m``
   the heaviest device of EPLB's own packing of the same replicas (``balanced_packing``), so that
   a placement within the cap always exists.
3. **Greedy grouping**: replicas by descending load (ties in a seeded order) go to the device with
   a free slot, room under the cap and no copy of the same expert, whose replicas co-activate most
   with it (ties: the lightest device, then the lowest index). If a replica fits nowhere, the
   layer starts from EPLB's packing instead.
4. **Swap refinement**: the best swap of two replicas on different devices that raises the
   co-activation kept within devices, keeps both devices under the cap and puts no expert twice on
   a device, until none improves (at most ``max_swaps``).

Replica affinity: ``C[e, f] / (cnt[e] * cnt[f])`` for replicas of experts e != f (a token's
activation of a replicated expert is split evenly over its replicas), 0 between replicas of one
expert. The objective maximised is the co-activation mass kept on one device,
``sum over devices of sum over replica pairs on it``.

Shape legend: ``X`` layers, ``N`` logical experts, ``P`` physical slots (replicas included),
``D`` devices, ``S`` token occurrences, ``K`` top-k.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from .baselines import balanced_packing, replicate_experts

__all__ = ["coactivation_counts", "coactivation_kept", "affinity_placement"]

_REL_TOL = 1e-12


def coactivation_counts(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, N] int64: ``C[i, j]`` = occurrences whose top-k holds both experts i and j (i != j); the
    diagonal is each expert's load (occurrences that selected it). routes: [S, K] expert ids."""
    routes = np.asarray(routes, dtype=np.int64)
    s, k = routes.shape
    onehot = sp.csr_matrix((np.ones(s * k, dtype=np.int64), routes.ravel(), np.arange(0, s * k + 1, k)),
                           shape=(s, num_experts))  # fmt: skip
    return np.asarray((onehot.T @ onehot).todense(), dtype=np.int64)


def coactivation_kept(coactivation: np.ndarray, expert2device: np.ndarray) -> float:
    """Share of the off-diagonal co-activation mass whose two experts share a device.
    coactivation: [N, N]; expert2device: [N]."""
    c = np.asarray(coactivation, dtype=np.float64).copy()
    np.fill_diagonal(c, 0.0)
    total = c.sum()
    same = expert2device[:, None] == expert2device[None, :]
    return float(c[same].sum() / total) if total > 0 else 0.0


def _pick(score: np.ndarray, load: np.ndarray, ok: np.ndarray) -> int:
    """Admissible device with the highest score, then the lowest load, then the lowest index."""
    best = score[ok].max()
    cand = ok & (score >= best - _REL_TOL * max(abs(best), 1.0))
    light = load[cand].min()
    return int(np.flatnonzero(cand & (load <= light))[0])


def _greedy(wl, expert, affinity, num_devices, per_device, cap, order, num_experts):
    """Device of every replica, or None when one fits on no device under the cap."""
    p = len(wl)
    dev = np.full(p, -1, dtype=np.int64)
    load = np.zeros(num_devices)
    count = np.zeros(num_devices, dtype=np.int64)
    held = np.zeros((num_devices, num_experts), dtype=bool)
    toward = np.zeros((p, num_devices))  # toward[x, d]: affinity of replica x to d's replicas
    for x in order:
        ok = (count < per_device) & (load + wl[x] <= cap * (1 + _REL_TOL)) & ~held[:, expert[x]]
        if not ok.any():
            return None
        d = _pick(toward[x], load, ok)
        dev[x] = d
        load[d] += wl[x]
        count[d] += 1
        held[d, expert[x]] = True
        toward[:, d] += affinity[:, x]
    return dev


def _refine(dev, wl, expert, affinity, num_devices, cap, num_experts, max_swaps):
    """Best improving feasible swaps (module docstring, step 4) until none is left."""
    dev = dev.copy()
    p = len(dev)
    load = np.bincount(dev, weights=wl, minlength=num_devices)
    held = np.zeros((num_devices, num_experts), dtype=np.int64)
    np.add.at(held, (dev, expert), 1)
    onehot = np.zeros((p, num_devices))
    onehot[np.arange(p), dev] = 1.0
    toward = affinity @ onehot
    scale = _REL_TOL * max(affinity.sum(), 1.0)
    limit = cap * (1 + _REL_TOL)
    for _ in range(max_swaps):
        own = toward[np.arange(p), dev]
        cross = toward[:, dev]  # cross[a, b] = affinity of a to b's device
        gain = cross + cross.T - 2 * affinity - own[:, None] - own[None, :]
        # a -> dev[b] and b -> dev[a]: both devices stay under the cap, no expert lands twice
        new_a = load[dev][:, None] - wl[:, None] + wl[None, :]  # a's device with b instead of a
        ok = (dev[:, None] != dev[None, :]) & (expert[:, None] != expert[None, :])
        ok &= (new_a <= limit) & (new_a.T <= limit)
        ok &= (held[dev[None, :], expert[:, None]] == 0) & (held[dev[:, None], expert[None, :]] == 0)
        gain = np.where(ok, gain, -np.inf)
        a, b = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if not gain[a, b] > scale:
            break
        pa, pb = dev[a], dev[b]
        dev[a], dev[b] = pb, pa
        load[pa] += wl[b] - wl[a]
        load[pb] += wl[a] - wl[b]
        held[pa, expert[a]] -= 1
        held[pb, expert[b]] -= 1
        held[pb, expert[a]] += 1
        held[pa, expert[b]] += 1
        toward[:, pa] += affinity[:, b] - affinity[:, a]
        toward[:, pb] += affinity[:, a] - affinity[:, b]
    return dev


def affinity_placement(
    weight: np.ndarray,
    coactivation: np.ndarray,
    num_physical: int,
    num_devices: int,
    load_slack: float = 0.1,
    seed: int = 0,
    max_swaps: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Affinity-aware EPLB placement with replication (algorithm in the module docstring).

    weight: [X, N] expert loads; coactivation: [X, N, N] (``coactivation_counts`` per layer; the
    diagonal is ignored). Returns phy2log [X, P] (logical expert of every physical slot; device g
    owns slots [g*P/D, (g+1)*P/D), its replicas ordered by expert id), phy_rank [X, P] (replica
    index of the slot) and logcnt [X, N] (replicas per expert), as EPLB's
    ``rebalance_experts_hierarchical``. Deterministic given ``seed``, which orders replicas of
    equal load. ``max_swaps`` defaults to 4 * P per layer.
    """
    weight = np.asarray(weight, dtype=np.float64)
    coactivation = np.asarray(coactivation, dtype=np.float64)
    num_layers, n = weight.shape
    if coactivation.shape != (num_layers, n, n):
        raise ValueError(f"coactivation must be [X, N, N] = [{num_layers}, {n}, {n}], got {coactivation.shape}")
    if num_devices < 1 or num_physical % num_devices:
        raise ValueError(f"{num_physical} physical slots cannot be split evenly over {num_devices} devices")
    if load_slack < 0:
        raise ValueError(f"load_slack must be >= 0, got {load_slack}")
    per_device = num_physical // num_devices
    max_swaps = 4 * num_physical if max_swaps is None else max_swaps
    rng = np.random.default_rng(seed)
    phy2rep, rep_rank, logcnt = replicate_experts(weight, num_physical)  # replicas in EPLB's slot order
    phy2log = np.empty((num_layers, num_physical), dtype=np.int64)
    phy_rank = np.empty((num_layers, num_physical), dtype=np.int64)
    for l in range(num_layers):
        expert, cnt = phy2rep[l], logcnt[l]
        wl = weight[l, expert] / cnt[expert]
        pair = coactivation[l][np.ix_(expert, expert)] / np.outer(cnt[expert], cnt[expert])
        pair[expert[:, None] == expert[None, :]] = 0.0  # nothing gained from two copies of one expert
        lpt = balanced_packing(wl[None, :], num_devices)[0][0]
        lpt_max = np.bincount(lpt, weights=wl, minlength=num_devices).max()
        cap = max((1.0 + load_slack) * wl.sum() / num_devices, lpt_max)
        order = np.lexsort((rng.permutation(num_physical), -wl))
        dev = _greedy(wl, expert, pair, num_devices, per_device, cap, order, n)
        if dev is None:
            dev = lpt
        dev = _refine(dev, wl, expert, pair, num_devices, cap, n, max_swaps)
        slots = np.lexsort((rep_rank[l], expert, dev))  # device-major, then expert id, then replica
        phy2log[l] = expert[slots]
        phy_rank[l] = rep_rank[l][slots]
    return phy2log, phy_rank, logcnt
