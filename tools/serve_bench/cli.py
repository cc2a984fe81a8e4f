"""``scripts/bench_serve.py``: serve MoE variants over a shaped link and measure them under load.

For each variant the server's ranks (``python -m megatron.inference.serve``, expert parallel over
``--ranks``) run in the EP benchmark's network namespaces, joined by the shaped bridge
(``tools.bench.netns``; ``--no-netns``: loopback), launched by the harness's launcher. A load
client (``tools.serve_bench.client``) runs in rank 0's namespace and talks to rank 0's HTTP front
end on that namespace's loopback, so only the ranks' own traffic (all-to-alls and the serving
loop's control collectives) crosses the shaped link. Variants run one after another on the same
link with the same requests at the same arrival times.

* ``--mode serve`` (default): a warm-up burst, then per ``--request-rates`` rate Poisson arrivals of
  ``--num-requests`` requests (or ``--duration`` seconds), streaming greedy completions of fixed
  ``max_tokens``: TTFT, TPOT and end-to-end latency p50/p90/p99, output tokens/s, requests/s,
  goodput at ``--slo-ttft``/``--slo-tpot``, all-to-all bytes per token and exposed all-to-all time.
* ``--mode prefill``: forward-only throughput at a fixed number of tokens per engine step
  (``--prefill-tokens``, BigMac Fig. 5's setting): bursts of ``--input-len`` prompts with
  ``max_tokens`` 1; prefill tokens/s, the forward's all-to-all share, its Amdahl bound and the
  exposed all-to-all fraction.

The model: ``--load CKPT`` (one checkpoint; variants must keep its parameters: connectivity-only
presets such as ``farskip``), or ``--config YAML`` / the default tiny model trained briefly
(``--train-steps``) with ``pretrain_gpt``, one checkpoint per variant, same seed and data.
Expert placements (Sem-MoE's serving comparison): with ``--load CKPT --semmoe-tables DIR`` the
placed variants (``eplb``, ``affinity-eplb``, ``semmoe``) serve CKPT placed by ``DIR/<variant>`` (tables of
``python -m tools.semmoe solve --method <variant> --ep RANKS``, applied here with ``tools.semmoe apply``); ``semmoe``
also schedules requests by Algorithm 2 (``serve --semmoe-tables``); ``standard`` is CKPT as it is
(megatron-core's contiguous placement, round-robin). Every variant reports its LAR and the expert
load imbalance.
``--target-comm-fraction F`` first searches the link rate (``tools.bench.tune``, as bench_ep)
at which the probe variant's forwards spend F of their time in all-to-all, measured from the
server's ``/metrics`` over a short calibration load.

The whole comparison runs ``--runs`` times (default 3), the variant order rotated by one each run,
every variant's servers restarted each run; the load is sampled between launches and a run taken on
a loaded machine is marked (``--strict``: refused; ``tools.bench.discipline``). Latency percentiles
pool every run's requests; throughputs and speedups are also given per run, as medians over the
runs with their range (at 5 runs or more a 95% bootstrap interval). The servers record each engine
step's all-to-alls (``serve --a2a-spans``), from which the all-to-all share splits into transfer and rank-skew wait.

Prints a table, writes JSON (``--json``, bench_ep's shape) and PNG plots. User errors print one
line and exit 2 before anything is written. See docs/guides/bench-serve.md.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import sys
import time
from typing import Optional

from tools import variants as variant_hooks
from megatron.common.cli import UserError, one_line
from megatron.common.files import write_json
from tools.bench import netns
from tools.bench.cli import Budget, host_info, model_overrides, run_harness, script_path
from tools.bench.discipline import LoadGate, rotations

from . import analysis, resume
from .checkpoints import place, tokenizer_and_context, train
from .loadgen import report
from .options import DEFAULT_NUM_REQUESTS, PROG, build_parser, check_args
from .variant_configs import placed, variant_list
from .phases import phase_requests_for
from .report import Printer, plot_target, prefill_table, serve_table
from .server import Server, engine_settings, tune

__all__ = ["build_parser", "main"]

OUTPUT_SCHEMA = "bench_serve/2"  # 2: --runs (runs, over_runs, requests[variant][phase][run])


def _benchmark(args, argv, work_dir, budget, printer) -> int:
    variants = variant_list(args.variants)
    placements = {v: variant_hooks.serve_placement(v, args) for v in placed(variants)}
    host_start = host_info()
    if args.load:
        checkpoints = {v: args.load for v in variants}
        checkpoints.update(place(args, variants, work_dir, printer))
    else:
        checkpoints = train(args, variants, work_dir, budget, printer)
    tokenizer, context = tokenizer_and_context(checkpoints[variants[0]])
    if args.mode == "prefill" and args.input_len is None:
        args.input_len = 2 ** int(math.log2(min(context - 1, args.prefill_tokens)))
    work = phase_requests_for(args, tokenizer, context)
    probe = (args.probe_variant or ("standard" if "standard" in variants else variants[0])) \
        if args.target_comm_fraction is not None else None
    orders = rotations(sorted(variants, key=lambda v: v != probe), args.runs)  # the probe first: it sets the link
    gate = LoadGate(args.load_threshold, expected=args.ranks * args.threads + 1, strict=args.strict)  # + the client
    link = netns.LinkSpec(args.link_gbit, 0.0, args.shaper)
    phases, tuning, runs = {v: [] for v in variants}, None, []
    with netns.open_network(args.ranks, link, use_netns=not args.no_netns) as net:
        if args.target_comm_fraction is not None and not net.shaped:
            raise UserError("--target-comm-fraction needs a shaped link (network namespaces, as root)")
        load = gate.before("the first run")  # each launch's after-sample is the next one's before-sample
        for r, order in enumerate(orders):
            record = {"run": r, "order": order, "load": {}}
            for variant in order:
                t0 = time.monotonic()
                run_dir = os.path.join(work_dir, f"serve-{variant}-run{r}")
                key = resume.run_key(args, variant, r)
                kept = resume.reuse(run_dir, key) if args.resume else None
                if kept is not None:
                    measured, record["load"][variant] = kept
                    spans = resume.spans_of(os.path.join(run_dir, "a2a_spans"), net.num_ranks)
                    load = None  # the next served run samples its own before-load
                else:
                    load = load or gate.before(f"run {r + 1} of {variant}")
                    placement = placements.get(variant)
                    preset = variant if args.load and placement is None else None
                    with Server(net, args, checkpoints[variant], preset, run_dir, budget, printer, variant,
                                placement) as server:
                        if "warmup" in work["phases"]:
                            server.run({"warmup": work["phases"]["warmup"]}, "warm-up")
                        if variant == probe and r == 0:
                            tuning = tune(server, net, args, work, printer)
                        measured = server.run({k: v for k, v in work["phases"].items() if k != "warmup"}, "load")
                    spans = server.spans()
                    record["load"][variant] = gate.after(load, f"run {r + 1} of {variant}")
                    load = record["load"][variant]["after"]
                    resume.mark_done(run_dir, key, server.last_result, record["load"][variant])
                for p in measured.values():
                    p["a2a_split"] = analysis.phase_split(spans, p["clock_start"], p["clock_end"]) if spans else None
                phases[variant].append(measured)
                mark = record["load"][variant]
                printer.line(f"[{variant}] run {r + 1}/{len(orders)} "
                             + (f"reused from {run_dir}" if kept is not None else
                                f"measured in {time.monotonic() - t0:.0f}s")
                             + (f"  LOADED: {'; '.join(mark['reasons'])}" if mark["loaded"] else ""))
            runs.append(record)
        network = net.describe()

    slo = {"slo_ttft_s": args.slo_ttft, "slo_tpot_s": args.slo_tpot}
    per_run = [{v: _variant_stats(args, phases[v][r:r + 1], slo) for v in variants} for r in range(len(orders))]
    per_variant = {v: _variant_stats(args, phases[v], slo) for v in variants}  # pooled over the runs
    for v in variants:
        per_variant[v]["request_scheduler"] = placements[v].request_scheduler if v in placements else "round-robin"
    if args.mode == "prefill":
        result = {"variants": per_variant, "ratios": analysis.prefill_ratios(per_variant)}
        over = analysis.prefill_over_runs(per_run, variants[0], seed=args.seed)
        for v in variants:
            per_variant[v]["over_runs"] = {k: x for k, x in over[v].items() if not k.endswith("speedup")}
            result["ratios"][v]["over_runs"] = {k: x for k, x in over[v].items() if k.endswith("speedup")}
    else:
        result = report(per_variant)
        over = analysis.serve_over_runs(per_run, variants[0], seed=args.seed)
        for v in variants:
            for rate, figures in over[v].items():
                per_variant[v]["rates"][rate]["over_runs"] = {k: x for k, x in figures.items() if k != "throughput_speedup"}
                result["ratios"][v].setdefault("rates", {}).setdefault(rate, {})["over_runs"] = {
                    "throughput_speedup": figures["throughput_speedup"]}
        for v, rates in analysis.serve_bounds(per_variant, result["ratios"]).items():
            for rate, bound in rates.items():
                result["ratios"][v].setdefault("rates", {}).setdefault(rate, {}).update(bound)
    for rec, stats in zip(runs, per_run):
        rec["variants"] = {v: _run_figures(args.mode, stats[v]) for v in variants}
    model = {"load": os.path.abspath(args.load)} if args.load else \
        {"config": args.config, "overrides": model_overrides(args), "train_steps": args.train_steps}
    result = {
        "schema": OUTPUT_SCHEMA,
        "command": argv,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"start": host_start, "end_loadavg_1_5_15": list(os.getloadavg())},
        "mode": args.mode,
        "config": {
            "ranks": args.ranks, "expert_model_parallel_size": args.serve_ep,
            "tensor_model_parallel_size": args.tensor_model_parallel_size, "expert_comm": args.expert_comm,
            "variants": variants, "seed": args.seed,
            **variant_hooks.serve_bench_record(args),
            "threads": args.threads, "model": model, "checkpoints": checkpoints, "server": engine_settings(args),
            "workload": {**work["info"],
                         "request_rates": [f"{r:g}" for r in args.request_rates] if args.mode == "serve" else None,
                         "num_requests": None if args.mode == "prefill" or args.duration is not None
                         else (args.num_requests or DEFAULT_NUM_REQUESTS), "duration_s": args.duration,
                         "input_len": args.input_len, "output_len": args.output_len,
                         "max_output_len": args.max_output_len, "warmup_requests": args.warmup_requests,
                         "prefill_tokens": args.prefill_tokens if args.mode == "prefill" else None,
                         "prefill_batches": args.prefill_batches if args.mode == "prefill" else None,
                         "prefill_repeats": args.prefill_repeats if args.mode == "prefill" else None},
            "slo": slo,
            "runs": args.runs, "load_threshold": args.load_threshold, "strict": args.strict, "load_rule": gate.rule,
        },
        "network": network,
        "tuning": tuning,
        "baseline": variants[0],
        "variants": result["variants"],
        "ratios": result["ratios"],
        "runs": runs,
        "requests": {v: {name: [run[name]["requests"] for run in phases[v]] for name in phases[v][0]} for v in variants},
    }
    loaded = {v: [rec["run"] for rec in runs if rec["load"][v]["loaded"]] for v in variants}
    print()
    print(f"network: {network['mode']}" + (f", {network['link']['gbit']:.4g} Gbit/s per rank link, "
          f"{network['link']['shaper']}" if network["shaped"] else " (UNSHAPED loopback)") +
          f"; {args.ranks} ranks (EP {args.serve_ep}, TP {args.tensor_model_parallel_size}"
          f"{', experts summed by all-reduce' if args.expert_comm == 'allreduce' else ''}); "
          f"ratios vs {variants[0]}")
    print(prefill_table(result, loaded) if args.mode == "prefill" else serve_table(result, loaded))
    if tuning is not None:
        print(achieved_share(args.target_comm_fraction, tuning, result, probe))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    target = plot_target(args)
    if target is not None:
        from .plots import write_plots

        for path in write_plots(result, *target):
            print(f"wrote {path}")
    return 0


def _variant_stats(args, runs: list, slo: dict) -> dict:
    """One variant's statistics over the phases of ``runs`` (a list of ``{phase name: phase}``, one
    per run): prefill bursts pooled as repeats; serving rates each pooled over the runs."""
    if args.mode == "prefill":
        out = analysis.prefill_stats([p for run in runs for p in run.values()])
        out["load_imbalance"] = analysis.load_imbalance(analysis.sum_load(
            [analysis.device_load(p["metrics_before"], p["metrics_after"]) for run in runs for p in run.values()]))
        return out
    per_rate = {name.split("-", 1)[1]: analysis.serve_stats([run[name] for run in runs], **slo) for name in runs[0]}
    for rate, s in per_rate.items():
        s["offered_rate"] = float(rate) if math.isfinite(float(rate)) else None  # inf: all at once
    return analysis.pooled_serve_stats(per_rate, {f"{name}#{r}": p for r, run in enumerate(runs)
                                                  for name, p in run.items()}, **slo)


def _run_figures(mode: str, stats: dict) -> dict:
    """One run's headline figures of a variant (the JSON's ``runs[].variants``)."""
    if mode == "prefill":
        return {k: (stats.get(k) or {}).get("median") for k in analysis.PREFILL_SUMMARIZED}
    return {rate: {f: analysis.run_figure(s, f) for f in analysis.SERVE_FIGURES} for rate, s in stats["rates"].items()}


def achieved_share(target: float, tuning: dict, result: dict, probe: str) -> str:
    """The target all-to-all share beside the rate search's and the measured one (in flight =
    transfer + rank-skew wait, shares of the engine's busy time, pooled over runs and rates)."""
    s = result["variants"][probe]

    def med(x):
        return x.get("median") if isinstance(x, dict) else x

    share, transfer, skew = med(s["a2a_fraction"]), med(s.get("transfer_fraction")), med(s.get("skew_fraction"))
    text = (f"all-to-all share of {probe}: target {target:.3f}, rate search {tuning['fraction']:.3f} "
            f"(a2a / (a2a + fastest compute))")
    if share is not None:
        text += f"; measured {share:.3f}"
        if transfer is not None and skew is not None:
            text += f" = transfer {transfer:.3f} + skew {skew:.3f}"
    return text


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # upstream's import-time INFO lines stay quiet
    args = build_parser().parse_args(argv)
    command = ["python", script_path("scripts/bench_serve.py"), *argv]
    try:
        check_args(args)
        budget = Budget(args.timeout_s)
    except UserError as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 2
    return run_harness(PROG, "servers", args.work_dir, "bench_serve-",
                       lambda work_dir: _benchmark(args, command, work_dir, budget, Printer()))
