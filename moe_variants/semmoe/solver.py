"""Sem-MoE Algorithm 1: alternating balanced co-clustering of experts and requests (paper §3.3, App. B).

For every MoE layer, starting from a request clustering, repeat up to ``n_steps`` times:

1. ``expert_place``: experts in descending load order go to the cluster with the best score
   ``alpha_e * EAF_e + beta_e * EAF_r - gamma_e * load`` (each term min-max normalised over the
   clusters that still have room; clusters take exactly N/D experts), followed by pairwise-swap
   refinement on ``(1 - theta) * remote + lam * expert_balance`` (remote counted over requests).
2. ``request_schedule``: requests in descending length order go to the open cluster with the best
   ``alpha_r * RAF_r + beta_r * RAF_e`` (quota ceil(R/D) requests per cluster).
3. Score the placement with the co-clustering objective J (module ``objective``), keep the best;
   stop early once the request clustering repeats or J has not improved for ``patience`` steps.

The result per layer is E (expert -> device) and T / Tp (token -> device; by default the device
holding most of the token's predicted activations, optionally the paper's literal votes of the
requests containing the token, see :class:`TokenTable`); once every layer is placed the 2-gram
table A / Ap is counted from the profile's routes (App. B.1).

Affinities (``a`` token weights [V], ``Cp`` [V, N] row-normalised counts, ``M`` [R, V] request
token counts, ``P = M @ Cp`` [R, N] predicted expert activations of each request):

* ``EAF_e[e, c]`` expert-expert: co-activation ``Cp^T diag(a) Cp`` summed over experts in c;
* ``EAF_r[e, c]`` / ``RAF_e[r, c]`` request-expert: ``P`` summed over the requests / experts in c;
* ``RAF_r[r, c]`` request-request: cosine between r's centred, normalised profile and the sum of
  those of the requests in c.

Deviations from the paper's pseudo-code, all deterministic given the seed:

* the swap refinement evaluates every expert pair at once (vectorised) and applies the best
  improving swaps with disjoint clusters per round, instead of sampling one random pair per step;
* request profiles are centred before the cosine (otherwise the component every request shares,
  common tokens, makes any non-empty cluster attract every request);
* with the default ``MASS`` token table each layer is finished by a token-level descent of J
  (:func:`_polish`) from two starts, the alternation's placement and a placement grown from expert
  co-activation alone; the lower J wins. This closes most of the gap to the MILP optimum on
  small instances, where the balanced request clustering is coarse;
* the seed orders requests of equal length; the request clustering of layer l warm-starts layer
  l+1 (layer 0 starts from requests scheduled against an EPLB-style placement), and each layer's
  devices are renamed to match the request clusters, so a request's device is consistent across
  layers and Algorithm 2 can sum its votes over layers.

Shape legend: ``L`` layers, ``N`` experts, ``V`` vocabulary, ``R`` requests, ``S`` occurrences,
``K`` top-k, ``D`` devices/clusters.
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linear_sum_assignment

from .baselines import balanced_packing
from .objective import coclustering_objective
from .profile import Profile
from .tables import Tables

__all__ = [
    "SolverConfig",
    "TokenTable",
    "solve",
    "majority_device",
    "sequence_tables",
    "token_vote_tables",
    "token_mass_tables",
    "copy_to_extended_tokens",
]

MAX_SEQUENCE_CONTEXTS = 1 << 22


class TokenTable(str, enum.Enum):
    """How the token table T / Tp is derived from a layer's solution.

    ``MASS``: T[t] = the device holding the largest share of t's predicted activations under E,
    Tp = that share, i.e. Pr(t's activation is local on T[t]) -- the quantity Algorithm 3 compares
    with Ap. ``VOTES``: the paper's literal Alg. 1 lines 54-55, the device most of t's
    occurrences were assigned to through their requests, Tp = that fraction.
    """

    MASS = "mass"
    VOTES = "votes"


@dataclass(frozen=True)
class SolverConfig:
    n_steps: int = 8  # alternations per layer (Alg. 1 lines 45-51)
    ft_steps: int = 64  # swap-refinement rounds per expert placement (lines 20-25)
    alpha_e: float = 1.0  # expert placement: expert-expert affinity
    beta_e: float = 1.0  # expert placement: request-expert affinity
    gamma_e: float = 1.0  # expert placement: cluster load penalty
    alpha_r: float = 1.0  # request scheduling: request-request affinity
    beta_r: float = 1.0  # request scheduling: request-expert affinity
    theta: float = 0.0  # objective: weight of token balance vs remote activations (see below)
    expert_balance: float = 8.0  # objective: weight of expert overload (lam)
    balance_slack: float = 0.1  # objective: device load above (1 + slack) x mean counts as overload
    patience: int = 2  # stop a layer after this many steps without improving J
    lookback: int = 2  # layers of device history in the sequence table A
    token_table: TokenTable = TokenTable.MASS
    polish: bool = True  # finish each layer with token-level swap descent (MASS tables only)

    def validate(self, num_devices: int) -> None:
        if self.n_steps < 1 or self.ft_steps < 0 or self.patience < 1:
            raise ValueError("n_steps and patience must be >= 1 and ft_steps >= 0")
        if not 0.0 <= self.theta <= 1.0:
            raise ValueError(f"theta must be in [0, 1], got {self.theta}")
        TokenTable(self.token_table)
        if self.balance_slack < 0 or self.expert_balance < 0:
            raise ValueError("expert_balance and balance_slack must be >= 0")
        if self.lookback < 1:
            raise ValueError(f"lookback must be >= 1, got {self.lookback}")
        if num_devices**self.lookback > MAX_SEQUENCE_CONTEXTS:
            raise ValueError(
                f"sequence table with D={num_devices}, lookback={self.lookback} has {num_devices**self.lookback} "
                f"rows (limit {MAX_SEQUENCE_CONTEXTS}); lower --lookback"
            )


def _minmax(x: np.ndarray, valid: np.ndarray) -> np.ndarray:
    v = x[valid]
    lo, hi = v.min(), v.max()
    return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)


def _onehot(labels: np.ndarray, num_classes: int) -> sp.csr_matrix:
    n = len(labels)
    return sp.csr_matrix((np.ones(n), (np.arange(n), labels)), shape=(n, num_classes))


@dataclass
class _Layer:
    cp: sp.csr_matrix  # [V, N]
    p: np.ndarray  # [R, N]
    w: np.ndarray  # [N] expert load share
    co: np.ndarray  # [N, N] expert co-activation
    p_total: float
    acp: sp.csr_matrix  # [V, N] diag(a) @ cp: share of all activations per (token, expert)


def _layer_inputs(profile: Profile, layer: int, m: sp.csr_matrix, a: np.ndarray) -> _Layer:
    cp = profile.confidence(layer)
    p = (m @ cp).toarray()
    acp = sp.csr_matrix(sp.diags(a) @ cp)
    co = (cp.T @ acp).toarray()
    return _Layer(cp=cp, p=p, w=cp.T @ a, co=co, p_total=float(p.sum()), acp=acp)


def _refine(e2d: np.ndarray, q: np.ndarray, w: np.ndarray, d: int, cfg: SolverConfig) -> np.ndarray:
    """Pairwise-swap refinement (Alg. 1 lines 20-25) of e2d [N] on
    ``(1 - theta) * (1 - sum_e q[e, E(e)]) + lam * expert_overload`` (module ``objective``).

    q: [N, D] share of all activations that expert e receives from the tokens or requests of
    cluster c (sums to <= 1); w: [N] expert load shares. Every round evaluates all expert pairs at
    once and applies the best improving swaps whose clusters are disjoint (their gains add up).
    """
    e2d = e2d.copy()
    cap, n = (1.0 + cfg.balance_slack) / d, len(e2d)
    load = np.bincount(e2d, weights=w, minlength=d)
    over = lambda x: np.maximum(x - cap, 0.0)  # noqa: E731
    upper = np.triu(np.ones((n, n), dtype=bool), 1)
    for _ in range(cfg.ft_steps):
        aq = q[:, e2d]  # aq[i, j] = share expert i gets from expert j's cluster
        diag = aq[np.arange(n), np.arange(n)]
        d_local = aq + aq.T - diag[:, None] - diag[None, :]
        li = load[e2d]
        shift = w[None, :] - w[:, None]  # load moving into i's cluster when i <-> j
        d_bal = over(li[:, None] + shift) + over(li[None, :] - shift) - over(li[:, None]) - over(li[None, :])
        gain = (1 - cfg.theta) * d_local - cfg.expert_balance * d_bal
        gain[~upper | (e2d[:, None] == e2d[None, :])] = 0.0
        cand = np.flatnonzero(gain > 1e-12)
        if cand.size == 0:
            break
        cand = cand[np.argsort(-gain.ravel()[cand], kind="stable")][: 8 * d]
        used = np.zeros(d, dtype=bool)
        for flat in cand:
            i, j = divmod(int(flat), n)
            ci, cj = e2d[i], e2d[j]
            if used[ci] or used[cj]:
                continue
            used[ci] = used[cj] = True
            e2d[i], e2d[j] = cj, ci
            load[ci] += w[j] - w[i]
            load[cj] += w[i] - w[j]
    return e2d


def _polish(e2d: np.ndarray, lay: _Layer, d: int, cfg: SolverConfig) -> np.ndarray:
    """Descend the token-level objective directly: alternate T <- each token's best device under E
    and E <- swap refinement against the token mass of the clusters T defines. Each round can only
    lower ``(1 - theta) * remote + lam * expert_balance`` (T's re-optimisation only adds local mass)."""
    v = lay.cp.shape[0]
    for _ in range(cfg.ft_steps):
        t, _ = token_mass_tables(lay.cp, e2d, d)
        rows = np.flatnonzero(t >= 0)
        onehot = sp.csr_matrix((np.ones(len(rows)), (rows, t[rows])), shape=(v, d))
        q_tok = np.asarray((lay.acp.T @ onehot).todense())  # [N, D]
        new = _refine(e2d, q_tok, lay.w, d, cfg)
        if np.array_equal(new, e2d):
            break
        e2d = new
    return e2d


def _align_labels(e2d: np.ndarray, lay: _Layer, req2c: np.ndarray, d: int) -> np.ndarray:
    """Rename the clusters of e2d [N] to best match the request clusters req2c [R] (max-weight
    matching on the request mass each expert cluster receives from each request cluster), so that
    a request's device is consistent across layers for Algorithm 2."""
    q = (_onehot(req2c, d).T @ lay.p).T  # [N, D]
    agree = np.asarray((_onehot(e2d, d).T @ q))  # [D_expert_cluster, D_request_cluster]
    rows, cols = linear_sum_assignment(-agree)
    rename = np.empty(d, dtype=np.int64)
    rename[rows] = cols
    return rename[e2d]


def _expert_place(lay: _Layer, req2c: np.ndarray, d: int, cfg: SolverConfig) -> np.ndarray:
    """Alg. 1 ``expert_place``: [N] cluster of every expert given the request clustering [R]."""
    n = lay.p.shape[1]
    per = n // d
    q = (_onehot(req2c, d).T @ lay.p).T  # [N, D] EAF_r
    aff = np.zeros((n, d))  # EAF_e, grows as experts are placed
    count = np.zeros(d, dtype=np.int64)
    load = np.zeros(d)
    e2d = np.empty(n, dtype=np.int64)
    for e in np.argsort(-lay.w, kind="stable"):
        valid = count < per
        score = (
            cfg.alpha_e * _minmax(aff[e], valid)
            + cfg.beta_e * _minmax(q[e], valid)
            - cfg.gamma_e * _minmax(load, valid)
        )
        c = int(np.argmax(np.where(valid, score, -np.inf)))
        e2d[e] = c
        count[c] += 1
        load[c] += lay.w[e]
        aff[:, c] += lay.co[:, e]
    return _refine(e2d, np.asarray(q) / max(lay.p_total, 1e-30), lay.w, d, cfg)


def _request_schedule(lay: _Layer, e2d: np.ndarray, order: np.ndarray, d: int, cfg: SolverConfig) -> np.ndarray:
    """Alg. 1 ``request_schedule``: [R] cluster of every request given the expert placement [N]."""
    r = lay.p.shape[0]
    quota = -(-r // d)
    mass = lay.p.sum(1, keepdims=True)
    raf_e = (lay.p @ _onehot(e2d, d)) / np.maximum(mass, 1e-30)  # [R, D] share of r's mass on c
    # Centre the profiles first: every request shares the common-token component, and without
    # centring any non-empty cluster looks similar to every request and attracts it.
    centred = lay.p / np.maximum(mass, 1e-30)
    centred = centred - centred.mean(0, keepdims=True)
    unit = centred / np.maximum(np.linalg.norm(centred, axis=1, keepdims=True), 1e-30)
    centroid = np.zeros((d, lay.p.shape[1]))
    sq = np.zeros(d)
    inv_norm = np.zeros(d)  # 1 / |centroid|, 0 for empty clusters
    count = np.zeros(d, dtype=np.int64)
    req2c = np.empty(r, dtype=np.int64)
    open_idx = np.arange(d)
    # raf_e is fixed per request: its min / max over the open clusters only change when one fills.
    raf_lo, raf_span = None, None
    for pos, i in enumerate(order):
        if raf_lo is None:
            rest = raf_e[order[pos:]][:, open_idx]
            raf_lo = np.zeros(r)
            raf_span = np.ones(r)
            raf_lo[order[pos:]] = rest.min(1)
            span = rest.max(1) - raf_lo[order[pos:]]
            raf_span[order[pos:]] = np.where(span > 0, span, np.inf)
        u = unit[i]
        dots = centroid @ u
        cos = (dots * inv_norm)[open_idx]
        lo, hi = cos.min(), cos.max()
        score = cfg.beta_r * (raf_e[i, open_idx] - raf_lo[i]) / raf_span[i]
        if hi > lo:
            score += cfg.alpha_r * (cos - lo) / (hi - lo)
        c = int(open_idx[np.argmax(score)])
        req2c[i] = c
        count[c] += 1
        sq[c] += 2.0 * dots[c] + 1.0  # |C + u|^2 with |u| = 1
        inv_norm[c] = 1.0 / np.sqrt(sq[c]) if sq[c] > 1e-12 else 0.0
        centroid[c] += u
        if count[c] >= quota:
            open_idx = open_idx[open_idx != c]
            raf_lo = None
    return req2c


def token_vote_tables(
    token_ids: np.ndarray, occ2c: np.ndarray, token_freq: np.ndarray, d: int
) -> tuple[np.ndarray, np.ndarray]:
    """Alg. 1 lines 54-55: T [V] = the cluster most of a token's occurrences were assigned to, Tp [V]
    = that fraction; -1 / 0 for unseen tokens. token_ids, occ2c: [S]; token_freq: [V]."""
    seen = np.flatnonzero(token_freq > 0)
    compact = np.full(len(token_freq), -1, dtype=np.int64)
    compact[seen] = np.arange(len(seen))
    votes = np.bincount(compact[token_ids] * d + occ2c, minlength=len(seen) * d).reshape(len(seen), d)
    t = np.full(len(token_freq), -1, dtype=np.int64)
    tp = np.zeros(len(token_freq), dtype=np.float64)
    t[seen] = np.argmax(votes, axis=1)
    tp[seen] = votes.max(axis=1) / token_freq[seen]
    return t, tp


def token_mass_tables(cp: sp.csr_matrix, expert2device: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """T [V] = device with the largest share of each token's predicted activations (lowest device
    on ties), Tp [V] = that share; -1 / 0 for tokens without counts. cp: [V, N] row-normalised;
    expert2device: [N]."""
    share = sp.csr_matrix(cp @ _onehot(expert2device, d))  # [V, D], a few nonzeros per row
    share.sum_duplicates()
    share.sort_indices()
    t = np.full(share.shape[0], -1, dtype=np.int64)
    tp = np.zeros(share.shape[0])
    nnz_per_row = np.diff(share.indptr)
    rows = np.flatnonzero(nnz_per_row)
    if rows.size:
        tp[rows] = np.maximum.reduceat(share.data, share.indptr[rows])
        row_of = np.repeat(np.arange(share.shape[0]), nnz_per_row)
        hit = np.flatnonzero(share.data == tp[row_of])
        first_row, first = np.unique(row_of[hit], return_index=True)
        t[first_row] = share.indices[hit[first]]
    return t, tp


def majority_device(routes_l: np.ndarray, expert2device: np.ndarray) -> np.ndarray:
    """[S] device holding most of each occurrence's top-k experts (ties: the better-ranked
    expert's). routes_l: [S, K] in router order; expert2device: [N]. Same rule as
    ``scheduling.routed_devices``, over numpy for the offline pass."""
    dev = expert2device[routes_l]
    same = (dev[:, :, None] == dev[:, None, :]).sum(-1)
    best = np.argmax(same, axis=1)
    return dev[np.arange(len(dev)), best]


def copy_to_extended_tokens(profile: Profile, *tables: np.ndarray) -> None:
    """In place: tokens the vocabulary extension covers (never seen, with a nearest neighbour) take
    their neighbour's entries in every [L, V] table."""
    ext = np.flatnonzero((profile.token_freq == 0) & (profile.nn_source >= 0))
    for table in tables:
        table[:, ext] = table[:, profile.nn_source[ext]]


def sequence_tables(
    routes: np.ndarray, expert2device: np.ndarray, num_devices: int, lookback: int
) -> tuple[np.ndarray, np.ndarray]:
    """App. B.1: A [L, D**lookback] most frequent routed device given the routed devices of the
    previous ``lookback`` layers, Ap its empirical probability; -1 / 0 for unseen contexts and for
    the first ``lookback`` layers. routes: [L, S, K]; expert2device: [L, N]."""
    num_layers = routes.shape[0]
    ctx_count = num_devices**lookback
    seq = np.full((num_layers, ctx_count), -1, dtype=np.int16)
    conf = np.zeros((num_layers, ctx_count), dtype=np.float32)
    history = []  # routed devices of the last `lookback` layers, most recent first
    for l in range(num_layers):
        dev = majority_device(routes[l], expert2device[l]).astype(np.int64)
        if len(history) == lookback:
            ctx = np.zeros_like(dev)
            for j, prev in enumerate(history):
                ctx += prev * num_devices**j
            hist = np.bincount(ctx * num_devices + dev, minlength=ctx_count * num_devices)
            hist = hist.reshape(ctx_count, num_devices)
            total = hist.sum(1)
            ok = total > 0
            seq[l, ok] = np.argmax(hist[ok], axis=1)
            conf[l, ok] = hist[ok].max(1) / total[ok]
        history = [dev] + history[: lookback - 1]
    return seq, conf


def solve(
    profile: Profile,
    num_devices: int,
    seed: int = 0,
    config: SolverConfig = SolverConfig(),
    log: Callable[[str], None] | None = None,
) -> Tables:
    """Run Algorithm 1 on every layer of ``profile`` and return the Sem-MoE tables for EP=num_devices."""
    d, n = num_devices, profile.num_experts
    if d < 1 or n % d:
        raise ValueError(f"--ep {d} must divide the number of experts ({n})")
    config.validate(d)
    config = replace(config, token_table=TokenTable(config.token_table))
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    a = profile.token_weights()
    m = profile.request_token_matrix()
    lengths = profile.request_lengths()
    order = np.lexsort((rng.permutation(profile.num_requests), -lengths))  # longest first, seeded ties
    req_of_occ = profile.request_of_token()
    num_layers, v = profile.num_layers, profile.vocab_size

    e2d_all = np.empty((num_layers, n), dtype=np.int64)
    t_all = np.full((num_layers, v), -1, dtype=np.int16)
    tp_all = np.zeros((num_layers, v), dtype=np.float32)
    terms = []
    req2c = None
    for l in range(num_layers):
        lay = _layer_inputs(profile, l, m, a)
        if req2c is None:  # Alg. 1 line 44: cluster requests against a load-balanced placement
            init = balanced_packing(lay.w[None, :], d)[0][0]
            req2c = _request_schedule(lay, init, order, d, config)
        def objective(t2d, e2d):
            return coclustering_objective(
                lay.cp, a, t2d, e2d, d, config.theta, config.expert_balance, config.balance_slack
            )

        best, stale = None, 0
        for _ in range(config.n_steps):
            e2d = _expert_place(lay, req2c, d, config)
            new_req = _request_schedule(lay, e2d, order, d, config)
            if config.token_table is TokenTable.VOTES:
                t, tp = token_vote_tables(profile.token_ids, new_req[req_of_occ], profile.token_freq, d)
            else:
                t, tp = token_mass_tables(lay.cp, e2d, d)
            obj = objective(t, e2d)
            if best is None or obj.total < best[0].total - 1e-12:
                best, stale = (obj, e2d, new_req, t, tp), 0
            else:
                stale += 1
            converged = np.array_equal(new_req, req2c)
            req2c = new_req
            if converged or stale >= config.patience:
                break
        obj, e2d, req2c, t, tp = best
        if config.token_table is TokenTable.MASS and config.polish:
            # Polish the alternation's placement and a second start grown from expert co-activation
            # alone; keep the lowest J, relabelled to agree with the request clusters.
            coact = _expert_place(lay, req2c, d, replace(config, beta_e=0.0, ft_steps=0))
            for cand in (_polish(e2d, lay, d, config), _polish(coact, lay, d, config)):
                cand = _align_labels(cand, lay, req2c, d)
                t_c, tp_c = token_mass_tables(lay.cp, cand, d)
                obj_c = objective(t_c, cand)
                if obj_c.total < obj.total - 1e-12:
                    obj, e2d, t, tp = obj_c, cand, t_c, tp_c
        e2d_all[l], t_all[l], tp_all[l] = e2d, t, tp
        terms.append(asdict(obj))
        if log:
            log(f"layer {l}: J={obj.total:.4f} remote={obj.remote:.4f} tok_bal={obj.token_balance:.4f} "
                f"overload={obj.expert_balance:.4f} ({time.perf_counter() - t0:.1f}s)")

    copy_to_extended_tokens(profile, t_all, tp_all)

    seq, seq_conf = sequence_tables(profile.routes, e2d_all, d, config.lookback)
    meta = {
        "seed": seed,
        "config": asdict(config),
        "objective": terms,
        "solve_seconds": time.perf_counter() - t0,
        "profile": {"num_requests": profile.num_requests, "num_tokens": profile.num_tokens, **profile.meta},
    }
    return Tables(
        method="semmoe",
        num_devices=d,
        expert2device=e2d_all,
        token2device=t_all,
        token2device_conf=tp_all,
        seq2device=seq,
        seq2device_conf=seq_conf,
        lookback=config.lookback,
        meta=meta,
    )
