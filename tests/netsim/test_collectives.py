"""Alpha-beta collective formulas (hand-computed cases, exact to float rounding), the link loads behind
them (checked against explicit dimension-order routing), and fastest-algorithm selection."""

import itertools
import math

import numpy as np
import pytest

from netsim.collectives import (
    DGX_H100_INTER,
    DGX_H100_INTRA,
    GB,
    AlphaBeta,
    Collective,
    Network,
    _ring_load,
    algorithms,
    best_algorithm,
    collective_time,
    default_dims,
    group_dims,
)

A0, AR, AD, ETA = 5.874e-6, 0.809e-6, 0.323e-6, 0.717
B = 450 * GB


def _algo(net, op, p, name):
    return {a.name: a for a in algorithms(net, op, p)}[name]


def test_table1_constants():
    assert DGX_H100_INTRA == AlphaBeta(5.874e-6, 0.809e-6, 0.323e-6, 0.717)
    assert DGX_H100_INTER == AlphaBeta(26.508e-6, 1.358e-6, 0.340e-6, 0.843)


def test_scale_up_hand_computed():
    net = Network("scale-up", 64, B)
    m = 1e6
    # P2P all-to-all: one round, 63 destinations, 63/64 of M on the wire
    want = A0 + AR + 63 * AD + (63 / 64) * m / (ETA * B)
    assert float(collective_time(net, "all_to_all", 64, m, "p2p")) == pytest.approx(want, rel=1e-12)
    # Bruck: log2(64) = 6 rounds, each moving half the blocks
    want = A0 + 6 * (AR + AD) + 6 * (m / 2) / (ETA * B)
    assert float(collective_time(net, "all_to_all", 64, m, "bruck")) == pytest.approx(want, rel=1e-12)
    # spread-out: 63 rounds of one destination
    want = A0 + 63 * (AR + AD) + (63 / 64) * m / (ETA * B)
    assert float(collective_time(net, "all_to_all", 64, m, "spread_out")) == pytest.approx(want, rel=1e-12)
    # all-reduce on 8 ranks, 8 MB
    m = 8e6
    cases = {
        "ring": A0 + 14 * (AR + AD) + 2 * 7 / 8 * m / (ETA * B),
        "recursive_doubling": A0 + 3 * (AR + AD) + 3 * m / (ETA * B),
        "rabenseifner": A0 + 6 * (AR + AD) + 2 * 7 / 8 * m / (ETA * B),
        "p2p": A0 + 2 * AR + 14 * AD + 2 * 7 / 8 * m / (ETA * B),
    }
    for name, want in cases.items():
        assert float(collective_time(net, "all_reduce", 8, m, name)) == pytest.approx(want, rel=1e-12), name


def test_bruck_non_power_of_two_counts_blocks():
    a = _algo(Network("scale-up", 8, B), "all_to_all", 6, "bruck")
    # p = 6: 3 rounds; blocks with bit k set among 0..5: bit0 {1,3,5}, bit1 {2,3}, bit2 {4,5} -> 7 blocks
    assert (a.rounds, a.dests) == (3, 3)
    assert a.wire_per_byte == pytest.approx(7 / 6 / B)


def test_torus_and_full_mesh_hand_computed():
    m = 1e6
    torus = Network("torus3d", 64, B)  # 4x4x4, 6 links of 75 GB/s
    assert torus.dims == (4, 4, 4) and torus.link_bandwidth == pytest.approx(75 * GB)
    p2p = _algo(torus, "all_to_all", 64, "p2p")
    assert p2p.wire_per_byte * B == pytest.approx(3.0)  # M/2 per link over B/6
    hr = _algo(torus, "all_to_all", 64, "halfring")
    assert (hr.rounds, hr.dests) == (6, 12) and hr.wire_per_byte * B == pytest.approx(9.0)
    assert float(hr.time(m)) == pytest.approx(A0 + 6 * AR + 12 * AD + 9 * m / (ETA * B), rel=1e-12)

    mesh = Network("fullmesh3d", 64, B)  # 9 links of 50 GB/s
    assert mesh.ports_per_xpu == 9 and mesh.link_bandwidth == pytest.approx(50 * GB)
    one = _algo(mesh, "all_to_all", 64, "one_shot")
    assert (one.rounds, one.dests) == (1, 63) and one.wire_per_byte * B == pytest.approx(2.25)
    dor = _algo(mesh, "all_to_all", 64, "dor")
    assert (dor.rounds, dor.dests) == (3, 9) and dor.wire_per_byte * B == pytest.approx(6.75)

    big = Network("fullmesh3d", 256, B)  # 8x8x4, 17 links
    assert big.dims == (8, 8, 4) and big.ports_per_xpu == 17
    assert _algo(big, "all_to_all", 256, "one_shot").wire_per_byte * B == pytest.approx(17 / 4)

    # Swing all-reduce on an 8-ring (a TP group along the first dimension of 8x8x4): peer
    # distances 1, 1, 3; two directed ports; data halves each step
    sw = _algo(Network("torus3d", 256, B), "all_reduce", 8, "swing")
    b = B / 6
    assert sw.wire_per_byte == pytest.approx(2 * (1 / 2 + 1 / 4 + 3 / 8) / (2 * b))
    assert (sw.rounds, sw.dests) == (6, 12)


def test_scale_out_two_tiers():
    net = Network("scale-out", 64, 50 * GB)
    m = 4e6
    p2p = _algo(net, "all_to_all", 16, "p2p")
    nic = DGX_H100_INTER.alpha0 + DGX_H100_INTER.alpha_round + 8 * DGX_H100_INTER.alpha_dest + 8 / 16 * m / (0.843 * 50 * GB)
    nvl = A0 + AR + 7 * AD + 7 / 16 * m / (ETA * B)
    assert float(p2p.time(m)) == pytest.approx(max(nic, nvl), rel=1e-12)
    # a group inside one node only uses NVLink and the intra constants
    assert {a.name for a in algorithms(net, "all_reduce", 8)} == {"intra_ring", "intra_p2p", "intra_recursive_doubling",
                                                                  "intra_rabenseifner"}  # fmt: skip
    with pytest.raises(ValueError, match="whole number"):
        algorithms(net, "all_to_all", 12)


def test_ring_load_and_dims():
    assert _ring_load(4, True) == 2 and _ring_load(5, True) == 3 and _ring_load(2, True) == 0.5
    assert _ring_load(4, False) == 4 and _ring_load(2, False) == 1 and _ring_load(3, False) == 2
    assert default_dims(64) == (4, 4, 4) and default_dims(256) == (8, 8, 4) and default_dims(8) == (2, 2, 2)
    assert group_dims((4, 4, 4), 8) == ((4, 2, 1), (True, False, False))
    assert group_dims((8, 8, 4), 256) == ((8, 8, 4), (True, True, True))
    with pytest.raises(ValueError, match="does not tile"):
        group_dims((4, 4, 4), 3)
    with pytest.raises(ValueError, match="multiply"):
        Network("torus3d", 64, B, dims=(4, 4, 2))


def _dor_max_load(dims, spans, full_mesh):
    """Most loaded directed link when every node sends one unit to every other node of the block,
    routed dimension by dimension (torus: shortest way, ties split; line: direct; mesh: one hop)."""
    load = {}
    nodes = list(itertools.product(*(range(t) for t in dims)))
    for s in nodes:
        for d in nodes:
            if s == d:
                continue
            paths = [(list(s), 1.0)]
            for i, t in enumerate(dims):
                new = []
                for cur, w in paths:
                    if cur[i] == d[i]:
                        new.append((cur, w))
                        continue
                    if full_mesh:
                        nxt = cur.copy()
                        nxt[i] = d[i]
                        key = (tuple(cur), tuple(nxt))
                        load[key] = load.get(key, 0) + w
                        new.append((nxt, w))
                        continue
                    fwd = (d[i] - cur[i]) % t
                    if spans[i]:
                        dirs = [(+1, fwd)] if fwd < t - fwd else [(-1, t - fwd)] if fwd > t - fwd else [(+1, fwd), (-1, fwd)]
                    else:
                        dirs = [(1 if d[i] > cur[i] else -1, abs(d[i] - cur[i]))]
                    for sign, hops in dirs:
                        ww = w / len(dirs)
                        c = cur.copy()
                        for _ in range(hops):
                            n = c.copy()
                            n[i] = (c[i] + sign) % t
                            key = (tuple(c), tuple(n))
                            load[key] = load.get(key, 0) + ww
                            c = n
                        new.append((c, ww))
                paths = new
    return max(load.values())


@pytest.mark.parametrize("topo,dims,group", [
    ("torus3d", (4, 4, 4), 64), ("torus3d", (4, 4, 4), 8), ("torus3d", (4, 4, 2), 32), ("torus3d", (8, 4, 2), 16),
    ("fullmesh3d", (4, 4, 4), 64), ("fullmesh3d", (4, 4, 2), 32), ("fullmesh3d", (8, 4, 2), 16),
])  # fmt: skip
def test_p2p_wire_matches_routed_link_load(topo, dims, group):
    """The P2P / one-shot all-to-all wire term equals the most loaded link of an explicit routing."""
    net = Network(topo, math.prod(dims), B, dims=dims)
    t, spans = group_dims(dims, group)
    m = 1.0  # bytes each rank sends to each other rank; M = group * m
    name = "p2p" if topo == "torus3d" else "one_shot"
    a = _algo(net, "all_to_all", group, name)
    want = _dor_max_load(t, spans, topo == "fullmesh3d") * m / net.link_bandwidth
    assert a.wire_per_byte * group * m == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("topo", ["scale-up", "scale-out", "torus3d", "fullmesh3d"])
@pytest.mark.parametrize("op", ["all_to_all", "all_reduce"])
def test_selection_picks_the_minimum(topo, op):
    rng = np.random.default_rng(0)
    sizes = 10 ** rng.uniform(1, 10, size=200)
    for n in (64, 256):
        net = Network(topo, n, (50 if topo == "scale-out" else 450) * GB)
        for p in (2, 8, 16, n):
            if topo == "scale-out" and p > 8 and p % 8:
                continue
            algos = algorithms(net, op, p)
            t, names = best_algorithm(net, op, p, sizes)
            every = np.stack([a.time(sizes) for a in algos])
            np.testing.assert_allclose(t, every.min(axis=0), rtol=0)
            by_name = {a.name: a for a in algos}
            np.testing.assert_allclose([float(by_name[nm].time(s)) for nm, s in zip(names, sizes)], t, rtol=0)


def test_selection_crossover_and_trivial_group():
    net = Network("scale-up", 64, B)
    _, names = best_algorithm(net, "all_to_all", 64, [1e3, 1e8])
    assert list(names) == ["bruck", "p2p"]  # latency-optimal small, bandwidth-optimal large
    assert collective_time(net, "all_to_all", 1, 1e6) == 0
    with pytest.raises(ValueError, match="not available"):
        collective_time(net, Collective.ALL_TO_ALL, 64, 1e6, "swing")
