"""``python -m netsim <command>``: the network-topology cost model for MoE serving.

* ``collectives``        alpha-beta time of every algorithm for one collective, and the fastest
* ``fit``                fit the alpha-beta constants to measurements (bench_ep CSV / nccl-tests)
* ``synth-collectives``  write a synthetic measurement CSV from known constants (for checking ``fit``)
* ``compute-table``      write a roofline-estimate compute table, or project one to a GPU generation
* ``serve``              best layout, batch, TPOT and throughput for one network and scenario
* ``cost``               cost breakdown of one network
* ``ep-costs``           per-EP-rank cost matrix of one network as ``moe-ep-cost/1`` JSON (``netsim.ep_costs``)
* ``sweep``              the full design-space sweep: JSON, PNG plots and a summary table
* ``predict``            TTFT, TPOT and throughput of a bench_serve run's workload, from the run's
                         calibrated link and the profiled compute of the served model (``netsim.replay``)
* ``validate``           the same next to what the run measured: relative error per figure and mean

User errors (``UserError``: a flag, a file) print one line and exit with status 2. Bandwidths on the command line
are GB/s (1e9 bytes/s) per XPU, one direction; times are printed in microseconds or milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

from megatron.common.cli import Subcommands, UserError, float_list, int_list, positive_float, positive_int, user_input

__all__ = ["main", "COMMANDS"]

COMMANDS = Subcommands("python -m netsim", __doc__.split("\n\n")[0])
command = COMMANDS.add


def _topology_arg(p: argparse.ArgumentParser, default: str = "scale-up", choices: Optional[list] = None) -> None:
    from .collectives import Topology

    p.add_argument("--topology", default=default, choices=choices or [t.value for t in Topology if t != Topology.SWITCH])


def _constants_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("alpha-beta constants (default: the paper's DGX H100 fit, Table 1)")
    g.add_argument("--constants", metavar="JSON", help="fitted constants (`fit --out`) for the primary links")
    g.add_argument("--inter-constants", metavar="JSON", help="fitted constants for scale-out NICs")


@user_input()
def _load_constants(path: Optional[str], default):
    if not path:
        return default
    from .collectives import AlphaBeta

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--constants {path}: no such file")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not JSON ({e})") from None
    return AlphaBeta.from_dict(d.get("constants", d))


@user_input()
def _network(args, bandwidth_gbps: Optional[float] = None):
    from .collectives import DGX_H100_INTER, DGX_H100_INTRA, GB, Network

    dims = tuple(args.dims) if getattr(args, "dims", None) else ()
    return Network(
        args.topology, args.num_xpus, (bandwidth_gbps or args.bandwidth_gbps) * GB, dims=dims,
        constants=_load_constants(args.constants, DGX_H100_INTRA),
        inter_constants=_load_constants(args.inter_constants, DGX_H100_INTER),
    )  # fmt: skip


def _network_args(p: argparse.ArgumentParser, bandwidth: Optional[float] = 450.0) -> None:
    _topology_arg(p)
    p.add_argument("--num-xpus", type=positive_int, default=64)
    p.add_argument("--bandwidth-gbps", type=positive_float, default=bandwidth,
                   help="per-XPU bandwidth, GB/s one direction (scale-out: the NIC; default %(default)s)")  # fmt: skip
    p.add_argument("--dims", type=int_list, help="torus / full-mesh dimensions, e.g. 4,4,4 (default: most cubic)")
    _constants_args(p)


# --------------------------------------------------------------------------------------- collectives


def _configure_collectives(p):
    _network_args(p)
    p.add_argument("--op", default="all_to_all", choices=["all_to_all", "all_reduce"])
    p.add_argument("--ranks", type=positive_int, help="group size (default: all XPUs)")
    p.add_argument("--bytes", type=float_list, default=[2.0**k for k in range(10, 31, 2)],
                   help="message sizes in bytes (per-rank input), comma-separated")  # fmt: skip


@command("collectives", "time of every algorithm for one collective, and the fastest", _configure_collectives)
def _collectives(args) -> int:
    import numpy as np

    from .collectives import algorithms, best_algorithm

    net = _network(args)
    p = args.ranks or net.num_xpus
    algos = algorithms(net, args.op, p)
    sizes = np.array(args.bytes)
    best_t, best_n = best_algorithm(net, args.op, p, sizes)
    print(f"{args.op} on {net.topology.value} ({net.num_xpus} XPUs, {net.bandwidth / 1e9:g} GB/s per XPU), group of {p}; microseconds")
    print(f"{'bytes':>12}" + "".join(f"{a.name:>16}" for a in algos) + f"{'fastest':>20}")
    for i, s in enumerate(sizes):
        cells = "".join(f"{float(a.time(s)) * 1e6:>16.2f}" for a in algos)
        print(f"{s:>12.0f}{cells}{best_n[i]:>20}")
    return 0


# ------------------------------------------------------------------------------------------------ fit


def _configure_fit(p):
    from .fit import FIT_TOPOLOGIES

    p.add_argument("--csv", action="append", default=[], metavar="FILE", help="op,ranks,bytes,seconds CSV (repeatable)")
    p.add_argument("--nccl", action="append", default=[], metavar="FILE", help="nccl-tests output (repeatable)")
    p.add_argument("--op", choices=["all_to_all", "all_reduce"], help="collective of --nccl files whose log does not say")
    p.add_argument("--ranks", type=positive_int, help="rank count of --nccl files whose log does not say")
    p.add_argument("--topology", default="switch", choices=[t.value for t in FIT_TOPOLOGIES],
                   help="network the ranks sit on (default: a flat non-blocking switch)")  # fmt: skip
    p.add_argument("--algorithm", default="auto",
                   help="'auto' (fastest per row), or op=name pairs, e.g. all_to_all=p2p,all_reduce=ring")  # fmt: skip
    p.add_argument("--bandwidth-gbps", type=positive_float,
                   help="nominal per-rank bandwidth, GB/s (default: the CSV's sidecar JSON link, else fit s/byte)")  # fmt: skip
    p.add_argument("--burst", default="0", help="bytes per call a token-bucket shaper lets through before its rate "
                   "applies ('auto' to fit it; default 0, the paper's model)")  # fmt: skip
    p.add_argument("--statistic", default="median", choices=["median", "min", "mean"],
                   help="per-row statistic of a bench_ep calibration (min / mean come from its sidecar JSON)")  # fmt: skip
    p.add_argument("--per-op", action="store_true", help="fit all_to_all and all_reduce separately")
    p.add_argument("--out", help="write the fitted constants and errors as JSON")
    p.add_argument("--show-rows", action="store_true", help="print every row with its prediction")


def _parse_algorithm(s: str) -> dict:
    if s == "auto":
        return {}
    out = {}
    for part in s.split(","):
        if "=" not in part:
            raise UserError(f"--algorithm: expected op=name pairs or 'auto', got {part!r}")
        op, name = part.split("=", 1)
        if op.strip() not in ("all_to_all", "all_reduce"):
            raise UserError(f"--algorithm: unknown op {op!r}")
        out[op.strip()] = name.strip()
    return out


@command("fit", "fit alpha-beta constants to measured collectives", _configure_fit)
def _fit(args) -> int:
    from megatron.common.files import write_json
    from .fit import check_rows, fit_constants, fit_per_op, read_bench_sidecar, read_nccl_tests, read_sidecar_bandwidth

    if not args.csv and not args.nccl:
        raise UserError("fit: give at least one --csv or --nccl file")
    if args.statistic != "median" and args.nccl:
        raise UserError("--statistic applies to bench_ep CSVs only")
    with user_input():  # the measurement files
        rows = []
        for f in args.csv:
            rows += read_bench_sidecar(f, args.statistic)
        for f in args.nccl:
            rows += read_nccl_tests(f, args.op, args.ranks)
        check_rows(rows)
        bw = args.bandwidth_gbps * 1e9 if args.bandwidth_gbps else None
        bw_src = "--bandwidth-gbps"
        if bw is None:
            for f in args.csv:
                bw = read_sidecar_bandwidth(f)
                if bw:
                    bw_src = f"sidecar of {f}"
                    break
    try:
        burst = args.burst if args.burst == "auto" else float(args.burst)
    except ValueError:
        raise UserError(f"--burst: a number of bytes or 'auto', got {args.burst!r}") from None
    algo = _parse_algorithm(args.algorithm)
    print(f"fit of {len(rows)} measurements ({args.statistic} per row) on a {args.topology} model"
          + (f", nominal bandwidth {bw / 1e9:g} GB/s per rank ({bw_src})" if bw else ", bandwidth unknown"))  # fmt: skip
    if args.per_op:
        fits, err = fit_per_op(rows, args.topology, bw, algo, burst)
    else:
        res = fit_constants(rows, args.topology, bw, algo, burst)
        fits, err = {"all": res}, res.mean_relative_error
    for name, res in fits.items():
        c = res.constants
        if args.per_op:
            print(f"[{name}]")
        print(f"  one-time latency   alpha0      = {c.alpha0 * 1e6:10.3f} us")
        print(f"  per-round latency  alpha_round = {c.alpha_round * 1e6:10.3f} us")
        print(f"  per-destination    alpha_dest  = {c.alpha_dest * 1e6:10.3f} us")
        if bw:
            print(f"  link utilisation   eta         = {c.utilization * 100:10.1f} %")
        print(f"  effective bandwidth            = {1 / res.beta_s_per_byte / 1e9 if res.beta_s_per_byte > 0 else float('inf'):10.4f} GB/s")
        if res.burst_bytes:
            print(f"  shaper burst per call          = {res.burst_bytes / 1024:10.1f} KiB")
        if not res.identifiable:
            print("  note: the data cannot separate the three latencies (too few rank counts / algorithms); only their"
                  " per-call sum is determined")  # fmt: skip
        print(f"  mean relative error {res.mean_relative_error * 100:.2f}% (max {res.max_relative_error * 100:.2f}%); "
              + ", ".join(f"{k} {v * 100:.2f}%" for k, v in res.per_op_error.items()))  # fmt: skip
        counts = res.as_dict()["algorithm_counts"]
        print("  algorithms: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
              + f" ({res.fastest_fraction * 100:.0f}% of rows on the model's fastest)")  # fmt: skip
    print(f"mean relative error {err * 100:.2f}% over {len(rows)} rows")
    if args.show_rows:
        print(f"{'op':>11} {'ranks':>5} {'bytes':>12} {'measured us':>12} {'model us':>12} {'rel err':>8}  algorithm")
        for res in fits.values():
            sub = [m for m in rows if args.per_op is False or m.op.value == next(iter(res.per_op_error))]
            for m, pr, e, a in zip(sub, res.predicted, res.relative_errors, res.algorithms):
                print(f"{m.op.value:>11} {m.ranks:>5} {m.bytes:>12.0f} {m.seconds * 1e6:>12.2f} {pr * 1e6:>12.2f} "
                      f"{e * 100:>7.2f}%  {a.split(':')[1]}")  # fmt: skip
    if args.out:
        d = {"mean_relative_error": err, "statistic": args.statistic,
             "inputs": {"csv": args.csv, "nccl": args.nccl, "rows": len(rows), "algorithm": args.algorithm,
                        "burst": args.burst, "per_op": args.per_op}}  # fmt: skip
        if args.per_op:
            d["per_op_fits"] = {k: v.as_dict() for k, v in fits.items()}
        else:
            d.update(fits["all"].as_dict())
        write_json(args.out, d)
        print(f"wrote {args.out}")
    return 0


# ------------------------------------------------------------------------------------ synth-collectives


def _configure_synth(p):
    from .fit import FIT_TOPOLOGIES

    p.add_argument("--out", required=True, help="CSV to write")
    p.add_argument("--topology", default="switch", choices=[t.value for t in FIT_TOPOLOGIES])
    p.add_argument("--tier", default="intra", choices=["intra", "inter"], help="which Table 1 column to use")
    p.add_argument("--constants", metavar="JSON", help="constants to use instead of --tier")
    p.add_argument("--bandwidth-gbps", type=positive_float, default=450.0)
    p.add_argument("--ranks", type=int_list, default=[4, 8, 16, 32])
    p.add_argument("--noise", type=float, default=0.03, help="log-normal relative noise (default 0.03)")
    p.add_argument("--seed", type=int, default=0)


@command("synth-collectives", "write synthetic measurements from known constants", _configure_synth)
def _synth(args) -> int:
    from megatron.common.files import write_text
    from .collectives import DGX_H100_INTER, DGX_H100_INTRA
    from .fit import synthetic_measurements

    c = _load_constants(args.constants, DGX_H100_INTRA if args.tier == "intra" else DGX_H100_INTER)
    if args.noise < 0:
        raise UserError("--noise must be >= 0")
    rows = synthetic_measurements(c, args.bandwidth_gbps * 1e9, args.topology, args.ranks, noise=args.noise, seed=args.seed)
    text = "op,ranks,bytes,seconds\n" + "".join(f"{m.op.value},{m.ranks},{m.bytes:.0f},{m.seconds:.9e}\n" for m in rows)
    write_text(args.out, text)
    print(f"wrote {len(rows)} rows to {args.out} ({args.topology}, {args.bandwidth_gbps:g} GB/s, noise {args.noise:g}); "
          f"true constants: {c.as_dict()}")  # fmt: skip
    return 0


# -------------------------------------------------------------------------------------- compute-table


def _configure_table(p):
    from .compute import GENERATION_SCALING, RooflineEfficiency

    p.add_argument("--out", required=True, help="table JSON to write")
    p.add_argument("--gpu", default="h100", choices=list(GENERATION_SCALING), help="target GPU (Table 5 projection)")
    p.add_argument("--project", metavar="TABLE", help="project this (e.g. measured) table to --gpu instead of "
                   "estimating one by the roofline")  # fmt: skip
    d = RooflineEfficiency()
    g = p.add_argument_group("roofline efficiencies (assumptions; see netsim/compute.py)")
    for f in ("gemm_compute", "gemm_memory", "attention_compute", "attention_memory", "memory_only", "kernel_overhead_s"):
        g.add_argument("--" + f.replace("_", "-"), type=float, default=getattr(d, f))


@command("compute-table", "write a roofline-estimate compute table or project one", _configure_table)
def _table(args) -> int:
    from .compute import RooflineEfficiency, generation_spec, load_table, project_table, roofline_table

    with user_input():  # the efficiencies and the table to project
        eff = RooflineEfficiency(args.gemm_compute, args.gemm_memory, args.attention_compute, args.attention_memory,
                                 args.memory_only, args.kernel_overhead_s)  # fmt: skip
        spec = generation_spec(args.gpu)
        source = load_table(args.project) if args.project else None
    if source is not None:
        tab = project_table(source, spec, eff=eff)
    else:
        tab = roofline_table(gpu=spec, eff=eff)
    tab.save(args.out)
    n = sum(kt.seconds.size for kt in tab.kinds.values())
    print(f"wrote {args.out}: {len(tab.kinds)} layer kinds, {n} grid points, method={tab.provenance['method']}, gpu={spec.name}")
    return 0


# --------------------------------------------------------------------------------------------- serve


def _variant_args(p, defaults: bool = False):
    g = p.add_argument_group("variants (knobs)")
    if defaults:  # the sweep: a knob set, each flag overriding one knob of it
        g.add_argument("--knobs", choices=["measured", "paper"], default="measured",
                       help="knob values: this project's measurements (FarSkip overlap 0.853 served, Sem-MoE LAR by EP, "
                            "0.705 at 2 to 0.071 at 64; docs/design/netsim.md) or the papers' (FarSkip's "
                            "training overlap 0.889: the paper reports none for serving; LAR 0.5); r = 0.25 in both")
    g.add_argument("--bigmac-ratio", type=float, default=None if defaults else 1.0, help="BigMac r: all-to-all at r x hidden")
    g.add_argument("--lar", type=float, default=None, help="Sem-MoE local activation rate (one figure at every "
                   "EP; on the sweep it replaces the measured curve)")
    g.add_argument("--farskip-overlap", type=float, default=None if defaults else 0.0,
                   help="FarSkip: share of each all-to-all the next op overlaps")  # fmt: skip


def _serving_args(p):
    from .serving import DraftCost, LoopControl, SpecDecode

    d = SpecDecode()
    g = p.add_argument_group("serving")
    g.add_argument("--table", metavar="JSON", help="compute table (default: shipped H100 roofline estimate)")
    g.add_argument("--gpu", default="h100", choices=["h100", "blackwell", "rubin"],
                   help="project the table and memory to this generation (Table 5)")  # fmt: skip
    g.add_argument("--num-draft", type=positive_int, default=d.num_draft, help="speculative decoding: drafted tokens")
    g.add_argument("--pass-rate", type=float, default=d.pass_rate, help="speculative decoding: average pass rate")
    g.add_argument("--draft-cost", default=d.draft_cost.value, choices=[c.value for c in DraftCost])
    g.add_argument("--mem-usable-fraction", type=float, default=0.9)
    g.add_argument("--loop-control", default="none", choices=[c.value for c in LoopControl],
                   help="exchange: every decode iteration also pays the serving loop's two small collectives")
    g.add_argument("--network-cost-factor", type=float, default=1.0, help="scales network CapEx (paper's adjustment)")


@user_input()
def _serving_cfg(args):
    from .compute import default_table, generation_spec, load_table, project_table
    from .serving import ServingConfig, SpecDecode

    table = load_table(args.table) if args.table else default_table()
    spec = generation_spec(args.gpu)
    if table.provenance.get("gpu_spec") != spec.as_dict():
        table = project_table(table, spec)
    cfg = ServingConfig(mem_capacity=spec.mem_capacity, mem_usable_fraction=args.mem_usable_fraction,
                        spec=SpecDecode(args.num_draft, args.pass_rate, args.draft_cost),
                        loop_control=args.loop_control)  # fmt: skip
    return cfg, table


def _configure_serve(p):
    _network_args(p)
    p.add_argument("--tpot-ms", type=positive_float, default=40.0, help="TPOT SLO in ms")
    p.add_argument("--context", type=positive_int, default=512, help="average context length (input + output)")
    p.add_argument("--optimization", default="dbo+sd", choices=["noopt", "dbo", "dbo+sd"])
    _serving_args(p)
    _variant_args(p)


@command("serve", "best layout, batch, TPOT and throughput for one network and scenario", _configure_serve)
def _serve(args) -> int:
    import numpy as np

    from .cost import CostConfig, cluster_cost, normalized_cost_per_xpu
    from .serving import Technique, Variant, best_under_slo, cases_for, evaluate_cases

    net = _network(args)
    cfg, table = _serving_cfg(args)
    with user_input():  # the variant's knobs and the cost factor
        variant = Variant("cli", args.bigmac_ratio, args.lar, args.farskip_overlap)
        cc = replace(CostConfig(), network_cost_factor=args.network_cost_factor)
    cases = cases_for(net, [args.context], cfg)
    if not cases:
        raise UserError("no (tp, ep) layout fits this network's memory")
    res = evaluate_cases(cases, cfg, variant, tuple(Technique), table)
    best = best_under_slo(res, args.tpot_ms / 1000, args.optimization)
    cost = normalized_cost_per_xpu(net, cc)
    order = np.argsort(-best["throughput_per_xpu"])
    print(f"{net.topology.value}, {net.num_xpus} XPUs, {net.bandwidth / 1e9:g} GB/s per XPU; TPOT <= {args.tpot_ms:g} ms, "
          f"context {args.context}, {args.optimization}; normalised cost per XPU {cost:.4f}")  # fmt: skip
    print(f"{'tp':>3} {'ep':>4} {'batch/TP grp':>12} {'TPOT ms':>8} {'technique':>9} {'tok/s/XPU':>10} {'tok/s/cost':>10}")
    for i in order[:8]:
        c = cases[i]
        thr = best["throughput_per_xpu"][i]
        if thr <= 0:
            print(f"{c.tp:>3} {c.ep:>4}   (nothing meets the SLO)")
            continue
        print(f"{c.tp:>3} {c.ep:>4} {best['batch'][i]:>12.0f} {best['tpot'][i] * 1e3:>8.2f} {best['technique'][i]:>9} "
              f"{thr:>10.1f} {thr / cost:>10.1f}")  # fmt: skip
    b = cluster_cost(net, cc)
    print("max batch by memory per TP group: " + ", ".join(f"tp{c.tp}/ep{c.ep}: {res.max_batch[Technique.NONE][i]:.0f}"
                                                              for i, c in enumerate(cases)))  # fmt: skip
    print(f"network CapEx share {b.network_capex / b.total_capex * 100:.1f}%")
    return 0


# ---------------------------------------------------------------------------------------------- cost


def _configure_cost(p):
    _network_args(p)
    p.add_argument("--network-cost-factor", type=float, default=1.0)


@command("cost", "cost breakdown of one network", _configure_cost)
def _cost(args) -> int:
    from .cost import CostConfig, cluster_cost, normalized_cost_per_xpu

    net = _network(args)
    with user_input():
        cc = replace(CostConfig(), network_cost_factor=args.network_cost_factor)
    b = cluster_cost(net, cc)
    n = net.num_xpus
    print(f"{net.topology.value}, {n} XPUs, {net.bandwidth / 1e9:g} GB/s per XPU (network cost factor {args.network_cost_factor:g})")
    print(f"{'item':<22}{'cluster $':>14}{'per XPU $':>12}")
    for k in ("xpu_capex", "switch_capex", "copper_capex", "optical_capex", "nic_capex", "node_switch_capex"):
        v = getattr(b, k)
        print(f"{k:<22}{v:>14,.0f}{v / n:>12,.0f}")
    print(f"{'total CapEx':<22}{b.total_capex:>14,.0f}{b.total_capex / n:>12,.0f}")
    print(f"switches: {b.num_switches:g}; power: XPUs {b.xpu_power_w / 1e3:.1f} kW, network {b.network_power_w / 1e3:.2f} kW")
    print(f"per month: CapEx {b.capex_per_month:,.0f} + OpEx {b.opex_per_month:,.0f} = {b.total_per_month:,.0f} $ "
          f"({b.total_per_month / n:,.0f} $ per XPU)")  # fmt: skip
    print(f"normalised cost per XPU (1 = a bare XPU): {normalized_cost_per_xpu(net, cc):.4f}; network share of CapEx "
          f"{b.network_capex / b.total_capex * 100:.1f}%")  # fmt: skip
    return 0


# ------------------------------------------------------------------------------------------ ep-costs


def _configure_ep_costs(p):
    _network_args(p)
    p.add_argument("--ep", type=positive_int, required=True, help="EP ranks: the network's first EP XPUs")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="scale-out: XPUs per node")
    p.add_argument("--node-bandwidth-gbps", type=positive_float, default=450.0,
                   help="scale-out: intra-node (NVLink) bandwidth per XPU, GB/s one direction")  # fmt: skip
    p.add_argument("--out", required=True, help="moe-ep-cost/1 JSON to write")


@command("ep-costs", "per-EP-rank cost matrix of one network (moe-ep-cost/1 JSON)", _configure_ep_costs)
def _ep_costs(args) -> int:
    from .collectives import GB
    from .ep_costs import cost_document, write_cost_document

    net = replace(_network(args), gpus_per_node=args.gpus_per_node, node_bandwidth=args.node_bandwidth_gbps * GB)
    with user_input():
        doc = cost_document(net, args.ep)
        write_cost_document(doc, args.out)
    cost = doc["cost"]
    off = [c for i, row in enumerate(cost) for j, c in enumerate(row) if i != j]
    print(f"{net.topology.value}, {args.ep} EP ranks on {net.num_xpus} XPUs: cost per byte "
          f"{min(off, default=0) * 1e12:.3f}-{max(off, default=0) * 1e12:.3f} ps/byte (link-seconds) -> {args.out}")
    return 0


# --------------------------------------------------------------------------------------------- sweep


def _configure_sweep(p):
    p.add_argument("--out", required=True, help="output directory (sweep.json, summary.txt, *.png)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quick", action="store_true", help="64 XPUs only, fewer bandwidths, no generations")
    p.add_argument("--no-generations", action="store_true", help="skip the Blackwell / Rubin projection")
    p.add_argument("--sizes", type=int_list, help="cluster sizes (default 64,256)")
    p.add_argument("--compare-to", metavar="SWEEP_JSON", help="a sweep to compare the decisions with (decisions.json)")
    _serving_args(p)
    _variant_args(p, defaults=True)
    _constants_args(p)


@command("sweep", "full design-space sweep: JSON, PNG plots, summary table", _configure_sweep)
def _sweep(args) -> int:
    from megatron.common.files import write_json, write_text
    from .collectives import DGX_H100_INTER, DGX_H100_INTRA
    from .cost import CostConfig
    from .sweep import QUICK, SweepConfig, compare_decisions, default_variants, format_decisions, knob_values
    from .sweep import read_sweep, run_sweep, summary_table

    with user_input():
        base = read_sweep(args.compare_to, "--compare-to") if args.compare_to else None

    # the sweep projects the (H100) table to --gpu itself, so load it unprojected
    cfg_serving, table = _serving_cfg(replace_ns(args, gpu="h100"))
    kw = {"generation": args.gpu}
    if args.quick:
        kw.update(QUICK)
    if args.sizes:
        kw["cluster_sizes"] = tuple(args.sizes)
        if 64 not in args.sizes:
            kw["reference_size"] = args.sizes[0]
    if args.no_generations:
        kw["generations"] = ()
    with user_input():  # the knobs, the sizes and the constants
        cfg = SweepConfig(
            variants=default_variants(**knob_values(args.knobs, bigmac_ratio=args.bigmac_ratio, lar=args.lar,
                                                    farskip_overlap=args.farskip_overlap)),
            serving=cfg_serving, cost=replace(CostConfig(), network_cost_factor=args.network_cost_factor),
            constants=_load_constants(args.constants, DGX_H100_INTRA),
            inter_constants=_load_constants(args.inter_constants, DGX_H100_INTER), **kw,
        )  # fmt: skip
    result = run_sweep(cfg, table)
    out = Path(args.out)
    write_json(out / "sweep.json", result)
    text = summary_table(result)
    write_text(out / "summary.txt", text + "\n")
    print(text)
    if base is not None:
        cmp = compare_decisions(base, result)
        write_json(out / "decisions.json", {"base": args.compare_to, **cmp})
        print(format_decisions(cmp))
    if not args.no_plots:
        from .plots import write_plots

        for f in write_plots(result, out):
            print(f"wrote {f}")
    print(f"wrote {out / 'sweep.json'} and {out / 'summary.txt'}")  # the wall time is the summary's
    return 0


# -------------------------------------------------------------------------------- predict / validate

DEFAULT_FIT = Path(__file__).resolve().parent.parent / "examples" / "netsim" / "gloo_netns_fit.json"


def _configure_replay(p):
    p.add_argument("--bench-serve", required=True, metavar="JSON", help="a bench_serve.py --mode serve run "
                   "(.json or .json.gz)")
    p.add_argument("--profile", metavar="JSON", help="scripts/profile_serving_compute.py output for its variants "
                   "(default: <run>.profile.json beside it)")
    p.add_argument("--fit", metavar="JSON", default=str(DEFAULT_FIT),
                   help="netsim fit of this machine's collectives, for the serving loop's control latency "
                   "(default: examples/netsim/gloo_netns_fit.json)")
    p.add_argument("--link-table", metavar="CSV", nargs="+", required=True,
                   help="the run's link calibrated at its rate (scripts/calibrate_link_table.sh: all-to-alls both "
                   "ways and one way after each idle gap, each CSV with its sidecar JSON): every collective costs "
                   "what the link measured for its size, direction and rest (netsim.link_table.LinkTable); a "
                   "tensor-parallel run also needs its all_reduce calibrations")
    p.add_argument("--model-version", metavar="NAME", default=None,
                   help="the replay model's version, e.g. replay/7 to reproduce a result reported with it "
                   "(default: the current one, netsim.replay.MODEL_VERSION)")
    p.add_argument("--json", metavar="OUT", help="write the result here")


@user_input()
def _replay_inputs(args):
    from .link_table import LinkTable
    from .validation import load_fit, profile_path, read_json

    run = read_json(args.bench_serve, "--bench-serve")
    if not isinstance(run, dict) or run.get("schema") not in ("bench_serve/1", "bench_serve/2"):
        raise UserError(f"--bench-serve {args.bench_serve}: not a bench_serve.py JSON (schema bench_serve/1 or /2)")
    if "requests" not in run:
        raise UserError(f"--bench-serve {args.bench_serve}: a summary without the run's requests (the replay needs "
                        "the whole bench_serve.py JSON)")
    path = args.profile or profile_path(args.bench_serve)
    profile = read_json(path, "--profile")
    if not isinstance(profile, dict) or profile.get("schema") != "serving-compute-profile/1":
        raise UserError(f"--profile {path}: not a profile_serving_compute.py JSON")
    return run, profile, load_fit(args.fit), LinkTable.from_calibrations(args.link_table)


def _model_version(args) -> str:
    """The full version string of ``--model-version`` (one line naming the known ones otherwise)."""
    from .replay import model

    try:
        return model(args.model_version).version
    except ValueError as err:
        raise UserError(f"--model-version: {err}") from None


def _fmt_ms(x):
    return "-" if x is None else f"{x * 1e3:.1f}"


@command("predict", "TTFT/TPOT/throughput of a bench_serve run's workload from the model", _configure_replay)
def _predict(args) -> int:
    from megatron.common.files import write_json

    from .validation import predict_run, profile_path

    run, profile, constants, table = _replay_inputs(args)
    version = _model_version(args)
    pred = predict_run(run, profile["variants"], constants, table, version)
    print(f"replay model {version}")
    print(f"{'variant':<12}{'rate':>6}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}{'out tok/s':>11}")
    for v, rates in pred.items():
        for rate, f in rates.items():
            print(f"{v:<12}{rate:>6}{_fmt_ms(f['ttft_p50_s']):>13}{_fmt_ms(f['tpot_p50_s']):>13}"
                  f"{f['output_tokens_per_s']:>11.1f}")
    if args.json:
        write_json(args.json, {"schema": "netsim-predict/1", "bench_serve": args.bench_serve, "fit": args.fit,
                               "profile": args.profile or profile_path(args.bench_serve),
                               "link_table": args.link_table, "model_version": version, "predicted": pred})
        print(f"wrote {args.json}")
    return 0


@command("validate", "predict a bench_serve run and compare with what it measured", _configure_replay)
def _validate(args) -> int:
    from megatron.common.files import write_json

    from .report import format_validation
    from .validation import code_version, predict_run, profile_path, validate_run

    run, profile, constants, table = _replay_inputs(args)
    version = _model_version(args)
    pred = predict_run(run, profile["variants"], constants, table, version)
    res = validate_run(run, pred, version)
    code = code_version()
    print(f"replay model {res['model_version']}, code at git {code}")
    print(format_validation(res))
    if args.json:
        write_json(args.json, {"schema": "netsim-validate/1", "bench_serve": args.bench_serve, "fit": args.fit,
                               "profile": args.profile or profile_path(args.bench_serve),
                               "link_table": args.link_table, "predicted": pred, **res, "code_version": code})
        print(f"wrote {args.json}")
    return 0


def _configure_report(p):
    p.add_argument("validations", nargs="+", metavar="NAME=VALIDATE_JSON",
                   help="a configuration's name and its `validate --json` output (its bench_serve run is read from it)")
    p.add_argument("--goal", type=positive_float, default=0.15, help="the error goal each pooled figure is held to")
    p.add_argument("--pairs", nargs="+", default=[], metavar="BASE:WHATIF",
                   help="what-if pairs among the names given: the change each measured against the change predicted")
    p.add_argument("--json", metavar="OUT", help="write the reports here")


@command("report", "validation errors per configuration with their range over the run's repeats", _configure_report)
def _report(args) -> int:
    from megatron.common.files import write_json

    from .report import configuration_report, format_pairs, format_report, whatif_pair
    from .validation import read_validations

    inputs = read_validations(args.validations)
    reports = [configuration_report(*one) for one in inputs]
    print(format_report(reports, args.goal))
    by_name = {name: validation for name, validation, _ in inputs}
    pairs = []
    for item in args.pairs:
        base, _, whatif = item.partition(":")
        if base not in by_name or whatif not in by_name:
            raise UserError(f"--pairs {item}: expected BASE:WHATIF among the names given ({', '.join(by_name)})")
        pairs.append(whatif_pair(base, by_name[base], whatif, by_name[whatif]))
    if pairs:
        print(format_pairs(pairs))
    if args.json:
        write_json(args.json, {"schema": "netsim-report/1", "goal": args.goal, "configurations": reports,
                               **({"pairs": pairs} if pairs else {})})
        print(f"wrote {args.json}")
    return 0


def _configure_versions(p):
    p.add_argument("validations", nargs="+", metavar="NAME=VALIDATE_JSON",
                   help="each run as `validate --json` wrote it (its run, link table and fit; the profile beside the run)")
    p.add_argument("--json", metavar="OUT", help="write the comparison here")


@command("versions", "every replay model version on the runs given: errors per run and pooled, and the time "
         "accounting", _configure_versions)
def _versions(args) -> int:
    from megatron.common.files import write_json

    from .versions import compare_all, format_versions

    result = compare_all(args.validations)
    print(format_versions(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def replace_ns(ns: argparse.Namespace, **kw) -> argparse.Namespace:
    d = vars(ns).copy()
    d.update(kw)
    return argparse.Namespace(**d)


# ----------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    return COMMANDS.parser()


def main(argv: Optional[list] = None) -> int:
    return COMMANDS.main(sys.argv[1:] if argv is None else argv)

