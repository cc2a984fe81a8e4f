"""Cluster cost (paper §3.4): CapEx amortised over the lifetime plus electricity OpEx, per month.

* XPUs: a price per XPU (the GPU and its share of the host server, no network parts) and its power.
* Switches: price linear in capacity (radix x port bandwidth), as one ASIC is sold at several
  radix/bandwidth points; power linear in capacity too. Switched networks are built as ``ports``
  parallel planes (16 NVLink ports per XPU for scale-up, 1 NIC port for scale-out), each plane a
  non-blocking fat tree of radix-``switch_radix`` switches: one level while the plane's endpoints
  fit one switch, else leaves + spines (``2L - 1`` switch layers' worth for ``L`` levels).
* Links: price per GB/s (one direction, both directions bought together) by type; copper inside a
  rack of ``xpus_per_rack`` XPUs, active optical cables (``aoc_price_ratio`` x copper) between racks.
  Fat-tree uplinks above the leaves are optical once the cluster spans racks.
* Scale-out also pays a NIC per XPU (per GB/s) and the intra-node NVLink switch on the baseboard.
* Torus and full-mesh are switchless; a link is inter-rack when its two XPUs are in different racks
  (XPUs are numbered with the first dimension fastest and racked in consecutive blocks).
* OpEx: power x PUE x electricity price. ``network_cost_factor`` (the paper's adjustment factor)
  scales all network CapEx (switches, links, NICs).

Prices are public list/street prices of 2024 where we found them (sources in docs/design/netsim.md) and
our assumptions otherwise; results are reported normalised (:func:`normalized_cost_per_xpu`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .collectives import GB, Network, Topology

__all__ = ["CostConfig", "CostBreakdown", "cluster_cost", "normalized_cost_per_xpu", "fat_tree_levels"]

HOURS_PER_MONTH = 730.0


@dataclass(frozen=True)
class CostConfig:
    xpu_price: float = 34_000.0  # $: H100 SXM + host share (8-GPU node ~$310k incl. NICs, less network)
    xpu_power_w: float = 1_100.0  # GPU TDP 700 W + host share (DGX H100 peaks at 10.2 kW / 8 GPUs)
    switch_price_per_gbps: float = 11.25  # $ per GB/s of port capacity: 64 x 400G switch ~ $36k
    switch_fixed_price: float = 0.0
    switch_power_w_per_gbps: float = 0.45  # 64 x 400G switch ~ 1.4 kW
    switch_radix: int = 64
    scale_up_ports_per_xpu: int = 16
    scale_out_ports_per_xpu: int = 1
    copper_price_per_gbps: float = 3.0  # $ per GB/s: ~$150 per 400G (50 GB/s) DAC
    aoc_price_ratio: float = 6.7  # paper §3.4
    aoc_power_w_per_gbps: float = 0.2  # ~10 W per 400G AOC
    nic_price_per_gbps: float = 40.0  # ~$2,000 per 400G NIC
    nic_power_w: float = 25.0
    node_switch_price_per_gbps: float = 2.5  # baseboard NVSwitch chips (scale-out nodes)
    xpus_per_rack: int = 64
    lifetime_years: float = 3.0
    electricity_per_kwh: float = 0.08  # $ (US industrial average)
    pue: float = 1.3
    network_cost_factor: float = 1.0  # paper's adjustment factor on network CapEx

    def __post_init__(self):
        for k, v in asdict(self).items():
            if v < 0:
                raise ValueError(f"cost parameter {k} must be >= 0, got {v}")
        if self.switch_radix < 2 or self.xpus_per_rack < 1 or self.lifetime_years <= 0:
            raise ValueError("switch_radix >= 2, xpus_per_rack >= 1 and lifetime_years > 0 are required")


@dataclass(frozen=True)
class CostBreakdown:
    """Whole-cluster numbers: CapEx in $, power in W, monthly totals in $/month."""

    num_xpus: int
    num_switches: float
    xpu_capex: float
    switch_capex: float
    copper_capex: float
    optical_capex: float
    nic_capex: float
    node_switch_capex: float
    xpu_power_w: float
    network_power_w: float
    capex_per_month: float
    opex_per_month: float

    @property
    def network_capex(self) -> float:
        return self.switch_capex + self.copper_capex + self.optical_capex + self.nic_capex + self.node_switch_capex

    @property
    def total_capex(self) -> float:
        return self.xpu_capex + self.network_capex

    @property
    def total_per_month(self) -> float:
        return self.capex_per_month + self.opex_per_month

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(network_capex=self.network_capex, total_capex=self.total_capex, total_per_month=self.total_per_month)
        return d


def fat_tree_levels(endpoints: int, radix: int) -> int:
    """Levels of a non-blocking fat tree of radix-``radix`` switches for ``endpoints`` ports
    (``L`` levels serve up to ``2 (radix/2)^L`` endpoints: 64, 2048, 65536 for radix 64)."""
    levels = 1
    while endpoints > 2 * (radix / 2) ** levels:
        levels += 1
    return levels


def _plane(endpoints: int, radix: int) -> tuple[float, int, int]:
    """(switches, switch ports, links above the leaves) of one non-blocking fat-tree plane.
    One level: a single switch with as many ports as endpoints (price is linear in radix)."""
    levels = fat_tree_levels(endpoints, radix)
    if levels == 1:
        return 1.0, endpoints, 0
    switches = (2 * levels - 1) * endpoints / radix
    return switches, int(round(switches * radix)), (levels - 1) * endpoints


def _direct_links(net: Network, per_rack: int) -> tuple[int, int]:
    """(intra-rack, inter-rack) direct links of a torus / full-mesh, each counted once.

    Torus: every XPU owns the link to its +1 neighbour in each dimension (with wrap-around; in a
    dimension of 2 that makes two parallel links per pair, as the +1 and -1 ports meet the same
    XPU). Full-mesh: one link per pair of XPUs sharing a row.
    """
    dims = net.dims
    n = net.num_xpus
    coords = np.stack(np.unravel_index(np.arange(n), dims, order="F"), axis=1)  # first dim fastest
    strides = np.cumprod((1,) + tuple(dims[:-1]))
    rack = np.arange(n) // per_rack
    intra = inter = 0
    for d, k in enumerate(dims):
        offsets = [1] if net.topology == Topology.TORUS_3D else range(1, k)
        for off in offsets if k > 1 else ():
            nb = coords.copy()
            nb[:, d] = (nb[:, d] + off) % k
            j = nb @ strides
            keep = np.ones(n, bool) if net.topology == Topology.TORUS_3D else coords[:, d] < nb[:, d]
            same = (rack == rack[j])[keep]
            intra += int(same.sum())
            inter += int((~same).sum())
    return intra, inter


def cluster_cost(net: Network, cfg: CostConfig = CostConfig()) -> CostBreakdown:
    """Cost of ``net`` (its topology, size and per-XPU bandwidth)."""
    n = net.num_xpus
    copper = cfg.copper_price_per_gbps
    aoc = copper * cfg.aoc_price_ratio
    multi_rack = n > cfg.xpus_per_rack
    sw_price = lambda ports, bw, count: count * cfg.switch_fixed_price + ports * bw / GB * cfg.switch_price_per_gbps  # noqa: E731
    switches = sw_capex = copper_capex = optical_capex = nic_capex = node_sw = 0.0
    net_power = 0.0
    if net.topology in (Topology.SCALE_UP, Topology.SWITCH, Topology.SCALE_OUT):
        planes = cfg.scale_out_ports_per_xpu if net.topology == Topology.SCALE_OUT else cfg.scale_up_ports_per_xpu
        port_bw = net.bandwidth / planes
        s, ports, uplinks = _plane(n, cfg.switch_radix)
        switches = s * planes
        sw_capex = sw_price(ports * planes, port_bw, switches)
        net_power += ports * planes * port_bw / GB * cfg.switch_power_w_per_gbps
        down = n * planes * port_bw / GB  # XPU/NIC -> leaf, in rack
        up = uplinks * planes * port_bw / GB
        copper_capex = down * copper + (0.0 if multi_rack else up * copper)
        optical_capex = up * aoc if multi_rack else 0.0
        net_power += up * cfg.aoc_power_w_per_gbps if multi_rack else 0.0
        if net.topology == Topology.SCALE_OUT:
            nic_capex = n * cfg.scale_out_ports_per_xpu * port_bw / GB * cfg.nic_price_per_gbps
            net_power += n * cfg.scale_out_ports_per_xpu * cfg.nic_power_w
            node_sw = n * net.node_bandwidth / GB * cfg.node_switch_price_per_gbps
    else:
        intra, inter = _direct_links(net, cfg.xpus_per_rack)
        lb = net.link_bandwidth / GB
        copper_capex = intra * lb * copper
        optical_capex = inter * lb * aoc
        net_power += inter * lb * cfg.aoc_power_w_per_gbps
    f = cfg.network_cost_factor
    sw_capex, copper_capex, optical_capex, nic_capex, node_sw = (x * f for x in (sw_capex, copper_capex, optical_capex, nic_capex, node_sw))
    xpu_capex = n * cfg.xpu_price
    xpu_power = n * cfg.xpu_power_w
    capex = xpu_capex + sw_capex + copper_capex + optical_capex + nic_capex + node_sw
    opex = (xpu_power + net_power) / 1000 * HOURS_PER_MONTH * cfg.pue * cfg.electricity_per_kwh
    return CostBreakdown(
        num_xpus=n, num_switches=switches, xpu_capex=xpu_capex, switch_capex=sw_capex, copper_capex=copper_capex,
        optical_capex=optical_capex, nic_capex=nic_capex, node_switch_capex=node_sw, xpu_power_w=xpu_power,
        network_power_w=net_power, capex_per_month=capex / (cfg.lifetime_years * 12), opex_per_month=opex,
    )  # fmt: skip


def reference_cost_per_xpu(cfg: CostConfig = CostConfig()) -> float:
    """Monthly cost of one bare XPU (no network): the unit costs are normalised by."""
    return cfg.xpu_price / (cfg.lifetime_years * 12) + cfg.xpu_power_w / 1000 * HOURS_PER_MONTH * cfg.pue * cfg.electricity_per_kwh


def normalized_cost_per_xpu(net: Network, cfg: CostConfig = CostConfig()) -> float:
    """Monthly cost per XPU of ``net`` in units of one bare XPU's monthly cost."""
    return cluster_cost(net, cfg).total_per_month / net.num_xpus / reference_cost_per_xpu(cfg)
