"""Baseline expert placements: contiguous (megatron-core's default), EPLB-style load balancing, and
an exact MILP for the co-clustering objective on small problems.

Shape legend: ``X`` independent rows (layers, or layers x nodes), ``L`` layers, ``N`` logical experts,
``P`` physical expert slots (replicas included), ``D`` devices, ``V`` vocabulary.

The EPLB-style functions follow the algorithm described in DeepSeek's EPLB README and
REFERENCE_NOTES Part B §3.3 (greedy LPT packing with equal cardinality; replicate the expert
with the highest per-replica load; hierarchical: groups -> nodes, replicas within nodes,
replicas -> GPUs). They are written here from that description over numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from .objective import coclustering_objective

__all__ = [
    "contiguous_placement",
    "balanced_packing",
    "replicate_experts",
    "rebalance_experts_hierarchical",
    "rebalance_experts",
    "MilpResult",
    "milp_coclustering",
]


def contiguous_placement(num_layers: int, num_experts: int, num_devices: int) -> np.ndarray:
    """[L, N] megatron-core's default: device d owns experts [d*N/D, (d+1)*N/D)."""
    if num_devices < 1 or num_experts % num_devices:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {num_devices} devices")
    return np.tile(np.arange(num_experts) // (num_experts // num_devices), (num_layers, 1))


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the n items of every row into ``num_packs`` packs of exactly n / num_packs items,
    balancing pack weight greedily (heaviest item first into the lightest pack that has room).

    weight: [X, n]. Returns pack_index [X, n] (pack of each item) and rank_in_pack [X, n] (order in
    which the item entered its pack). With one item per pack every assignment is equally balanced
    and the identity is returned.
    """
    weight = np.asarray(weight, dtype=np.float64)
    num_rows, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items cannot be packed evenly into {num_packs} packs")
    per_pack = n // num_packs
    if per_pack == 1:
        return np.tile(np.arange(n), (num_rows, 1)), np.zeros((num_rows, n), dtype=np.int64)
    pack_index = np.empty((num_rows, n), dtype=np.int64)
    rank_in_pack = np.empty((num_rows, n), dtype=np.int64)
    for x in range(num_rows):
        load = np.zeros(num_packs)
        count = np.zeros(num_packs, dtype=np.int64)
        for item in np.argsort(-weight[x], kind="stable"):
            open_load = np.where(count < per_pack, load, np.inf)
            pack = int(np.argmin(open_load))  # lightest open pack, lowest index on ties
            pack_index[x, item] = pack
            rank_in_pack[x, item] = count[pack]
            load[pack] += weight[x, item]
            count[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give n logical experts ``num_physical`` slots: one each, then every extra slot to the expert
    whose load per replica is currently highest (minimises the maximum replica load greedily).

    weight: [X, n]. Returns phy2log [X, P], phy_rank [X, P] (replica index of the slot) and
    logcnt [X, n] (replicas per logical expert).
    """
    weight = np.asarray(weight, dtype=np.float64)
    num_rows, n = weight.shape
    if num_physical < n:
        raise ValueError(f"{num_physical} physical slots cannot hold {n} logical experts")
    phy2log = np.tile(np.arange(num_physical), (num_rows, 1))
    phy_rank = np.zeros((num_rows, num_physical), dtype=np.int64)
    logcnt = np.ones((num_rows, n), dtype=np.int64)
    rows = np.arange(num_rows)
    for slot in range(n, num_physical):
        best = np.argmax(weight / logcnt, axis=1)
        phy2log[:, slot] = best
        phy_rank[:, slot] = logcnt[rows, best]
        logcnt[rows, best] += 1
    return phy2log, phy_rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of a permutation matrix [X, n]."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_experts_hierarchical(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hierarchical EPLB placement with replication.

    weight: [L, N] expert loads; experts form ``num_groups`` contiguous groups of N / num_groups.
    Returns phy2log [L, P] (logical expert of every physical slot, slots of GPU g are
    [g*P/num_gpus, (g+1)*P/num_gpus)), phy_rank [L, P] and logcnt [L, N].
    """
    weight = np.asarray(weight, dtype=np.float64)
    num_layers, n = weight.shape
    for what, a, b in (
        ("experts", n, num_groups),
        ("groups", num_groups, num_nodes),
        ("GPUs", num_gpus, num_nodes),
        ("physical slots", num_physical, num_gpus),
    ):
        if b < 1 or a % b:
            raise ValueError(f"{what} ({a}) must divide evenly by {b}")
    group_size = n // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = n // num_nodes
    phys_per_node = num_physical // num_nodes
    phys_per_gpu = num_physical // num_gpus

    # Step 1: pack expert groups onto nodes by group load; renumber experts node-major ("node order").
    group_load = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    group_start = (group_node * groups_per_node + group_rank) * group_size  # [L, num_groups]
    log2node_order = (group_start[:, :, None] + np.arange(group_size)).reshape(num_layers, n)
    node_order2log = _inverse(log2node_order)

    # Step 2: replicate experts within each node; rows are (layer, node) pairs.
    node_weight = np.take_along_axis(weight, node_order2log, axis=1).reshape(-1, experts_per_node)
    phy2local, phy_rank, local_cnt = replicate_experts(node_weight, phys_per_node)

    # Step 3: pack the node's physical experts onto its GPUs by per-replica load.
    phy_load = np.take_along_axis(node_weight / local_cnt, phy2local, axis=1)
    gpu, rank_on_gpu = balanced_packing(phy_load, num_gpus // num_nodes)
    slot_of_phy = gpu * phys_per_gpu + rank_on_gpu
    phy_of_slot = _inverse(slot_of_phy)

    slot2local = np.take_along_axis(phy2local, phy_of_slot, axis=1)  # [L*nodes, P/nodes]
    node_offset = (np.arange(num_nodes) * experts_per_node)[None, :, None]
    slot2node_order = (slot2local.reshape(num_layers, num_nodes, -1) + node_offset).reshape(num_layers, -1)
    phy2log = np.take_along_axis(node_order2log, slot2node_order, axis=1)
    slot_rank = np.take_along_axis(phy_rank, phy_of_slot, axis=1).reshape(num_layers, -1)
    logcnt = np.take_along_axis(local_cnt.reshape(num_layers, -1), log2node_order, axis=1)
    return phy2log, slot_rank, logcnt


def rebalance_experts(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB entry point: hierarchical when groups divide over nodes, else one global group and node.

    weight: [L, N]. Returns phy2log [L, P], log2phy [L, N, max_replicas] (-1 padded), logcnt [L, N].
    """
    weight = np.asarray(weight, dtype=np.float64)
    if num_groups % num_nodes == 0:
        phy2log, phy_rank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phy_rank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    num_layers = weight.shape[0]
    log2phy = np.full((num_layers, weight.shape[1], int(logcnt.max())), -1, dtype=np.int64)
    layer_idx = np.repeat(np.arange(num_layers), num_replicas)
    log2phy[layer_idx, phy2log.ravel(), phy_rank.ravel()] = np.tile(np.arange(num_replicas), num_layers)
    return phy2log, log2phy, logcnt


@dataclass(frozen=True)
class MilpResult:
    expert2device: np.ndarray  # [N]
    token2device: np.ndarray  # [V], -1 for tokens with zero frequency
    objective: float  # J of the returned solution
    optimal: bool  # HiGHS proved optimality (within mip_rel_gap)
    mip_gap: float  # HiGHS' relative gap between incumbent and bound
    status: str


def milp_coclustering(
    cp: sp.csr_matrix,
    a: np.ndarray,
    num_devices: int,
    theta: float,
    lam: float,
    slack: float = 0.0,
    time_limit: float = 60.0,
    max_pair_vars: int = 200_000,
    mip_rel_gap: float = 1e-6,
) -> MilpResult:
    """Solve the paper's 0-1 co-clustering program for one layer exactly with HiGHS.

    cp: [V, N] row-normalised counts; a: [V] token weights summing to 1. Variables: R[d, j] token j
    on device d, C[d, k] expert k on device d, z[d, (j, k)] <= min(R, C) for each nonzero of cp
    (the linearised local activation), u the token-balance deviations, v the expert overloads.
    Minimises :func:`coclustering_objective` (module ``objective``) subject to one device per
    token and expert and N/D experts per device; expert 0 is pinned to device 0 (devices are
    interchangeable). Sizes beyond ``max_pair_vars`` z variables raise ``ValueError``.
    """
    cp = sp.csr_matrix(cp)
    a = np.asarray(a, dtype=np.float64)
    num_tokens_all, n = cp.shape
    d = num_devices
    if n % d:
        raise ValueError(f"{n} experts cannot be split evenly over {d} devices")
    toks = np.flatnonzero(a > 0)
    sub = cp[toks].tocoo()
    t, nnz = len(toks), sub.nnz
    if d * nnz > max_pair_vars:
        raise ValueError(
            f"milp: {d * nnz} pair variables exceed the limit {max_pair_vars}; it is meant for small profiles "
            "(use --method semmoe)"
        )
    pj, pk = sub.row, sub.col
    wpair = a[toks][pj] * sub.data  # a_j * Cp[j, k]
    w = cp.T @ a

    # Variable layout: [R (d*t) | C (d*n) | z (d*nnz) | u (d) | v (d)].
    o_c = d * t
    o_z = o_c + d * n
    o_u = o_z + d * nnz
    o_v = o_u + d
    num_vars = o_v + d
    r_idx = lambda dd, j: dd * t + j  # noqa: E731
    c_idx = lambda dd, k: o_c + dd * n + k  # noqa: E731

    cost = np.zeros(num_vars)
    cost[o_z:o_u] = -(1 - theta) * np.tile(wpair, d)
    cost[o_u:o_v] = theta
    cost[o_v:] = lam

    rows, cols, vals, lo, hi = [], [], [], [], []
    row = 0

    def add(cidx, cval, lb, ub):
        nonlocal row
        cidx = np.asarray(cidx).ravel()
        rows.append(np.full(len(cidx), row))
        cols.append(cidx)
        vals.append(np.broadcast_to(np.asarray(cval, dtype=np.float64), cidx.shape).ravel())
        lo.append(lb)
        hi.append(ub)
        row += 1

    dd = np.arange(d)
    for j in range(t):  # one device per token
        add(r_idx(dd, j), 1.0, 1.0, 1.0)
    for k in range(n):  # one device per expert
        add(c_idx(dd, k), 1.0, 1.0, 1.0)
    for q in range(d):  # N/D experts per device
        add(c_idx(q, np.arange(n)), 1.0, n // d, n // d)
    for q in range(d):  # z <= R and z <= C, vectorised per device
        zi = o_z + q * nnz + np.arange(nnz)
        for other in (r_idx(q, pj), c_idx(q, pk)):
            rows.append(np.repeat(np.arange(row, row + nnz), 2))
            cols.append(np.stack([zi, other], axis=1).ravel())
            vals.append(np.tile([1.0, -1.0], nnz))
            lo.extend([-np.inf] * nnz)
            hi.extend([0.0] * nnz)
            row += nnz
    for q in range(d):  # u >= |token load - 1/D|, v >= expert load - (1 + slack)/D (and v >= 0)
        tok_idx = np.concatenate([[o_u + q], r_idx(q, np.arange(t))])
        add(tok_idx, np.concatenate([[1.0], -a[toks]]), -1.0 / d, np.inf)
        add(tok_idx, np.concatenate([[1.0], a[toks]]), 1.0 / d, np.inf)
        exp_idx = np.concatenate([[o_v + q], c_idx(q, np.arange(n))])
        add(exp_idx, np.concatenate([[1.0], -w]), -(1.0 + slack) / d, np.inf)

    a_mat = sp.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(row, num_vars)
    )
    integrality = np.zeros(num_vars)
    integrality[:o_z] = 1
    lower = np.zeros(num_vars)
    upper = np.ones(num_vars)
    upper[o_u:] = np.inf
    lower[c_idx(0, 0)] = 1.0  # symmetry breaking: expert 0 lives on device 0
    res = milp(
        cost,
        constraints=LinearConstraint(a_mat, np.array(lo), np.array(hi)),
        integrality=integrality,
        bounds=Bounds(lower, upper),
        options={"time_limit": float(time_limit), "disp": False, "mip_rel_gap": float(mip_rel_gap)},
    )
    if res.x is None:
        raise RuntimeError(f"milp found no feasible solution: {res.message}")
    x = np.round(res.x)
    expert2device = np.argmax(x[o_c:o_z].reshape(d, n), axis=0)
    token2device = np.full(num_tokens_all, -1, dtype=np.int64)
    token2device[toks] = np.argmax(x[:o_c].reshape(d, t), axis=0)
    obj = coclustering_objective(cp, a, token2device, expert2device, d, theta, lam, slack).total
    return MilpResult(
        expert2device=expert2device,
        token2device=token2device,
        objective=obj,
        optimal=res.status == 0,
        mip_gap=float(getattr(res, "mip_gap", np.nan) or 0.0),
        status=str(res.message),
    )
