"""Alpha-beta collective models per topology, with the paper's three adaptations (§3.2.2).

One collective call by every rank of a group of ``p`` ranks on a message of ``M`` bytes costs

    T(M) = alpha0 + R * alpha_round + D * alpha_dest + W(M) / eta

* ``alpha0``       one-time latency of the call (launch and synchronisation), paid once
* ``alpha_round``  latency per communication round; ``R`` rounds, each waiting on the previous one
* ``alpha_dest``   per-destination serialisation cost; ``D`` messages a rank sends, summed over
                   rounds (this is why a P2P all-to-all slows down as ``p`` grows)
* ``W(M)``         wire time at the nominal link rate: bytes on the most loaded link (one
                   direction) divided by that link's bandwidth, summed over sequential phases
* ``eta``          link utilisation: the fraction of nominal bandwidth a collective achieves

Message-size convention (the same as nccl-tests' ``size`` column and ``scripts/bench_ep.py``'s CSV):
``all_reduce``: ``M`` = bytes of the vector every rank holds. ``all_to_all``: ``M`` = bytes of each
rank's input, including the ``M/p`` block it keeps (``all_to_all_single``'s input size).

Every algorithm is affine in ``M`` (``T = a + c M``), so choosing the fastest per size is a minimum
over lines. The one exception is the two-tier scale-out P2P all-to-all, the maximum of two lines:
intra-node (NVLink) and inter-node (NIC) traffic run concurrently.

Topologies (paper Fig. 2): scale-up = one non-blocking switched domain (NVLink-like); scale-out =
nodes of ``gpus_per_node`` XPUs on an intra-node switch plus one NIC per XPU into a non-blocking
switch; 3D torus = six links per XPU with wrap-around; 3D full-mesh = a direct link to every XPU
sharing a row in each of the three dimensions. On torus and full-mesh the per-XPU bandwidth is split
evenly over the links (450 GB/s / 6 = 75 GB/s per torus link). Multi-hop traffic uses
dimension-order routing with cut-through (no per-hop latency term, as the paper assumes).

A group smaller than the network occupies a sub-block (:func:`group_dims`): dimensions it spans
fully keep their wrap-around links, partially spanned torus dimensions become lines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Optional, Sequence

import numpy as np

__all__ = [
    "Topology",
    "Collective",
    "AlphaBeta",
    "DGX_H100_INTRA",
    "DGX_H100_INTER",
    "Network",
    "Algorithm",
    "default_dims",
    "group_dims",
    "algorithms",
    "collective_time",
    "best_algorithm",
    "GB",
]

GB = 1e9  # bandwidths are bytes/s; the CLI and docs speak GB/s (1e9 bytes/s)


class Topology(str, Enum):
    SCALE_UP = "scale-up"
    """One non-blocking switched domain over all XPUs (NVLink-like fat tree)."""
    SCALE_OUT = "scale-out"
    """Nodes of ``gpus_per_node`` XPUs on an intra-node switch; one NIC per XPU into a switch."""
    TORUS_3D = "torus3d"
    """3D torus, 6 links per XPU, wrap-around in every dimension."""
    FULL_MESH_3D = "fullmesh3d"
    """3D full-mesh: a direct link to every XPU that shares a row in each dimension."""
    SWITCH = "switch"
    """A flat non-blocking switch with one constant set (for fitting: one network tier)."""


class Collective(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class AlphaBeta:
    """Fitted constants of one network tier (seconds; utilisation is a fraction)."""

    alpha0: float
    alpha_round: float
    alpha_dest: float
    utilization: float

    def __post_init__(self):
        for name in ("alpha0", "alpha_round", "alpha_dest"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if not 0 < self.utilization:
            raise ValueError(f"utilization must be > 0, got {self.utilization}")

    def as_dict(self) -> dict:
        return {"alpha0_s": self.alpha0, "alpha_round_s": self.alpha_round, "alpha_dest_s": self.alpha_dest,
                "utilization": self.utilization}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> "AlphaBeta":
        try:
            return cls(float(d["alpha0_s"]), float(d["alpha_round_s"]), float(d["alpha_dest_s"]),
                       float(d["utilization"]))  # fmt: skip
        except KeyError as e:
            raise ValueError(f"alpha-beta constants: missing key {e.args[0]!r}") from None


# Paper Table 1, fitted to NCCL on DGX H100. The table's symbol column did not survive the text
# extraction; the three latency rows are read, in order, as one-time latency, per-round latency and
# per-destination serialisation (the order in which §3.2.2 introduces them).
DGX_H100_INTRA = AlphaBeta(alpha0=5.874e-6, alpha_round=0.809e-6, alpha_dest=0.323e-6, utilization=0.717)
DGX_H100_INTER = AlphaBeta(alpha0=26.508e-6, alpha_round=1.358e-6, alpha_dest=0.340e-6, utilization=0.843)


def default_dims(num_xpus: int) -> tuple[int, int, int]:
    """Most cubic factorisation ``k1 >= k2 >= k3`` of ``num_xpus`` (64 -> 4x4x4, 256 -> 8x8x4)."""
    if num_xpus < 1:
        raise ValueError(f"num_xpus must be >= 1, got {num_xpus}")
    best = None
    for a in range(1, num_xpus + 1):
        if num_xpus % a:
            continue
        for b in range(1, a + 1):
            if (num_xpus // a) % b:
                continue
            c = num_xpus // (a * b)
            if c > b:
                continue
            key = (a - c, a)
            if best is None or key < best[0]:
                best = (key, (a, b, c))
    return best[1]


def group_dims(dims: Sequence[int], size: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Sub-block a group of ``size`` ranks occupies in a ``dims`` grid, filled dimension by dimension.

    Returns ``(t, spans)``: ``t[i]`` ranks along dimension ``i`` and whether the group spans that
    dimension fully (only then does a torus group keep its wrap-around link in it).
    """
    rem, t = size, []
    for k in dims:
        ti = math.gcd(k, rem)
        t.append(ti)
        rem //= ti
    if rem != 1:
        raise ValueError(f"a group of {size} ranks does not tile a {'x'.join(map(str, dims))} network")
    return tuple(t), tuple(ti == k for ti, k in zip(t, dims))


@dataclass(frozen=True)
class Network:
    """A cluster network. ``bandwidth`` is per XPU, one direction, bytes/s (scale-out: the NIC).

    ``constants`` is the tier XPUs use for the primary network (scale-up, torus, full-mesh links; the
    intra-node switch of scale-out); ``inter_constants`` the NIC tier of scale-out.
    """

    topology: Topology
    num_xpus: int
    bandwidth: float
    dims: tuple[int, ...] = ()
    gpus_per_node: int = 8
    node_bandwidth: float = 450 * GB
    constants: AlphaBeta = DGX_H100_INTRA
    inter_constants: AlphaBeta = DGX_H100_INTER

    def __post_init__(self):
        topo = Topology(self.topology)
        object.__setattr__(self, "topology", topo)
        if self.num_xpus < 1:
            raise ValueError(f"num_xpus must be >= 1, got {self.num_xpus}")
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if topo in (Topology.TORUS_3D, Topology.FULL_MESH_3D):
            dims = tuple(int(k) for k in self.dims) if self.dims else default_dims(self.num_xpus)
            if math.prod(dims) != self.num_xpus or min(dims) < 1:
                raise ValueError(f"dims {dims} do not multiply to num_xpus={self.num_xpus}")
            object.__setattr__(self, "dims", dims)
        elif self.dims:
            raise ValueError(f"dims only apply to torus3d / fullmesh3d, not {topo.value}")
        if topo == Topology.SCALE_OUT:
            if self.gpus_per_node < 1 or (self.num_xpus > self.gpus_per_node and self.num_xpus % self.gpus_per_node):
                raise ValueError(f"num_xpus={self.num_xpus} is not a multiple of gpus_per_node={self.gpus_per_node}")

    def with_bandwidth(self, bandwidth: float) -> "Network":
        return replace(self, bandwidth=bandwidth)

    @property
    def ports_per_xpu(self) -> int:
        """Direct links per XPU (torus, full-mesh); 0 for switched topologies."""
        if self.topology == Topology.TORUS_3D:
            return 2 * sum(1 for k in self.dims if k > 1)
        if self.topology == Topology.FULL_MESH_3D:
            return sum(k - 1 for k in self.dims)
        return 0

    @property
    def link_bandwidth(self) -> float:
        """Bandwidth of one direct link (torus, full-mesh), else the per-XPU bandwidth."""
        ports = self.ports_per_xpu
        return self.bandwidth / ports if ports else self.bandwidth


@dataclass(frozen=True)
class Algorithm:
    """One algorithm's cost on one group: ``T(M) = intercept + slope * M`` (or the max with
    ``concurrent``'s line, for two tiers that run at the same time)."""

    name: str
    rounds: float
    dests: float
    wire_per_byte: float  # s per byte of M at the nominal link rate
    constants: AlphaBeta = field(repr=False)
    concurrent: Optional["Algorithm"] = None

    @property
    def intercept(self) -> float:
        c = self.constants
        return c.alpha0 + self.rounds * c.alpha_round + self.dests * c.alpha_dest

    @property
    def slope(self) -> float:
        return self.wire_per_byte / self.constants.utilization

    def time(self, nbytes) -> np.ndarray:
        """Seconds for messages of ``nbytes`` (any shape)."""
        t = self.intercept + self.slope * np.asarray(nbytes, dtype=float)
        if self.concurrent is not None:
            t = np.maximum(t, self.concurrent.time(nbytes))
        return t


def _pow2(p: int) -> bool:
    return p >= 1 and p & (p - 1) == 0


def _switch(op: Collective, p: int, bw: float, c: AlphaBeta, prefix: str = "") -> list[Algorithm]:
    """Non-blocking switch, per-rank bandwidth ``bw``: the classic algorithm costs (Thakur, Gropp)."""
    algos = []
    if op == Collective.ALL_REDUCE:
        if _pow2(p):
            lg = int(math.log2(p))
            algos.append(Algorithm(prefix + "recursive_doubling", lg, lg, lg / bw, c))
            algos.append(Algorithm(prefix + "rabenseifner", 2 * lg, 2 * lg, 2 * (p - 1) / p / bw, c))
        algos.append(Algorithm(prefix + "p2p", 2, 2 * (p - 1), 2 * (p - 1) / p / bw, c))
        algos.append(Algorithm(prefix + "ring", 2 * (p - 1), 2 * (p - 1), 2 * (p - 1) / p / bw, c))
    else:
        # Bruck: round k sends every block whose index has bit k set (p/2 blocks when p is a power of 2)
        lg = max(1, math.ceil(math.log2(p)))
        blocks = sum(sum(1 for j in range(p) if j >> k & 1) for k in range(lg))
        algos.append(Algorithm(prefix + "bruck", lg, lg, blocks / p / bw, c))
        algos.append(Algorithm(prefix + "spread_out", p - 1, p - 1, (p - 1) / p / bw, c))
        algos.append(Algorithm(prefix + "p2p", 1, p - 1, (p - 1) / p / bw, c))
    return algos


def _ring_load(t: int, wrap: bool) -> float:
    """Most loaded directed link of a ``t``-node ring (``wrap``) or line when every node sends one
    unit to every other node over shortest paths (ties split both ways), in units sent."""
    if wrap:
        return sum(min(j, t - j) for j in range(1, t)) / 2
    return (t // 2) * ((t + 1) // 2)


def _swing_distances(t: int) -> list[int]:
    """Hop distance of Swing's peer at each of the ``log2 t`` steps in one ring dimension
    (peer offset rho_s = (1 - (-2)^(s+1)) / 3, taken the short way round)."""
    out = []
    for s in range(int(math.log2(t))):
        rho = abs((1 - (-2) ** (s + 1)) // 3) % t
        out.append(min(rho, t - rho))
    return out


def _torus(op: Collective, net: Network, p: int) -> list[Algorithm]:
    t, spans = group_dims(net.dims, p)
    b, c = net.link_bandwidth, net.constants
    act = [(ti, w) for ti, w in zip(t, spans) if ti > 1]
    # directed rings the sub-block supports: 2 per wrapped dimension, 1 per line (a ring on a line
    # must come back over the same links)
    ports = sum(2 if w else 1 for _, w in act)
    per_dim = [_ring_load(ti, w) / ti for ti, w in act]  # link load per byte of M, per dimension
    if op == Collective.ALL_TO_ALL:
        p2p = Algorithm("p2p", 1, p - 1, max(per_dim) / b, c)
        rounds = sum(ti // 2 if w else ti - 1 for ti, w in act)
        dests = sum((ti // 2 if w else ti - 1) * (2 if ti > 2 else 1) for ti, w in act)
        halfring = Algorithm("halfring", rounds, dests, sum(per_dim) / b, c)
        return [p2p, halfring]
    algos = [
        Algorithm("ring", 2 * (p - 1), 2 * (p - 1) * ports, 2 * (p - 1) / p / (ports * b), c),
        Algorithm("p2p", 2, 2 * (p - 1), 2 * max(per_dim) / b, c),
    ]
    if all(w and _pow2(ti) for ti, w in act):
        # Swing with one sub-collective per directed port, each on M/ports; at step s the data halves
        # and each directed link carries delta_s flows (the peer is delta_s hops away), steps
        # round-robin over dimensions.
        seqs = [_swing_distances(ti) for ti, _ in act]
        deltas = []
        while any(seqs):
            for sq in seqs:
                if sq:
                    deltas.append(sq.pop(0))
        lg = len(deltas)
        wire = 2 * sum(d / 2 ** (s + 1) for s, d in enumerate(deltas)) / (ports * b)
        algos.append(Algorithm("swing", 2 * lg, 2 * lg * ports, wire, c))
    return algos


def _full_mesh(op: Collective, net: Network, p: int) -> list[Algorithm]:
    t, _ = group_dims(net.dims, p)
    b, c = net.link_bandwidth, net.constants
    act = [ti for ti in t if ti > 1]
    if op == Collective.ALL_TO_ALL:
        # one-shot: every block goes straight to its destination, routed dimension by dimension
        # through intermediate XPUs; a dimension-i link carries M / t_i
        one_shot = Algorithm("one_shot", 1, p - 1, max(1 / ti for ti in act) / b, c)
        # DoR: store-and-forward, one dimension at a time, each phase a direct exchange in that dim
        dor = Algorithm("dor", len(act), sum(ti - 1 for ti in act), sum(1 / ti for ti in act) / b, c)
        return [one_shot, dor]
    ports = sum(ti - 1 for ti in act)  # directed Hamiltonian rings = out-degree (Tillson)
    return [
        Algorithm("ring", 2 * (p - 1), 2 * (p - 1) * ports, 2 * (p - 1) / p / (ports * b), c),
        Algorithm("p2p", 2, 2 * (p - 1), 2 * max(1 / ti for ti in act) / b, c),
    ]


def algorithms(network: Network, op: Collective | str, group_size: int) -> tuple[Algorithm, ...]:
    """The paper's Table 2 algorithms for ``op`` on a group of ``group_size`` ranks of ``network``.

    An empty tuple for a group of one (no communication).
    """
    op = Collective(op)
    p = int(group_size)
    if p < 1 or p > network.num_xpus:
        raise ValueError(f"group size {p} is not between 1 and num_xpus={network.num_xpus}")
    if p == 1:
        return ()
    topo = network.topology
    if topo in (Topology.SCALE_UP, Topology.SWITCH):
        return tuple(_switch(op, p, network.bandwidth, network.constants))
    if topo == Topology.SCALE_OUT:
        g = network.gpus_per_node
        if p <= g:
            return tuple(_switch(op, p, network.node_bandwidth, network.constants, "intra_"))
        if p % g:
            raise ValueError(f"a scale-out group of {p} ranks is not a whole number of {g}-XPU nodes")
        inter = _switch(op, p, network.bandwidth, network.inter_constants)
        if op == Collective.ALL_TO_ALL:
            # every round of Bruck / spread-out has a rank whose partner is on another node, so the
            # NIC bounds it; P2P sends the intra-node share over NVLink while the rest crosses NICs
            nic = Algorithm("p2p", 1, p - g, (p - g) / p / network.bandwidth, network.inter_constants)
            nvl = Algorithm("p2p_intra", 1, g - 1, (g - 1) / p / network.node_bandwidth, network.constants)
            inter = [a for a in inter if a.name != "p2p"] + [replace(nic, concurrent=nvl)]
        return tuple(inter)
    if topo == Topology.TORUS_3D:
        return tuple(_torus(op, network, p))
    return tuple(_full_mesh(op, network, p))


def best_algorithm(network: Network, op: Collective | str, group_size: int, nbytes) -> tuple[np.ndarray, np.ndarray]:
    """``(seconds, algorithm names)`` of the fastest algorithm per message size (any shape)."""
    nbytes = np.asarray(nbytes, dtype=float)
    algos = algorithms(network, op, group_size)
    if not algos:
        return np.zeros_like(nbytes), np.full(nbytes.shape, "none", dtype=object)
    times = np.stack([a.time(nbytes) for a in algos])
    idx = np.argmin(times, axis=0)
    names = np.array([a.name for a in algos], dtype=object)[idx]
    return np.take_along_axis(times, idx[None], axis=0)[0], names


def collective_time(
    network: Network, op: Collective | str, group_size: int, nbytes, algorithm: str | None = None
) -> np.ndarray:
    """Seconds for one collective of ``nbytes`` (any shape): the named algorithm or the fastest."""
    if algorithm is None:
        return best_algorithm(network, op, group_size, nbytes)[0]
    algos = {a.name: a for a in algorithms(network, op, group_size)}
    if not algos:
        return np.zeros_like(np.asarray(nbytes, dtype=float))
    if algorithm not in algos:
        raise ValueError(f"algorithm {algorithm!r} is not available for {Collective(op).value} on "
                         f"{network.topology.value} with {group_size} ranks (have: {', '.join(algos)})")  # fmt: skip
    return algos[algorithm].time(nbytes)
