"""Cluster cost: totals add up, hand-computed breakdowns, switch/link counting, the adjustment factor."""


import pytest

from netsim.collectives import GB, Network
from netsim.cost import (
    HOURS_PER_MONTH,
    CostConfig,
    _direct_links,
    cluster_cost,
    fat_tree_levels,
    normalized_cost_per_xpu,
    reference_cost_per_xpu,
)

CFG = CostConfig()


@pytest.mark.parametrize("topo,n,bw", [("scale-up", 64, 450), ("scale-up", 256, 150), ("scale-out", 256, 50),
                                       ("torus3d", 256, 450), ("fullmesh3d", 64, 300)])  # fmt: skip
def test_totals_add_up(topo, n, bw):
    b = cluster_cost(Network(topo, n, bw * GB), CFG)
    parts = b.xpu_capex + b.switch_capex + b.copper_capex + b.optical_capex + b.nic_capex + b.node_switch_capex
    assert b.total_capex == pytest.approx(parts, rel=1e-12)
    assert b.capex_per_month == pytest.approx(b.total_capex / 36, rel=1e-12)
    power_kw = (b.xpu_power_w + b.network_power_w) / 1000
    assert b.opex_per_month == pytest.approx(power_kw * HOURS_PER_MONTH * CFG.pue * CFG.electricity_per_kwh, rel=1e-12)
    assert b.total_per_month == pytest.approx(b.capex_per_month + b.opex_per_month, rel=1e-12)
    assert normalized_cost_per_xpu(Network(topo, n, bw * GB), CFG) == pytest.approx(
        b.total_per_month / n / reference_cost_per_xpu(CFG), rel=1e-12)


def test_scale_up_64_by_hand():
    b = cluster_cost(Network("scale-up", 64, 450 * GB), CFG)
    port = 450 / 16  # GB/s per NVLink port
    assert b.num_switches == 16  # one radix-64 switch per port plane
    assert b.switch_capex == pytest.approx(16 * 64 * port * 11.25)
    assert b.copper_capex == pytest.approx(64 * 16 * port * 3.0) and b.optical_capex == 0
    assert b.network_power_w == pytest.approx(16 * 64 * port * 0.45)


def test_two_level_fat_tree_and_optics():
    assert [fat_tree_levels(n, 64) for n in (8, 64, 65, 2048, 2049)] == [1, 1, 2, 2, 3]
    b = cluster_cost(Network("scale-up", 256, 450 * GB), CFG)
    port = 450 / 16
    assert b.num_switches == pytest.approx(16 * 3 * 256 / 64)  # per plane: 8 leaves + 4 spines
    assert b.copper_capex == pytest.approx(256 * 16 * port * 3.0)  # XPU -> leaf, in rack
    assert b.optical_capex == pytest.approx(256 * 16 * port * 3.0 * 6.7)  # leaf -> spine, across racks
    so = cluster_cost(Network("scale-out", 64, 50 * GB), CFG)
    assert so.num_switches == 1 and so.nic_capex == pytest.approx(64 * 50 * 40.0)
    assert so.node_switch_capex == pytest.approx(64 * 450 * 2.5)


def test_direct_link_counts():
    t64 = Network("torus3d", 64, 450 * GB)
    assert _direct_links(t64, 64) == (192, 0)  # 3 links per XPU, one rack
    t256 = Network("torus3d", 256, 450 * GB)  # 8x8x4, racks are 8x8 planes: every z link leaves its rack
    assert _direct_links(t256, 64) == (512, 256)
    m64 = Network("fullmesh3d", 64, 450 * GB)
    assert _direct_links(m64, 64) == (64 * 9 // 2, 0)
    m256 = Network("fullmesh3d", 256, 450 * GB)  # z rows of 4 XPUs in 4 racks: 6 pairs per row, 64 rows
    assert _direct_links(m256, 64) == (256 * 14 // 2, 64 * 6)
    b = cluster_cost(m256, CFG)
    lb = 450 / 17
    assert b.copper_capex == pytest.approx(256 * 14 / 2 * lb * 3.0)
    assert b.optical_capex == pytest.approx(384 * lb * 3.0 * 6.7)
    assert b.switch_capex == 0 and b.num_switches == 0


def test_network_cost_factor_and_monotonicity():
    net = Network("scale-up", 64, 450 * GB)
    a = cluster_cost(net, CFG)
    b = cluster_cost(net, CostConfig(network_cost_factor=2.0))
    assert b.xpu_capex == a.xpu_capex and b.network_capex == pytest.approx(2 * a.network_capex)
    assert b.opex_per_month == a.opex_per_month
    for topo in ("scale-up", "torus3d", "fullmesh3d", "scale-out"):
        costs = [normalized_cost_per_xpu(Network(topo, 64, bw * GB), CFG) for bw in (25, 50, 150, 450, 900)]
        assert costs == sorted(costs) and costs[0] > 1
    # at equal bandwidth the switchless networks are cheaper than scale-up
    assert normalized_cost_per_xpu(Network("fullmesh3d", 64, 450 * GB)) < normalized_cost_per_xpu(net)
    with pytest.raises(ValueError, match="pue"):
        CostConfig(pue=-1)
