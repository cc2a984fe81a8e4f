"""Placement-method registry: one interface, ``place(name, profile, num_devices, seed, config) -> Tables``.

* ``semmoe``: Algorithm 1 co-clustering with token and sequence tables (module ``solver``).
* ``contiguous``: megatron-core's default split, no scheduling.
* ``eplb``: EPLB-style load balancing without replicas (greedy LPT, equal experts per device) on
  the profile's per-layer expert loads, no scheduling.
* ``affinity-eplb``: affinity-aware EPLB (module ``affinity``): co-activated experts grouped on one
  device under EPLB's load cap plus ``balance_slack``, with EPLB's replica budget (none: tables
  place every expert once), no scheduling.
* ``milp``: the exact co-clustering optimum per layer (HiGHS), for small profiles only; its token
  table is the optimal token assignment with ``Tp`` = the token's predicted local share.

A new method is a function ``(profile, num_devices, seed, config) -> Tables`` registered with
:func:`register_method`. :func:`with_schedule` gives a baseline placement Sem-MoE's token and
sequence tables, to compare placements under the same scheduling.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Callable

import numpy as np

from .affinity import affinity_placement, coactivation_counts, coactivation_kept
from .baselines import balanced_packing, contiguous_placement, milp_coclustering
from .profile import Profile
from .solver import SolverConfig, copy_to_extended_tokens, sequence_tables, solve, token_mass_tables
from .tables import Tables

__all__ = ["METHODS", "register_method", "place", "with_schedule"]

PlacementFn = Callable[[Profile, int, int, SolverConfig], Tables]
METHODS: dict[str, PlacementFn] = {}


def register_method(name: str) -> Callable[[PlacementFn], PlacementFn]:
    def deco(fn: PlacementFn) -> PlacementFn:
        if name in METHODS:
            raise ValueError(f"placement method {name!r} registered twice")
        METHODS[name] = fn
        return fn

    return deco


def place(
    method: str, profile: Profile, num_devices: int, seed: int = 0, config: SolverConfig = SolverConfig()
) -> Tables:
    """Run the registered placement ``method``."""
    if method not in METHODS:
        raise ValueError(f"unknown --method {method!r}; choose from {sorted(METHODS)}")
    if num_devices < 1 or profile.num_experts % num_devices:
        raise ValueError(f"--ep {num_devices} must divide the number of experts ({profile.num_experts})")
    return METHODS[method](profile, num_devices, seed, config)


def with_schedule(tables: Tables, profile: Profile, lookback: int = 2) -> Tables:
    """``tables``' placement with the tables Sem-MoE builds for its own (token -> the device with the
    largest share of the token's activations in ``profile``, unseen tokens by their nearest
    neighbour; the App. B.1 sequence table), so that Algorithms 2 and 3 schedule tokens to it."""
    e2d, d = tables.expert2device, tables.num_devices
    num_layers, v = profile.num_layers, profile.vocab_size
    t_all = np.full((num_layers, v), -1, dtype=np.int16)
    tp_all = np.zeros((num_layers, v), dtype=np.float32)
    for l in range(num_layers):
        t, tp = token_mass_tables(profile.confidence(l), e2d[l], d)
        t_all[l], tp_all[l] = t, tp
    copy_to_extended_tokens(profile, t_all, tp_all)
    seq, seq_conf = sequence_tables(profile.routes, e2d, d, lookback)
    meta = {**tables.meta, "schedule": "token_mass"}
    return Tables(tables.method, d, e2d, t_all, tp_all, seq, seq_conf, lookback, meta)


def _expert_loads(profile: Profile) -> np.ndarray:
    """[L, N] activations per expert in the profile."""
    return np.stack([np.asarray(c.sum(axis=0)).ravel() for c in profile.counts]).astype(np.float64)


@register_method("semmoe")
def _semmoe(profile: Profile, num_devices: int, seed: int, config: SolverConfig) -> Tables:
    return solve(profile, num_devices, seed, config)


@register_method("contiguous")
def _contiguous(profile: Profile, num_devices: int, seed: int, config: SolverConfig) -> Tables:
    e2d = contiguous_placement(profile.num_layers, profile.num_experts, num_devices)
    return Tables("contiguous", num_devices, e2d, meta={"seed": seed})


@register_method("eplb")
def _eplb(profile: Profile, num_devices: int, seed: int, config: SolverConfig) -> Tables:
    e2d, _ = balanced_packing(_expert_loads(profile), num_devices)
    return Tables("eplb", num_devices, e2d, meta={"seed": seed})


@register_method("affinity-eplb")
def _affinity_eplb(profile: Profile, num_devices: int, seed: int, config: SolverConfig) -> Tables:
    n = profile.num_experts
    coact = np.stack([coactivation_counts(profile.routes[l], n) for l in range(profile.num_layers)])
    weight = np.stack([np.diagonal(c) for c in coact]).astype(np.float64)
    phy2log, _, _ = affinity_placement(weight, coact, n, num_devices, config.balance_slack, seed)
    e2d = np.empty_like(phy2log)
    np.put_along_axis(e2d, phy2log, np.broadcast_to(np.arange(n) // (n // num_devices), phy2log.shape), axis=1)
    kept = [coactivation_kept(c, row) for c, row in zip(coact, e2d)]
    meta = {"seed": seed, "load_slack": config.balance_slack, "coactivation_kept": kept}
    return Tables("affinity-eplb", num_devices, e2d, meta=meta)


@register_method("milp")
def _milp(profile: Profile, num_devices: int, seed: int, config: SolverConfig) -> Tables:
    config.validate(num_devices)
    t0 = time.perf_counter()
    a = profile.token_weights()
    num_layers, v = profile.num_layers, profile.vocab_size
    e2d = np.empty((num_layers, profile.num_experts), dtype=np.int64)
    t_all = np.full((num_layers, v), -1, dtype=np.int16)
    tp_all = np.zeros((num_layers, v), dtype=np.float32)
    per_layer = []
    for l in range(num_layers):
        cp = profile.confidence(l)
        res = milp_coclustering(cp, a, num_devices, config.theta, config.expert_balance, config.balance_slack)
        e2d[l] = res.expert2device
        seen = res.token2device >= 0
        t_all[l, seen] = res.token2device[seen]
        rows = np.repeat(np.arange(v), np.diff(cp.indptr))
        local = cp.data * (res.expert2device[cp.indices] == res.token2device[rows])
        tp_all[l] = np.bincount(rows, weights=local, minlength=v)
        per_layer.append({"objective": res.objective, "optimal": res.optimal, "mip_gap": res.mip_gap})
    copy_to_extended_tokens(profile, t_all, tp_all)
    seq, seq_conf = sequence_tables(profile.routes, e2d, num_devices, config.lookback)
    meta = {"seed": seed, "config": asdict(config), "milp": per_layer, "solve_seconds": time.perf_counter() - t0}
    return Tables("milp", num_devices, e2d, t_all, tp_all, seq, seq_conf, config.lookback, meta)
