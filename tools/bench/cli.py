"""``scripts/bench_ep.py``: measure MoE variants over a shaped link, or calibrate collectives.

Benchmark mode: R ranks (one network namespace each, joined through a shaped bridge) run each
requested variant's training step, W warm-up + N measured steps, one launch per variant on the
same link, the whole comparison repeated ``--runs`` times with the variant order rotated by one each
run (``tools.bench.discipline``); the load is sampled between launches and a run taken on a loaded
machine is marked (``--strict``: refused). The command prints a table (medians over the runs with
their range, or at 5 runs or more their 95% bootstrap interval) and writes JSON (``--json``). With
``--target-comm-fraction F`` it first picks the link rate at which the probe variant
(``standard`` if requested, else the first) spends about F of its step in all-to-all.
Calibration mode (``--collectives``): times gloo all_to_all / all_reduce at 2 and 4 ranks over
the link and writes ``op,ranks,bytes,seconds`` (``--csv``) plus a sidecar JSON.

User errors print one line and exit with status 2. See docs/design/measuring-communication.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import itertools
import json
import logging
import math
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from typing import Callable, Optional

from . import netns, peers
from .aggregate import (RUN_FIGURES, format_table, merge_runs, over_runs_stats, ratios_vs, uncontended_comm_fraction,
                        variant_stats)
from .calibration import OPS, default_sizes, run_calibration, write_csv
from .discipline import LoadGate, add_discipline_arguments, format_ci, rotations
from .launcher import LaunchError, launch
from .schema import RankResult, SyntheticOptions, WorkerSpec
from megatron.common.cli import UserError, int_list, nonneg_int, one_line, positive_int
from megatron.common.files import write_json
from .tune import find_rate
from .variant_worker import variant_overrides
from moe_variants import registry
from tools import variants as variant_hooks

__all__ = ["build_parser", "main", "WORKERS", "worker_module_for", "add_model_options", "model_overrides",
           "host_info", "Budget", "script_path"]

log = logging.getLogger("bench_ep")

SYNTHETIC = "synthetic"
MODEL_WORKER = "tools.bench.variant_worker"
WORKERS = {SYNTHETIC: "tools.bench.synthetic_worker"}
OUTPUT_SCHEMA = "bench_ep/2"  # 2: --runs (per_rank[variant][run], runs, over_runs)
# model-size flags passed through to the model worker as config overrides (flag -> field)
MODEL_FLAGS = (
    ("--num-layers", int), ("--hidden-size", int), ("--num-experts", int),
    ("--moe-router-topk", int), ("--moe-ffn-hidden-size", int), ("--seq-length", int),
    ("--micro-batch-size", int), ("--global-batch-size", int), ("--expert-model-parallel-size", int),
)  # fmt: skip


def worker_module_for(variant: str) -> str:
    """The worker module that runs ``variant`` (the model worker for every model variant)."""
    return WORKERS.get(variant, MODEL_WORKER)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_ep.py", description=__doc__.splitlines()[0])
    g = ap.add_argument_group("network")
    g.add_argument("--ranks", type=positive_int, default=2, help="number of ranks (1-4; default 2)")
    g.add_argument("--link-gbit", type=float, default=1.0, help="per-rank link rate, each direction")
    g.add_argument("--link-latency-ms", type=float, default=0.0,
                   help="one-way rank-to-rank latency (needs the netem qdisc)")
    g.add_argument("--shaper", choices=[s.value for s in netns.Shaper], default=netns.Shaper.tbf.value)
    g.add_argument("--no-netns", action="store_true", help="run over unshaped loopback")
    g = ap.add_argument_group("benchmark")
    g.add_argument("--variants", default="standard",
                   help="comma-separated, '+' combines: the registered presets ("
                        + ", ".join(registry.bench_presets()) + "), run-time variants ("
                        + ", ".join(variant_hooks.runtime_names()) + ") and peers (" + ", ".join(peers.names())
                        + ") on the model worker, or synthetic")
    g.add_argument("--warmup", type=nonneg_int, default=2)
    g.add_argument("--steps", type=positive_int, default=10)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where model variants compute: cpu (gloo) or cuda (NCCL, one GPU per rank; the GPU peers "
                        "mcore-latent and mcore-ep-overlap need it)")  # fmt: skip
    g.add_argument("--exact-rss", action="store_true",
                   help="serve allocations of 1 MiB and more by mmap in the ranks (glibc "
                        "MALLOC_MMAP_THRESHOLD_), so peak RSS tracks live tensors instead of heap "
                        "the allocator kept; slower compute, use it to compare memory")  # fmt: skip
    g.add_argument("--json", metavar="PATH", help="write the results here")
    g.add_argument("--target-comm-fraction", type=float, metavar="F",
                   help="first pick the link rate giving the probe variant this all-to-all share")
    g.add_argument("--probe-variant", help="variant the rate search measures (default: standard "
                   "if requested, else the first)")
    g.add_argument("--probe-steps", type=positive_int, default=3)
    g.add_argument("--probe-warmup", type=nonneg_int, default=1)
    g.add_argument("--max-probes", type=positive_int, default=8)
    g.add_argument("--fraction-tol", type=float, default=0.02, help="stop the rate search within this")
    g.add_argument("--timeout-s", type=float, default=1800.0,
                   help="wall-clock limit of the whole command (every launch is killed past it)")
    g.add_argument("--work-dir", help="keep rank logs and results here (default: temporary)")
    g.add_argument("--trace", metavar="DIR", help="write a Chrome trace (chrome://tracing, Perfetto) "
                   "of each model variant's last measured step of the last run per rank into DIR")
    add_discipline_arguments(g, runs_help="one launch per variant and run (--repeats is calibration's)")
    g = ap.add_argument_group("model (passed to the model worker)")
    add_model_options(g)
    variant_hooks.add_bench_arguments(g)
    g = ap.add_argument_group("synthetic worker (--variants synthetic)")
    for f in dataclasses.fields(SyntheticOptions):
        g.add_argument(f"--synthetic-{f.name}", type=positive_int, default=f.default)
    g = ap.add_argument_group("calibration")
    g.add_argument("--collectives", action="store_true", help="time gloo collectives, write a CSV")
    g.add_argument("--csv", metavar="PATH", help="calibration CSV (sidecar JSON: same name, .json)")
    g.add_argument("--calibration-ranks", type=int_list, default=[2, 4])
    g.add_argument("--sizes", type=int_list, help="message sizes in bytes (default 4 KiB..64 MiB, x2)")
    g.add_argument("--ops", default=",".join(OPS))
    g.add_argument("--repeats", type=positive_int, default=10,
                   help="timed calls per size (x 1 MiB/size below 1 MiB, at most 10x)")
    g.add_argument("--gap-ms", type=float, default=0.0,
                   help="idle milliseconds on every rank before each call (the link's shaper refills, as "
                   "between a served step's all-to-alls; default 0: back to back)")
    g.add_argument("--one-way", action="store_true",
                   help="all_to_all with only rank 0 sending (its bytes split evenly; the others keep theirs): "
                   "each link carries one direction, as in a step where one rank holds all the tokens")
    g.add_argument("--cleanup-stale", action="store_true",
                   help="only remove namespaces left by crashed runs, then exit")
    return ap


def add_model_options(group) -> None:
    """``--config``, the model-size flags and ``--set KEY=VALUE`` (read back by ``model_overrides``)."""
    group.add_argument("--config", metavar="YAML", help="model config file")
    for flag, typ in MODEL_FLAGS:
        group.add_argument(flag, type=typ)
    group.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="any other config override (VALUE parsed as JSON when possible)")


def set_overrides(items) -> dict:
    """``--set KEY=VALUE`` items as config overrides (VALUE parsed as JSON when possible)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected KEY=VALUE")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-").replace("-", "_")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def model_overrides(args) -> dict:
    """Config overrides (field -> value) from the options ``add_model_options`` added."""
    out = {}
    for flag, _ in MODEL_FLAGS:
        key = flag[2:].replace("-", "_")
        value = getattr(args, key)
        if value is not None:
            out[key] = value
    out.update(set_overrides(args.set))
    return out


def _variants(args) -> list[str]:
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not names:
        raise UserError("--variants is empty")
    for v in names:
        if not re.fullmatch(r"[a-z0-9][a-z0-9_\-]*(\+[a-z0-9][a-z0-9_\-]*)*", v):  # "+" combines variants
            raise UserError(f"--variants: bad variant name {v!r}")
        if v == "collectives":
            raise UserError("--variants collectives: use --collectives for calibration")
    if len(set(names)) != len(names):
        raise UserError(f"--variants lists a variant twice: {args.variants}")
    for v in names:
        if v != SYNTHETIC:
            variant_overrides(v)  # an unknown preset fails here, before any launch
            reason = peers.refusal(v, args.device, args.ranks)  # a peer's missing GPU/package, likewise
            if reason is not None:
                raise UserError(reason)
        module = worker_module_for(v)
        if importlib.util.find_spec(module) is None:
            raise UserError(f"--variants {v}: worker module {module} is not available in this checkout")
    return names


def host_info() -> dict:
    import torch

    return {
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg_1_5_15": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kernel": platform.release(),
    }


class Budget:
    """The command's wall-clock budget, shared by every launch."""

    def __init__(self, seconds: float):
        if seconds <= 0:
            raise UserError(f"--timeout-s must be > 0, got {seconds}")
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 1.0:
            raise LaunchError(f"--timeout-s {self.seconds:.0f}s spent before the run finished")
        return left


def _run_variant(net, variant, args, overrides, work_dir, tag, budget, warmup, steps,
                 trace: bool = False) -> list[RankResult]:
    run_dir = os.path.join(work_dir, tag)
    options = dataclasses.asdict(_synthetic_options(args)) if variant == SYNTHETIC else {}
    if variant != SYNTHETIC:
        options.update(variant_hooks.bench_options(args, variant))
        options["device"] = args.device
    if args.trace and variant != SYNTHETIC and trace:
        options["trace_dir"] = os.path.abspath(args.trace)
    spec = WorkerSpec(
        variant=variant, output_dir=os.path.join(run_dir, "out"), warmup=warmup, steps=steps,
        seed=args.seed, config_path=os.path.abspath(args.config) if args.config else None,
        overrides=overrides, options=options, num_threads=args.threads,
    )  # fmt: skip
    raw = launch(net, worker_module_for(variant), spec, run_dir, budget.remaining(),
                 extra_env=_worker_env(args, shaped=net.shaped))  # fmt: skip
    results = [RankResult.from_dict(d) for d in raw]
    for r in results:
        r.validate(steps)
    return results


EXACT_RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


# NCCL between ranks in network namespaces: sockets over veth0 only, so the traffic crosses the
# shaped link (no NVLink/PCIe peer-to-peer, no shared memory, no InfiniBand)
NCCL_SHAPED_ENV = {"NCCL_SOCKET_IFNAME": "veth0", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
                   "NCCL_IB_DISABLE": "1"}  # fmt: skip


def _worker_env(args, shaped: bool = False) -> dict:
    """Environment of the rank processes: ``--exact-rss`` fixes glibc's mmap threshold at 1 MiB.

    By default glibc raises the threshold as large blocks are freed, so later blocks come from the
    heap, which it keeps: peak RSS then depends on the order of allocations and frees (a variant
    that splits a tensor in two differently sized halves can show hundreds of MiB more RSS with
    the same live tensors). With a fixed threshold every large block is returned when freed.
    ``--device cuda`` on a shaped link keeps NCCL on the namespace's socket (``NCCL_SHAPED_ENV``).
    """
    env = dict(EXACT_RSS_ENV) if args.exact_rss else {}
    if getattr(args, "device", "cpu") == "cuda" and shaped:
        env.update(NCCL_SHAPED_ENV)
    return env


def _synthetic_options(args) -> SyntheticOptions:
    fields = dataclasses.fields(SyntheticOptions)
    return SyntheticOptions(**{f.name: getattr(args, f"synthetic_{f.name}") for f in fields})


def _benchmark(args, argv, work_dir, budget) -> int:
    variants = _variants(args)
    overrides = model_overrides(args)
    if args.config and not os.path.isfile(args.config):
        raise UserError(f"--config {args.config}: no such file")
    if variants == [SYNTHETIC] and (overrides or args.config):
        log.warning("model options (--config and overrides) are ignored by the synthetic worker")
    probe_variant = args.probe_variant or ("standard" if "standard" in variants else variants[0])
    if args.target_comm_fraction is not None:
        if probe_variant not in variants:
            raise UserError(f"--probe-variant {probe_variant} is not one of --variants")
        probe_peer = peers.get(probe_variant)
        if probe_peer is not None and not probe_peer.measures_a2a_time:
            raise UserError(f"--probe-variant {probe_variant}: its all-to-all times are not measured, so "
                            "the rate search cannot probe it (probe one of ours)")  # fmt: skip
    gate = LoadGate(args.load_threshold, expected=args.ranks * args.threads, strict=args.strict)
    link = netns.LinkSpec(args.link_gbit, args.link_latency_ms, args.shaper)
    host_start = host_info()
    tuning = None
    orders = rotations(variants, args.runs)
    with netns.open_network(args.ranks, link, use_netns=not args.no_netns) as net:
        if args.target_comm_fraction is not None:
            if not net.shaped:
                raise UserError("--target-comm-fraction needs a shaped link (network namespaces, as root); "
                                "it cannot be used with --no-netns or loopback")  # fmt: skip
            counter = itertools.count()
            probes = {}

            def measure(gbit: float) -> float:
                net.set_link(dataclasses.replace(link, gbit=gbit))
                res = _run_variant(net, probe_variant, args, overrides, work_dir, f"probe{next(counter)}",
                                   budget, args.probe_warmup, args.probe_steps)  # fmt: skip
                probes[gbit] = variant_stats(res)
                return uncontended_comm_fraction(probes[gbit])

            result = find_rate(measure, args.target_comm_fraction, start=args.link_gbit,
                               tol=args.fraction_tol, max_probes=args.max_probes, log=print)  # fmt: skip
            tuning = result.as_dict()
            tuning["probe_variant"] = probe_variant
            tuning["fraction_basis"] = "a2a median / (a2a median + compute minimum)"
            tuning["probe_shares"] = _shares(probes.get(result.gbit))
            if not result.converged:
                log.warning("rate search did not converge: %s; using the closest probe", result.message)
            net.set_link(dataclasses.replace(link, gbit=result.gbit))
            print(f"link set to {result.gbit:.4g} Gbit/s (probe comm fraction at the fastest compute {result.fraction:.3f})")
        results = {v: [] for v in variants}  # variant -> per run, the rank results
        runs = []
        load = gate.before("the first run")  # each launch's after-sample is the next one's before-sample
        for r, order in enumerate(orders):
            record = {"run": r, "order": order, "load": {}}
            for variant in order:
                t0 = time.monotonic()
                what = f"run {r + 1} of {variant}"
                res = _run_variant(net, variant, args, overrides, work_dir, f"run{r}-{variant}", budget,
                                   args.warmup, args.steps, trace=r == len(orders) - 1)  # fmt: skip
                record["load"][variant] = gate.after(load, what)
                load = record["load"][variant]["after"]  # the next launch's before-sample
                results[variant].append(res)
                took = time.monotonic() - t0
                mark = "  LOADED: " + "; ".join(record["load"][variant]["reasons"]) if record["load"][variant]["loaded"] else ""
                print(f"run {r + 1}/{len(orders)} {variant}: {args.warmup}+{args.steps} steps on {args.ranks} ranks "
                      f"in {took:.1f}s{mark}")
            runs.append(record)
        network = net.describe()
    per_run = [{v: variant_stats(results[v][r]) for v in variants} for r in range(len(orders))]
    stats = {v: variant_stats(merge_runs(results[v])) for v in variants}
    baseline = "standard" if "standard" in stats else variants[0]
    ratios = ratios_vs(stats, baseline)
    over = over_runs_stats(per_run, baseline, seed=args.seed)
    for rec, run_stats in zip(runs, per_run):
        rec["variants"] = {v: {key: run_stats[v][key]["median"] for key in RUN_FIGURES if key in run_stats[v]}
                           for v in variants}
    loaded = {v: [rec["run"] for rec in runs if rec["load"][v]["loaded"]] for v in variants}
    print()
    print(f"network: {network['mode']}" + (f", {network['link']['gbit']:.4g} Gbit/s per rank link, "
          f"{network['link']['latency_ms']} ms one-way, {network['link']['shaper']}" if network["shaped"] else
          " (UNSHAPED loopback)") + f"; ratios vs {baseline}")  # fmt: skip
    print(format_table(stats, ratios, over if args.runs > 1 else None, loaded))
    if tuning is not None:
        print(achieved_share_line(args.target_comm_fraction, tuning, over.get(probe_variant), probe_variant))
    if args.json:
        write_json(args.json, {
            "schema": OUTPUT_SCHEMA,
            "command": argv,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": {"start": host_start, "end_loadavg_1_5_15": list(os.getloadavg())},
            "config": {
                "ranks": args.ranks, "variants": variants, "warmup": args.warmup, "steps": args.steps,
                "seed": args.seed, "threads": args.threads, "exact_rss": args.exact_rss, "config_path": args.config,
                "device": args.device, "runs": args.runs, "load_threshold": args.load_threshold,
                "strict": args.strict, "load_rule": gate.rule,
                "overrides": overrides,
                "synthetic": dataclasses.asdict(_synthetic_options(args)) if SYNTHETIC in variants else None,
            },
            "network": network,
            "tuning": tuning,
            "baseline": baseline,
            "variants": stats,
            "over_runs": over,
            "ratios": ratios,
            "runs": runs,
            "per_rank": {v: [[r.to_dict() for r in run] for run in results[v]] for v in variants},
        })  # fmt: skip
        print(f"wrote {args.json}")
    return 0


def _shares(stats: Optional[dict]) -> Optional[dict]:
    """The all-to-all shares of one probe's stats (medians), for the tuning record."""
    if stats is None:
        return None
    return {key: stats[key]["median"] for key in ("comm_fraction", "transfer_fraction", "skew_fraction")
            if key in stats}


def achieved_share_line(target: float, tuning: dict, over: Optional[dict], variant: str) -> str:
    """The target share beside what the rate search reached and what the measured runs achieved
    (in flight = transfer + rank-skew wait)."""
    text = (f"all-to-all share of {variant}: target {target:.3f}, rate search {tuning['fraction']:.3f} "
            f"(a2a / (a2a + fastest compute))")
    if over and over.get("comm_fraction"):
        text += f"; measured runs {format_ci(over['comm_fraction'], fmt='{:.3f}')}"
        if over.get("transfer_fraction") and over.get("skew_fraction"):
            text += (f" = transfer {format_ci(over['transfer_fraction'], fmt='{:.3f}')}"
                     f" + skew {format_ci(over['skew_fraction'], fmt='{:.3f}')}")
    return text


def _calibrate(args, argv, work_dir, budget) -> int:
    if not args.csv:
        raise UserError("--collectives needs --csv PATH")
    for r in args.calibration_ranks:
        if not 2 <= r <= netns.MAX_RANKS:
            raise UserError(f"--calibration-ranks: {r} is not between 2 and {netns.MAX_RANKS}")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    sizes = args.sizes or default_sizes()
    for s in sizes:
        if s < 64 or s % 64:
            raise UserError(f"--sizes: {s} is not a positive multiple of 64 bytes")
    if args.one_way and ops != ["all_to_all"]:
        raise UserError("--one-way times all_to_all only: pass --ops all_to_all")
    if not (args.gap_ms >= 0 and math.isfinite(args.gap_ms)):
        raise UserError(f"--gap-ms: {args.gap_ms} is not a finite number >= 0")
    link = netns.LinkSpec(args.link_gbit, args.link_latency_ms, args.shaper)
    host_start = host_info()
    t0 = time.monotonic()
    rows, networks = run_calibration(
        args.calibration_ranks, link, sizes, warmup=args.warmup, repeats=args.repeats,
        use_netns=not args.no_netns, work_dir=work_dir, timeout_s=budget.remaining(), ops=ops,
        num_threads=args.threads, gap_s=args.gap_ms / 1e3, one_way=args.one_way,
    )  # fmt: skip
    write_csv(args.csv, rows)
    sidecar = os.path.splitext(args.csv)[0] + ".json"
    write_json(sidecar, {
        "schema": "bench_ep_collectives/1",
        "command": argv,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "csv": os.path.basename(args.csv),
        "columns": {"op": "all_to_all (all_to_all_single, equal splits) | all_reduce (sum)",
                    "ranks": "number of ranks, one network namespace each",
                    "bytes": "input tensor size per rank (what each rank contributes)",
                    "seconds": "median over repeats of (last rank's exit - last rank's entry) for one call"},
        "link": link.as_dict(), "warmup": args.warmup, "repeats": args.repeats, "gap_s": args.gap_ms / 1e3,
        "one_way": args.one_way, "repeats_rule": "repeats x ceil(1 MiB / bytes), clamped to [repeats, 10 x repeats]",
        "networks": networks, "wall_s": time.monotonic() - t0,
        "host": {"start": host_start, "end_loadavg_1_5_15": list(os.getloadavg())},
        "rows": rows,
    })  # fmt: skip
    print(f"{'op':>10} {'ranks':>5} {'bytes':>10} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'contrib MB/s':>12}")
    for r in rows:
        print(f"{r['op']:>10} {r['ranks']:>5} {r['bytes']:>10} {r['seconds'] * 1e3:>10.3f} "
              f"{r['min_s'] * 1e3:>8.3f} {r['max_s'] * 1e3:>8.3f} {r['bytes'] / r['seconds'] / 1e6:>12.1f}")  # fmt: skip
    print(f"wrote {args.csv} and {sidecar}")
    return 0


def script_path(default: str = "scripts/bench_ep.py") -> str:
    """How the running script is best named in a record: relative to the repository if inside it."""
    from tools import repo_root

    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    root = repo_root()
    if script.startswith(root + os.sep):
        return os.path.relpath(script, root)
    return script or default


def run_harness(prog: str, what: str, work_dir: Optional[str], prefix: str, body: Callable[[str], int]) -> int:
    """The benchmark scripts' outer skeleton (bench_ep, bench_serve): stale namespaces of killed runs
    removed (as root), a work directory (``work_dir`` kept, else a temporary one removed at the end),
    SIGTERM/SIGINT turned into a clean stop, and ``body(work_dir)``'s failures mapped to one line and
    an exit code: a user error (``UserError``) 2, a failed launch 1, Ctrl-C 130, a signal its code;
    anything else keeps its traceback. ``what`` names the
    processes that are stopped (``workers``, ``servers``)."""
    try:
        if os.geteuid() == 0 and shutil.which("ip"):
            netns.cleanup_stale()
        keep = work_dir is not None
        path = os.path.abspath(work_dir or tempfile.mkdtemp(prefix=prefix))
        os.makedirs(path, exist_ok=True)
        try:
            with netns.terminate_on_signals():
                return body(path)
        finally:
            if not keep:
                shutil.rmtree(path, ignore_errors=True)
    except UserError as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"{prog}: launch failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; {what} stopped and namespaces removed", file=sys.stderr)
        return 130
    except netns.Terminated as e:
        print(f"{prog}: terminated by a signal; {what} stopped and namespaces removed", file=sys.stderr)
        return e.code


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    command = ["python", script_path(), *argv]
    if args.cleanup_stale:
        removed = netns.cleanup_stale()
        print(f"removed {len(removed)} stale namespace(s)")
        return 0
    try:
        budget = Budget(args.timeout_s)
    except UserError as e:
        print(f"bench_ep.py: error: {e}", file=sys.stderr)
        return 2

    def body(work_dir: str) -> int:
        if args.collectives:
            return _calibrate(args, command, work_dir, budget)
        return _benchmark(args, command, work_dir, budget)

    return run_harness("bench_ep.py", "workers", args.work_dir, "bench_ep-", body)
