"""The design-space sweep behind the paper's §4 figures, and the analyses we report.

For every topology x cluster size x per-XPU bandwidth, every (tp, ep) layout and batch size is
evaluated once per variant (:func:`netsim.serving.evaluate_cases`); each serving scenario (TPOT SLO x
context length) and optimisation level then picks the best layout and batch. Throughput per cost
divides tokens/s per XPU by the normalised monthly cost per XPU (:mod:`netsim.cost`).

Analyses (all computed from the records, nothing hard-coded):
* ``bandwidth``: scale-up throughput/cost vs link bandwidth (Fig. 12), the sweet spot and its gain
  over the 1x (450 GB/s) provision, also under other network-cost factors (Fig. 13);
* ``topology``: the four topologies at the 1x provision on 64 XPUs (Fig. 14/15), switchless gain
  over scale-up; the same with each topology's best bandwidth and size (Fig. 17);
* ``pareto``: the performance-cost plane per scenario and its Pareto frontier (Fig. 17);
* ``variants``: BigMac / Sem-MoE / FarSkip / combined gains in throughput per cost per topology.
"""

from __future__ import annotations

import time
from enum import Enum
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import numpy as np

from .collectives import DGX_H100_INTER, DGX_H100_INTRA, GB, AlphaBeta, Network, Topology
from .compute import ProfileTable, default_table, generation_spec, project_table
from .cost import CostConfig, normalized_cost_per_xpu
from .serving import (
    BASELINE,
    Optimization,
    ServingConfig,
    Technique,
    Variant,
    best_under_slo,
    cases_for,
    evaluate_cases,
)

__all__ = ["SweepConfig", "KnobSource", "KNOBS", "knob_values", "default_variants", "run_sweep", "pareto_front",
           "summary_table", "PROVISION_GBPS", "QUICK", "read_sweep", "decisions", "compare_decisions",
           "format_decisions"]

PROVISION_GBPS = {Topology.SCALE_UP: 450.0, Topology.TORUS_3D: 450.0, Topology.FULL_MESH_3D: 450.0,
                  Topology.SCALE_OUT: 50.0}  # fmt: skip
SWITCHLESS = (Topology.TORUS_3D, Topology.FULL_MESH_3D)


class KnobSource(str, Enum):
    """Where the variant knobs come from."""

    MEASURED = "measured"
    """This project's measurements: FarSkip's share of the all-to-all hidden while serving, decode
    steps nearly all, on the DeepSeek-V2-Lite shape at its 27 layers, EP = 2, at about the paper's
    all-to-all share (0.853; docs/results/farskip.md, "Decode at depth");
    Sem-MoE's attention-TP LAR (Algorithm 3) as a function of EP, from the solver on the
    DeepSeek-V2-Lite routing layout pretrained here (64 experts, top-6), solved on a mix of six
    prompt domains and predicted on their held-out 80% (docs/results/semmoe.md), applied by device count;
    BigMac's r = 0.25 (a design choice, not a measurement)."""
    PAPER = "paper"
    """The papers' figures: Sem-MoE's LAR 0.5, BigMac's r = 0.25, and FarSkip's 88.9%, the
    all-to-all overlap the FarSkip-Collective paper measured in *training* (DeepSeek-V3-shaped, 6
    layers, EP = 8; its headline figure). The paper reports no all-to-all overlap for serving (its
    vLLM figures are the all-reduce's in prefill), so this knob stands in for a decode-serving
    overlap it never measured: not like for like with ``MEASURED``'s 0.853."""


# docs/figures/semmoe_dsv2/eval_ep*.json: the semmoe rows, mode tp, global LAR
MEASURED_LAR_BY_EP = ((2, 0.7054), (4, 0.4886), (8, 0.3254), (16, 0.2046), (32, 0.1240), (64, 0.0713))

KNOBS = {
    KnobSource.MEASURED: {"bigmac_ratio": 0.25, "lar": None, "farskip_overlap": 0.853,
                          "lar_by_ep": MEASURED_LAR_BY_EP},
    KnobSource.PAPER: {"bigmac_ratio": 0.25, "lar": 0.5, "farskip_overlap": 0.889, "lar_by_ep": ()},
}


def knob_values(source: KnobSource | str = KnobSource.MEASURED, **overrides) -> dict:
    """The knobs of ``source`` with any non-None ``overrides`` (explicit flags) applied; an explicit
    ``lar`` replaces a measured LAR curve."""
    out = dict(KNOBS[KnobSource(source)])
    if overrides.get("lar") is not None:
        out["lar_by_ep"] = ()
    out.update({k: v for k, v in overrides.items() if v is not None})
    return out


def _lar_text(knob: dict) -> str:
    curve = knob.get("lar_by_ep") or ()
    if curve:
        return "LAR by EP " + ", ".join(f"{e}: {v:.3f}" for e, v in curve)
    return f"LAR = {knob['lar']:g}"


def default_variants(bigmac_ratio: float = 0.25, lar: Optional[float] = 0.5, farskip_overlap: float = 0.889,
                     lar_by_ep: tuple = ()) -> tuple[Variant, ...]:  # fmt: skip
    """Baseline, each knob alone, and all three combined; ``lar`` applies at every EP unless a
    measured ``lar_by_ep`` curve is given (defaults: the papers' figures, ``KnobSource.PAPER``)."""
    lar_kw = {"lar": lar, "lar_by_ep": tuple(tuple(p) for p in lar_by_ep)}
    return (
        BASELINE,
        Variant("bigmac", bigmac_ratio=bigmac_ratio),
        Variant("semmoe", **lar_kw),
        Variant("farskip", farskip_overlap=farskip_overlap),
        Variant("combined", bigmac_ratio=bigmac_ratio, farskip_overlap=farskip_overlap, **lar_kw),
    )


@dataclass(frozen=True)
class SweepConfig:
    topologies: tuple[Topology, ...] = (Topology.SCALE_UP, Topology.SCALE_OUT, Topology.TORUS_3D, Topology.FULL_MESH_3D)
    cluster_sizes: tuple[int, ...] = (64, 256)
    bandwidths_gbps: dict = field(default_factory=lambda: {
        Topology.SCALE_UP: (50, 100, 150, 225, 300, 450, 675, 900),
        Topology.TORUS_3D: (50, 100, 150, 225, 300, 450, 675, 900),
        Topology.FULL_MESH_3D: (50, 100, 150, 225, 300, 450, 675, 900),
        Topology.SCALE_OUT: (25, 50, 100, 200, 400),
    })  # fmt: skip
    tpots_ms: tuple[float, ...] = (15.0, 40.0, 100.0)
    contexts: tuple[int, ...] = (512, 4096)
    optimizations: tuple[Optimization, ...] = (Optimization.NOOPT, Optimization.DBO, Optimization.DBO_SD)
    variants: tuple[Variant, ...] = field(default_factory=lambda: default_variants(**KNOBS[KnobSource.MEASURED]))
    variant_optimization: Optimization = Optimization.DBO_SD
    cost_factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)
    generation: str = "h100"
    serving: ServingConfig = ServingConfig()
    cost: CostConfig = CostConfig()
    reference_size: int = 64  # cluster size of the fixed-size comparisons (Fig. 12, 14)
    constants: AlphaBeta = DGX_H100_INTRA  # scale-up / torus / full-mesh links, scale-out intra-node
    inter_constants: AlphaBeta = DGX_H100_INTER  # scale-out NICs
    # forward-looking analysis (§4.5, Fig. 18): throughput vs bandwidth on projected GPUs
    generations: tuple[str, ...] = ("h100", "blackwell", "rubin")
    generation_size: int = 256
    generation_tpots_ms: tuple[float, ...] = (10.0, 40.0)
    generation_bw_multipliers: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)

    def __post_init__(self):
        object.__setattr__(self, "topologies", tuple(Topology(t) for t in self.topologies))
        if not self.topologies or not self.cluster_sizes or not self.tpots_ms or not self.contexts:
            raise ValueError("a sweep needs at least one topology, cluster size, TPOT and context")
        if self.reference_size not in self.cluster_sizes:
            raise ValueError(f"reference_size {self.reference_size} must be one of the cluster sizes")


QUICK = {"cluster_sizes": (64,), "generations": (), "bandwidths_gbps": {
    Topology.SCALE_UP: (150, 300, 450, 900), Topology.TORUS_3D: (150, 300, 450, 900),
    Topology.FULL_MESH_3D: (150, 300, 450, 900), Topology.SCALE_OUT: (50, 200)}}  # fmt: skip
"""``sweep --quick``: 64 XPUs, four bandwidths per topology, no generations."""


def pareto_front(cost: np.ndarray, perf: np.ndarray) -> np.ndarray:
    """Boolean mask of points no other point dominates (lower-or-equal cost and higher-or-equal
    performance, one strictly). ``cost``, ``perf``: ``[P]``."""
    cost, perf = np.asarray(cost, float), np.asarray(perf, float)
    keep = np.ones(len(cost), bool)
    for i in range(len(cost)):
        dom = (cost <= cost[i]) & (perf >= perf[i]) & ((cost < cost[i]) | (perf > perf[i]))
        keep[i] = not dom.any()
    return keep


def _bw_scale(cfg: SweepConfig) -> float:
    """Per-XPU bandwidths of the sweep are multiples of the H100 provision; on a projected
    generation they scale with its link bandwidth (Table 5)."""
    return generation_spec(cfg.generation).link_bandwidth / generation_spec("h100").link_bandwidth


def _gbps(x: float) -> float:
    return round(float(x), 6)  # exact matching of swept bandwidths in the analyses


def _on_gpu(table: ProfileTable, spec) -> ProfileTable:
    """``table`` as is if it was made for ``spec``, else projected to it by the roofline."""
    return table if table.provenance.get("gpu_spec") == spec.as_dict() else project_table(table, spec)


def _network(cfg: SweepConfig, topo: Topology, n: int, bandwidth: float) -> Network:
    return Network(topo, n, bandwidth, constants=cfg.constants, inter_constants=cfg.inter_constants)


def _scenarios(cfg: SweepConfig) -> list[tuple[float, int]]:
    return [(t, c) for c in cfg.contexts for t in cfg.tpots_ms]


def _scen_key(tpot_ms: float, ctx: int) -> str:
    return f"tpot{tpot_ms:g}ms_ctx{ctx}"


def run_sweep(cfg: SweepConfig = SweepConfig(), table: Optional[ProfileTable] = None, log=print) -> dict:
    """Run the sweep; returns a JSON-ready dict with ``records`` and ``analyses``."""
    t_start = time.perf_counter()
    base_table = table = table or default_table()
    serving = cfg.serving
    bw_scale = _bw_scale(cfg)
    if cfg.generation != "h100":
        spec = generation_spec(cfg.generation)
        table = _on_gpu(table, spec)
        serving = replace(serving, mem_capacity=spec.mem_capacity)
    networks = []
    for topo in cfg.topologies:
        for n in cfg.cluster_sizes:
            for bw in cfg.bandwidths_gbps[topo]:
                networks.append(_network(cfg, topo, n, bw * bw_scale * GB))
    cases = [c for net in networks for c in cases_for(net, cfg.contexts, serving)]
    costs = {net: normalized_cost_per_xpu(net, cfg.cost) for net in networks}
    log(f"sweep: {len(networks)} networks, {len(cases)} layouts x {len(serving.batch_grid)} batch sizes, "
        f"{len(cfg.variants)} variants")  # fmt: skip

    # group case indices by (network, context)
    groups: dict = {}
    for i, c in enumerate(cases):
        groups.setdefault((c.network, c.context), []).append(i)

    records = []
    for variant in cfg.variants:
        t0 = time.perf_counter()
        opts = cfg.optimizations if variant == BASELINE else (cfg.variant_optimization,)
        res = evaluate_cases(cases, serving, variant, tuple(Technique), table)
        for tpot_ms, ctx in _scenarios(cfg):
            for opt in opts:
                best = best_under_slo(res, tpot_ms / 1000, opt)
                for net in networks:
                    idx = groups.get((net, ctx), [])
                    if not idx:
                        continue
                    k = idx[int(np.argmax(best["throughput_per_xpu"][idx]))]
                    thr = float(best["throughput_per_xpu"][k])
                    c = cases[k]
                    records.append({
                        "topology": net.topology.value, "num_xpus": net.num_xpus,
                        "bandwidth_gbps": _gbps(net.bandwidth / GB), "context": ctx, "tpot_slo_ms": tpot_ms,
                        "optimization": opt.value, "variant": variant.name,
                        "throughput_per_xpu": thr, "tp": c.tp if thr > 0 else None, "ep": c.ep if thr > 0 else None,
                        "batch_per_tp_group": float(best["batch"][k]) if thr > 0 else None,
                        "tpot_ms": float(best["tpot"][k]) * 1000 if thr > 0 else None,
                        "technique": str(best["technique"][k]) if thr > 0 else None,
                        "cost_per_xpu": costs[net], "throughput_per_cost": thr / costs[net],
                    })  # fmt: skip
        log(f"  {variant.name}: {time.perf_counter() - t0:.1f}s")
    analyses = _analyses(cfg, records, networks)
    if cfg.generations:
        t0 = time.perf_counter()
        analyses["generations"] = run_generations(cfg, base_table)
        log(f"  generations: {time.perf_counter() - t0:.1f}s")
    out = {
        "format": "netsim-sweep/1",
        "config": _config_json(cfg),
        "compute_table": table.provenance,
        "records": records,
        "analyses": analyses,
        "wall_s": time.perf_counter() - t_start,
    }
    return out


def run_generations(cfg: SweepConfig, table: ProfileTable) -> dict:
    """Paper §4.5 / Fig. 18: throughput per XPU vs per-XPU bandwidth on H100 and the Table 5
    projections, ``generation_size`` XPUs, DBO+SD. ``saturation_gbps``: the least bandwidth at which
    a topology reaches 95% of scale-up's throughput at that generation's provision."""
    topos = [t for t in (Topology.SCALE_UP, Topology.TORUS_3D, Topology.FULL_MESH_3D) if t in cfg.topologies]
    out = {}
    for gen in cfg.generations:
        spec = generation_spec(gen)
        tab = _on_gpu(table, spec)
        serving = replace(cfg.serving, mem_capacity=spec.mem_capacity)
        prov = spec.link_bandwidth / GB
        bws = [prov * m for m in cfg.generation_bw_multipliers]
        nets = [_network(cfg, t, cfg.generation_size, bw * GB) for t in topos for bw in bws]
        cases = [c for net in nets for c in cases_for(net, cfg.contexts, serving)]
        res = evaluate_cases(cases, serving, BASELINE, tuple(Technique), tab)
        gen_out = {"provision_gbps": prov, "bandwidths_gbps": bws, "scenarios": {}}
        for tpot_ms in cfg.generation_tpots_ms:
            best = best_under_slo(res, tpot_ms / 1000, Optimization.DBO_SD)
            for ctx in cfg.contexts:
                curves = {}
                for t in topos:
                    thr = []
                    for bw in bws:
                        idx = [i for i, c in enumerate(cases) if c.network.topology == t and c.context == ctx
                               and abs(c.network.bandwidth / GB - bw) < 1e-6]  # fmt: skip
                        thr.append(float(best["throughput_per_xpu"][idx].max()) if idx else 0.0)
                    curves[t.value] = thr
                target = 0.95 * curves.get("scale-up", [0] * len(bws))[bws.index(prov)] if "scale-up" in curves else None
                sat = {}
                for t, thr in curves.items():
                    hit = [bw for bw, x in zip(bws, thr) if target is not None and x >= target and x > 0]
                    sat[t] = min(hit) if hit else None
                gen_out["scenarios"][_scen_key(tpot_ms, ctx)] = {"throughput_per_xpu": curves, "saturation_gbps": sat}
        out[gen] = gen_out
    return out


def _config_json(cfg: SweepConfig) -> dict:
    return {
        "topologies": [t.value for t in cfg.topologies],
        "cluster_sizes": list(cfg.cluster_sizes),
        "bandwidths_gbps": {t.value: list(cfg.bandwidths_gbps[t]) for t in cfg.topologies},
        "tpots_ms": list(cfg.tpots_ms),
        "contexts": list(cfg.contexts),
        "optimizations": [o.value for o in cfg.optimizations],
        "variants": [v.as_dict() for v in cfg.variants],
        "variant_optimization": cfg.variant_optimization.value,
        "cost_factors": list(cfg.cost_factors),
        "generation": cfg.generation,
        "serving": {"mem_capacity": cfg.serving.mem_capacity, "mem_usable_fraction": cfg.serving.mem_usable_fraction,
                    "tp_sizes": list(cfg.serving.tp_sizes), "spec_decode": asdict(cfg.serving.spec),
                    "model": cfg.serving.model.as_dict(), "loop_control": cfg.serving.loop_control.value},  # fmt: skip
        "cost": asdict(cfg.cost),
        "reference_size": cfg.reference_size,
        "constants": cfg.constants.as_dict(),
        "inter_constants": cfg.inter_constants.as_dict(),
        "link_bandwidth_scale": _bw_scale(cfg),
        "generations": list(cfg.generations),
        "generation_size": cfg.generation_size,
        "generation_tpots_ms": list(cfg.generation_tpots_ms),
    }


def _select(records, **kw):
    return [r for r in records if all(r[k] == v for k, v in kw.items())]


def _analyses(cfg: SweepConfig, records: list[dict], networks: list[Network]) -> dict:
    base = [r for r in records if r["variant"] == BASELINE.name]
    n_ref = cfg.reference_size
    scale = _bw_scale(cfg)
    provision = {t: _gbps(v * scale) for t, v in PROVISION_GBPS.items()}
    out: dict = {"bandwidth": {}, "topology": {}, "topology_best": {}, "pareto": {}, "variants": {}}

    # ---- scale-up link-bandwidth sweet spot (Fig. 12) and its sensitivity to the cost factor (Fig. 13)
    if Topology.SCALE_UP in cfg.topologies:
        prov = provision[Topology.SCALE_UP]
        for tpot_ms, ctx in _scenarios(cfg):
            key = _scen_key(tpot_ms, ctx)
            out["bandwidth"][key] = {}
            for opt in cfg.optimizations:
                rs = sorted(_select(base, topology="scale-up", num_xpus=n_ref, context=ctx, tpot_slo_ms=tpot_ms,
                                    optimization=opt.value), key=lambda r: r["bandwidth_gbps"])  # fmt: skip
                bws = [r["bandwidth_gbps"] for r in rs]
                tpc = np.array([r["throughput_per_cost"] for r in rs])
                thr = np.array([r["throughput_per_xpu"] for r in rs])
                entry = {"bandwidths_gbps": bws, "throughput_per_cost": tpc.tolist(), "throughput_per_xpu": thr.tolist()}
                if prov in bws and tpc.max() > 0:
                    ref = tpc[bws.index(prov)]
                    entry["sweet_spot_gbps"] = bws[int(np.argmax(tpc))]
                    entry["gain_over_provision"] = float(tpc.max() / ref - 1) if ref > 0 else None
                    by_factor = {}
                    nets = {r["bandwidth_gbps"]: Network("scale-up", n_ref, r["bandwidth_gbps"] * GB) for r in rs}
                    for f in cfg.cost_factors:
                        cc = replace(cfg.cost, network_cost_factor=f)
                        t2 = thr / np.array([normalized_cost_per_xpu(nets[b], cc) for b in bws])
                        by_factor[f"{f:g}"] = {"sweet_spot_gbps": bws[int(np.argmax(t2))],
                                               "gain_over_provision": float(t2.max() / t2[bws.index(prov)] - 1)
                                               if t2[bws.index(prov)] > 0 else None}  # fmt: skip
                    entry["by_cost_factor"] = by_factor
                out["bandwidth"][key][opt.value] = entry

    # ---- topologies at the 1x provision, reference size (Fig. 14/15), and at their best (Fig. 17)
    for tpot_ms, ctx in _scenarios(cfg):
        key = _scen_key(tpot_ms, ctx)
        out["topology"][key] = {}
        out["topology_best"][key] = {}
        for opt in cfg.optimizations:
            row, best_row = {}, {}
            for topo in cfg.topologies:
                rs = _select(base, topology=topo.value, num_xpus=n_ref, context=ctx, tpot_slo_ms=tpot_ms,
                             optimization=opt.value, bandwidth_gbps=provision[topo])  # fmt: skip
                if rs:
                    row[topo.value] = {k: rs[0][k] for k in ("throughput_per_xpu", "throughput_per_cost", "cost_per_xpu", "tp", "ep", "technique")}
                allr = _select(base, topology=topo.value, context=ctx, tpot_slo_ms=tpot_ms, optimization=opt.value)
                if allr:
                    b = max(allr, key=lambda r: r["throughput_per_cost"])
                    best_row[topo.value] = {k: b[k] for k in ("throughput_per_cost", "throughput_per_xpu", "bandwidth_gbps", "num_xpus")}
            for dst in (row, best_row):
                su = dst.get("scale-up", {}).get("throughput_per_cost", 0)
                sl = [dst[t.value]["throughput_per_cost"] for t in SWITCHLESS if t.value in dst]
                if su > 0 and sl:
                    dst["switchless_gain_over_scale_up"] = float(max(sl) / su - 1)
                    dst["best_switchless"] = max((t.value for t in SWITCHLESS if t.value in dst), key=lambda t: dst[t]["throughput_per_cost"])
            out["topology"][key][opt.value] = row
            out["topology_best"][key][opt.value] = best_row

    # ---- performance-cost plane with Pareto frontier (Fig. 17): best size per (topology, bandwidth)
    opt = cfg.optimizations[-1]
    for tpot_ms, ctx in _scenarios(cfg):
        key = _scen_key(tpot_ms, ctx)
        pts = []
        for topo in cfg.topologies:
            for bw in cfg.bandwidths_gbps[topo]:
                bw = _gbps(bw * scale)
                rs = _select(base, topology=topo.value, bandwidth_gbps=bw, context=ctx, tpot_slo_ms=tpot_ms,
                             optimization=opt.value)  # fmt: skip
                if rs:
                    b = max(rs, key=lambda r: r["throughput_per_cost"])
                    if b["throughput_per_xpu"] > 0:
                        pts.append({"topology": topo.value, "bandwidth_gbps": bw, "num_xpus": b["num_xpus"],
                                    "cost_per_xpu": b["cost_per_xpu"], "throughput_per_xpu": b["throughput_per_xpu"]})  # fmt: skip
        if pts:
            mask = pareto_front([p["cost_per_xpu"] for p in pts], [p["throughput_per_xpu"] for p in pts])
            for p, m in zip(pts, mask):
                p["on_frontier"] = bool(m)
        out["pareto"][key] = {
            "optimization": opt.value,
            "points": pts,
            "frontier_topologies": sorted({p["topology"] for p in pts if p["on_frontier"]}),
        }

    # ---- variants: gain in throughput per cost over the baseline, per topology (1x, reference size)
    vo = cfg.variant_optimization.value
    for tpot_ms, ctx in _scenarios(cfg):
        key = _scen_key(tpot_ms, ctx)
        out["variants"][key] = {}
        for topo in cfg.topologies:
            sel = dict(topology=topo.value, num_xpus=n_ref, context=ctx, tpot_slo_ms=tpot_ms, optimization=vo,
                       bandwidth_gbps=provision[topo])  # fmt: skip
            b = _select(base, **sel)
            if not b or b[0]["throughput_per_cost"] <= 0:
                continue
            g = {}
            for v in cfg.variants:
                if v.name == BASELINE.name:
                    continue
                rv = _select(records, variant=v.name, **sel)
                if rv:
                    g[v.name] = float(rv[0]["throughput_per_cost"] / b[0]["throughput_per_cost"] - 1)
            out["variants"][key][topo.value] = g
    return out


def summary_table(result: dict) -> str:
    """Plain-text summary of the analyses (what ``sweep`` prints)."""
    a = result["analyses"]
    opt_last = result["config"]["optimizations"][-1]
    lines = []
    gen = result["config"].get("generation", "h100")
    if gen != "h100":
        lines.append(f"GPU generation: {gen} (compute table and memory projected by Table 5; bandwidths x "
                     f"{result['config']['link_bandwidth_scale']:g}; costs use today's prices)")  # fmt: skip
    lines.append(f"Topologies at the 1x provision, {result['config']['reference_size']} XPUs, {opt_last}: "
                 "throughput/cost relative to scale-up (tokens/s per XPU in brackets)")  # fmt: skip
    topos = result["config"]["topologies"]
    lines.append(f"{'scenario':<22}" + "".join(f"{t:>22}" for t in topos) + f"{'switchless gain':>17}")
    for key, per in a["topology"].items():
        row = per.get(opt_last, {})
        su = row.get("scale-up", {}).get("throughput_per_cost", 0)
        cells = []
        for t in topos:
            if t in row and su > 0:
                cells.append(f"{row[t]['throughput_per_cost'] / su:>10.3f} ({row[t]['throughput_per_xpu']:>7.0f})")
            else:
                cells.append(f"{'-':>22}")
        g = row.get("switchless_gain_over_scale_up")
        lines.append(f"{key:<22}" + "".join(f"{c:>22}" for c in cells) + (f"{g * 100:>16.1f}%" if g is not None else f"{'-':>17}"))
    lines.append("")
    lines.append("Best configuration per topology (any bandwidth and size): switchless gain over scale-up")
    for key, per in a["topology_best"].items():
        row = per.get(opt_last, {})
        g = row.get("switchless_gain_over_scale_up")
        desc = ", ".join(f"{t} {row[t]['bandwidth_gbps']:g}GB/s x{row[t]['num_xpus']}" for t in topos if t in row)
        lines.append(f"  {key:<22} {('%.1f%%' % (g * 100)) if g is not None else '-':>8}   ({desc})")
    if a["bandwidth"]:
        lines.append("")
        lines.append(f"Scale-up link bandwidth sweet spot (throughput/cost), gain over the "
                     f"{450 * result['config'].get('link_bandwidth_scale', 1.0):g} GB/s provision")  # fmt: skip
        opts = result["config"]["optimizations"]
        lines.append(f"{'scenario':<22}" + "".join(f"{o:>20}" for o in opts))
        for key, per in a["bandwidth"].items():
            cells = []
            for o in opts:
                e = per.get(o, {})
                if "sweet_spot_gbps" in e and e.get("gain_over_provision") is not None:
                    cells.append(f"{e['sweet_spot_gbps']:>6g} GB/s {e['gain_over_provision'] * 100:>5.1f}%")
                else:
                    cells.append("-")
            lines.append(f"{key:<22}" + "".join(f"{c:>20}" for c in cells))
    lines.append("")
    lines.append("Pareto frontier (cost per XPU vs throughput per XPU), topologies on it:")
    for key, p in a["pareto"].items():
        lines.append(f"  {key:<22} {', '.join(p['frontier_topologies'])}")
    if a["variants"]:
        lines.append("")
        vnames = [v["name"] for v in result["config"]["variants"] if v["name"] != "baseline"]
        knobs = {v["name"]: v for v in result["config"]["variants"]}
        knob_text = "; ".join(t for t in (
            f"r = {knobs['bigmac']['bigmac_ratio']:g}" if "bigmac" in knobs else "",
            _lar_text(knobs["semmoe"]) if "semmoe" in knobs else "",
            f"overlap = {knobs['farskip']['farskip_overlap']:g}" if "farskip" in knobs else "") if t)
        lines.append(f"Variant gains in throughput/cost over baseline ({result['config']['variant_optimization']}, "
                     f"1x provision; {knob_text})")
        lines.append(f"{'scenario':<22}{'topology':<12}" + "".join(f"{v:>10}" for v in vnames))
        for key, per in a["variants"].items():
            for t, g in per.items():
                lines.append(f"{key:<22}{t:<12}" + "".join(f"{g.get(v, float('nan')) * 100:>9.1f}%" for v in vnames))
    gens = a.get("generations")
    if gens:
        lines.append("")
        lines.append(f"Next generations ({result['config']['generation_size']} XPUs, dbo+sd): bandwidth (GB/s) at which "
                     "each topology reaches 95% of scale-up's throughput at the generation's provision")  # fmt: skip
        for g, ge in gens.items():
            for key, sc in ge["scenarios"].items():
                sat = ", ".join(f"{t} {v:g}" if v is not None else f"{t} >{ge['bandwidths_gbps'][-1]:g}"
                                for t, v in sc["saturation_gbps"].items())  # fmt: skip
                lines.append(f"  {g:<10} (provision {ge['provision_gbps']:g}) {key:<20} {sat}")
    lines.append("")
    lines.append(f"wall time {result['wall_s']:.1f}s; compute table: {result['compute_table'].get('method')} "
                 f"({result['compute_table'].get('gpu')})")  # fmt: skip
    return "\n".join(lines)


def read_sweep(path: str, flag: str) -> dict:
    """A ``sweep.json`` written by ``python -m netsim sweep``; a one-line error naming ``flag`` else."""
    from .validation import read_json

    doc = read_json(path, flag)
    if not isinstance(doc, dict) or doc.get("format") != "netsim-sweep/1":
        raise ValueError(f"{flag} {path}: not a netsim sweep JSON (format netsim-sweep/1)")
    return doc


def decisions(result: dict) -> dict:
    """What a sweep recommends, flat: ``{name: value}`` per scenario and optimisation (the topology
    with the most throughput per cost at the 1x provision and at its best bandwidth and size, the
    best switchless topology, the scale-up bandwidth sweet spot, the Pareto frontier's topologies)
    and per scenario and topology the variant with the largest gain."""
    a, out = result["analyses"], {}
    for key, per in a["topology"].items():
        for opt, row in per.items():
            tops = {t: v for t, v in row.items() if isinstance(v, dict)}
            if tops:
                out[f"topology 1x/{key}/{opt}"] = max(tops, key=lambda t: tops[t]["throughput_per_cost"])
            out[f"best switchless 1x/{key}/{opt}"] = row.get("best_switchless")
    for key, per in a["topology_best"].items():
        for opt, row in per.items():
            tops = {t: v for t, v in row.items() if isinstance(v, dict)}
            if tops:
                t = max(tops, key=lambda t: tops[t]["throughput_per_cost"])
                out[f"topology best/{key}/{opt}"] = f"{t} {tops[t]['bandwidth_gbps']:g}GB/s x{tops[t]['num_xpus']}"
    for key, per in a["bandwidth"].items():
        for opt, e in per.items():
            out[f"scale-up sweet spot/{key}/{opt}"] = e.get("sweet_spot_gbps")
    for key, p in a["pareto"].items():
        out[f"pareto frontier/{key}"] = ", ".join(p["frontier_topologies"])
    for key, per in a["variants"].items():
        for topo, gains in per.items():
            if gains:
                out[f"best variant/{key}/{topo}"] = max(gains, key=gains.get)
    return out


def compare_decisions(base: dict, new: dict) -> dict:
    """Two sweeps' recommendations side by side: the decisions that changed, and per record
    (topology, size, bandwidth, scenario, optimisation, variant) whether its chosen layout (tp, ep,
    technique) changed and how much its throughput per XPU moved (``new / base - 1``)."""
    da, db = decisions(base), decisions(new)
    changed = [{"decision": k, "base": da.get(k), "new": db.get(k)} for k in sorted(set(da) | set(db))
               if da.get(k) != db.get(k)]  # fmt: skip
    keys = ("topology", "num_xpus", "bandwidth_gbps", "context", "tpot_slo_ms", "optimization", "variant")
    rb = {tuple(r[k] for k in keys): r for r in base["records"]}
    moved, layouts, n = [], 0, 0
    for r in new["records"]:
        b = rb.get(tuple(r[k] for k in keys))
        if b is None:
            continue
        n += 1
        layouts += any(r[k] != b[k] for k in ("tp", "ep", "technique"))
        if b["throughput_per_xpu"] > 0:
            moved.append(r["throughput_per_xpu"] / b["throughput_per_xpu"] - 1)
    moved = np.array(moved) if moved else np.zeros(1)
    return {"decisions": len(da), "changed": changed, "records": n, "layouts_changed": int(layouts),
            "throughput_change": {"median": float(np.median(moved)), "min": float(moved.min()),
                                  "max": float(moved.max())}}  # fmt: skip


def format_decisions(cmp: dict) -> str:
    """The comparison as text (what ``sweep --compare-to`` prints)."""
    t = cmp["throughput_change"]
    lines = [f"{len(cmp['changed'])} of {cmp['decisions']} decisions changed; chosen layout changed in "
             f"{cmp['layouts_changed']} of {cmp['records']} records; throughput per XPU moved "
             f"{t['median'] * 100:+.3f}% median ({t['min'] * 100:+.3f}% to {t['max'] * 100:+.3f}%)"]  # fmt: skip
    lines += [f"  {c['decision']}: {c['base']} -> {c['new']}" for c in cmp["changed"]]
    return "\n".join(lines)
