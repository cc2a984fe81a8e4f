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
variants ``eplb`` and ``semmoe`` serve CKPT placed by ``DIR/eplb`` resp. ``DIR/semmoe`` (tables of
``python -m tools.semmoe solve --ep RANKS``, applied here with ``tools.semmoe apply``); ``semmoe``
also schedules requests by Algorithm 2 (``serve --semmoe-tables``); ``standard`` is CKPT as it is
(megatron-core's contiguous placement, round-robin). Every variant reports its LAR and the expert
load imbalance.
``--target-comm-fraction F`` first searches the link rate (``tools.bench.tune``, as bench_ep)
at which the probe variant's forwards spend F of their time in all-to-all, measured from the
server's ``/metrics`` over a short calibration load.

Prints a table, writes JSON (``--json``, bench_ep's shape) and PNG plots. User errors print one
line and exit 2 before anything is written. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from typing import Optional

from moe_variants.common.cli import float_list, nonneg_int, positive_float, positive_int
from moe_variants.common.files import write_json
from tools.bench import netns
from tools.bench.aggregate import format_rows
from tools.bench.cli import Budget, add_model_options, host_info, model_overrides, run_harness, script_path
from tools.bench.launcher import LaunchError, start_ranks
from tools.bench.tune import find_rate

from . import analysis, workload
from .client import ClientSpec
from .loadgen import load_prompt_pairs, report

__all__ = ["build_parser", "main"]

log = logging.getLogger("bench_serve")

PROG = "bench_serve.py"
OUTPUT_SCHEMA = "bench_serve/1"
SERVE_MODULE = "megatron.inference.serve"
CLIENT_MODULE = "tools.serve_bench.client"
TRAIN_MODULE = "megatron.training.pretrain_gpt"
DEFAULT_NUM_REQUESTS = 32
_STARTUP_TIMEOUT_S = 900.0
_SHUTDOWN_TIMEOUT_S = 30.0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("network")
    g.add_argument("--ranks", type=positive_int, default=2, help="server ranks = expert-parallel size (1-4; default 2)")
    g.add_argument("--link-gbit", type=float, default=1.0, help="per-rank link rate, each direction (the rate "
                   "search's start with --target-comm-fraction)")
    g.add_argument("--shaper", choices=[s.value for s in netns.Shaper], default=netns.Shaper.tbf.value)
    g.add_argument("--no-netns", action="store_true", help="run over unshaped loopback")
    g.add_argument("--target-comm-fraction", type=float, metavar="F",
                   help="first pick the link rate giving the probe variant's forwards this all-to-all share")
    g.add_argument("--probe-variant", help="variant the rate search measures (default: standard if requested, "
                   "else the first)")
    g.add_argument("--probe-rounds", type=positive_int, default=3,
                   help="calibration bursts per probe (prefill: one full step per rank; serve: --ranks x 4 requests)")
    g.add_argument("--max-probes", type=positive_int, default=8)
    g.add_argument("--fraction-tol", type=float, default=0.02, help="stop the rate search within this")
    g = ap.add_argument_group("model")
    g.add_argument("--load", metavar="CKPT", help="serve this checkpoint (variants: presets that keep its parameters)")
    add_model_options(g)
    g.add_argument("--semmoe-tables", metavar="DIR", help="with --load: DIR/eplb and DIR/semmoe hold tables "
                   "(tools.semmoe solve --ep RANKS) for the variants eplb and semmoe (placed checkpoints; semmoe "
                   "also schedules requests by Algorithm 2)")
    g.add_argument("--train-steps", type=positive_int, default=30,
                   help="with --config (or the default model): training steps per variant's checkpoint")
    g.add_argument("--variants", default="standard", help="comma-separated registry presets (standard, bigmac, "
                   "farskip, farskip-simple, ...; '+' combines)")
    g.add_argument("--seed", type=int, default=1234, help="training, prompt order, arrivals")
    g.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    g = ap.add_argument_group("load")
    g.add_argument("--mode", choices=["serve", "prefill"], default="serve")
    g.add_argument("--request-rates", type=float_list, default=[1.0, 2.0, 4.0], help="requests/s, comma-separated "
                   "(inf: all at once)")
    g.add_argument("--num-requests", type=positive_int, default=None,
                   help=f"requests per rate (default {DEFAULT_NUM_REQUESTS})")
    g.add_argument("--duration", type=positive_float, default=None, help="seconds of arrivals per rate, instead "
                   "of --num-requests")
    g.add_argument("--prompts", metavar="FILE", help="JSONL with a 'text' field, or ShareGPT JSON (default: "
                   "windows of the embedded corpus, which need --input-len)")
    g.add_argument("--input-len", type=positive_int, help="prompt tokens (prompts are cut or repeated to it; "
                   "--mode prefill default: the largest power of two below the model's context and "
                   "--prefill-tokens)")
    g.add_argument("--output-len", type=positive_int, help="output tokens per request (default: the prompt file's "
                   "answer length, else --max-output-len)")
    g.add_argument("--max-output-len", type=positive_int, default=64, help="cap on output tokens (default 64)")
    g.add_argument("--warmup-requests", type=nonneg_int, default=4, help="unrecorded burst before the rates")
    g.add_argument("--slo-ttft", type=positive_float, help="goodput SLO on time to first token, seconds")
    g.add_argument("--slo-tpot", type=positive_float, help="goodput SLO on time per output token, seconds")
    g.add_argument("--prefill-tokens", type=positive_int, default=512,
                   help="--mode prefill: tokens per engine step per rank (a multiple of 64 avoids padding)")
    g.add_argument("--prefill-batches", type=positive_int, default=8,
                   help="--mode prefill: full steps per rank in each measured burst")
    g.add_argument("--prefill-repeats", type=positive_int, default=3,
                   help="--mode prefill: measured bursts (throughputs are medians over them)")
    g = ap.add_argument_group("server")
    g.add_argument("--max-batch-tokens", type=positive_int, default=512, help="--mode serve: tokens per engine step")
    g.add_argument("--max-requests", type=positive_int, default=16, help="--mode serve: requests decoding at once "
                   "per rank")
    g.add_argument("--kv-cache-gb", type=positive_float, default=0.25, help="KV-cache buffer per rank")
    g.add_argument("--routing-stats", action=argparse.BooleanOptionalAction, default=True,
                   help="servers count local activations and expert load (serve --routing-stats: the LAR and "
                        "imbalance columns); --no-routing-stats serves as the server's default does")
    g = ap.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write the results here")
    g.add_argument("--plots", metavar="DIR", help="PNG plots here (default: beside --json)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--work-dir", help="keep checkpoints, logs and raw results here (default: temporary); a "
                   "checkpoint trained there with the same settings is reused")
    g.add_argument("--timeout-s", type=float, default=3600.0, help="wall-clock limit of the whole command")
    return ap


# ------------------------------------------------------------------------------------ validation


PLACED = ("eplb", "semmoe")  # variants that serve --load placed by --semmoe-tables DIR/<name>


def _variants(text: str, tables: Optional[str] = None) -> list:
    from moe_variants import registry

    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise ValueError("--variants is empty")
    if len(set(names)) != len(names):
        raise ValueError(f"--variants lists a variant twice: {text}")
    for v in names:
        if v in PLACED:
            if tables is None:
                raise ValueError(f"--variants {v}: give --load CKPT and --semmoe-tables DIR (DIR/{v} holds the "
                                 "placement's tables)")
            continue
        if any(p in v.split("+") for p in PLACED):
            raise ValueError(f"--variants {v}: placed variants ({', '.join(PLACED)}) do not combine with others")
        registry.preset_overrides(v)  # an unknown preset fails here
    return names


def _check_tables(args, variants: list) -> None:
    """``--semmoe-tables DIR``: DIR/<variant> are tables for --load's experts at D = --ranks."""
    from moe_variants.semmoe.placement import moe_shape
    from moe_variants.semmoe.tables import load_tables
    from megatron.training.checkpointing import find_latest_checkpoint, read_manifest

    if not args.load:
        raise ValueError("--semmoe-tables places the experts of --load CKPT: give --load")
    if not os.path.isdir(args.semmoe_tables):
        raise ValueError(f"--semmoe-tables {args.semmoe_tables}: no such directory")
    placed = [v for v in variants if v in PLACED]
    if not placed:
        raise ValueError("--semmoe-tables: --variants names neither eplb nor semmoe")
    manifest = read_manifest(find_latest_checkpoint(args.load), verify=False)
    layers, experts = moe_shape(manifest, args.load)
    for v in placed:
        path = os.path.join(args.semmoe_tables, v)
        if not os.path.isdir(path):
            raise ValueError(f"--semmoe-tables {args.semmoe_tables}: no {v}/ tables directory in it "
                             f"(python -m tools.semmoe solve --method {v} --ep {args.ranks} --out {path})")
        try:
            tables = load_tables(path)
        except ValueError as err:
            raise ValueError(f"--semmoe-tables {path}: {str(err).splitlines()[0]}") from None
        if (tables.num_layers, tables.num_experts, tables.num_devices) != (layers, experts, args.ranks):
            raise ValueError(f"--semmoe-tables {path}: tables for {tables.num_layers} MoE layers x "
                             f"{tables.num_experts} experts on {tables.num_devices} devices; --load has "
                             f"{layers} x {experts} and --ranks is {args.ranks}")
        if v == "semmoe" and not tables.has_schedule:
            raise ValueError(f"--semmoe-tables {path}: tables of method {tables.method!r} carry no token table "
                             "(solve with --method semmoe)")


def _check_args(args) -> None:
    """Everything that can be checked before any process starts or any file is written."""
    variants = _variants(args.variants, args.semmoe_tables)
    if args.load and (args.config or model_overrides(args)):
        raise ValueError("--load serves a checkpoint as it is: drop --config and the model overrides")
    if args.config and not os.path.isfile(args.config):
        raise ValueError(f"--config {args.config}: no such file")
    if args.load:
        from megatron.training.checkpointing import CheckpointError, find_latest_checkpoint

        try:
            if find_latest_checkpoint(args.load) is None:
                raise ValueError(f"--load {args.load}: no complete checkpoint found")
        except CheckpointError as err:
            raise ValueError(str(err)) from None
    if not 1 <= args.ranks <= netns.MAX_RANKS:
        raise ValueError(f"--ranks must be between 1 and {netns.MAX_RANKS}, got {args.ranks}")
    netns.LinkSpec(args.link_gbit, 0.0, args.shaper)  # validates the rate
    if args.target_comm_fraction is not None:
        if not 0 < args.target_comm_fraction < 1:
            raise ValueError(f"--target-comm-fraction must be in (0, 1), got {args.target_comm_fraction}")
        if args.no_netns:
            raise ValueError("--target-comm-fraction needs a shaped link (network namespaces, as root); it cannot "
                             "be used with --no-netns")
        ok, why = netns.netns_available()
        if not ok:
            raise ValueError(f"--target-comm-fraction needs a shaped link: {why}")
    if args.probe_variant and args.probe_variant not in variants:
        raise ValueError(f"--probe-variant {args.probe_variant} is not one of --variants")
    if args.num_requests is not None and args.duration is not None:
        raise ValueError("give --num-requests or --duration, not both")
    if args.mode == "serve":
        if not args.request_rates:
            raise ValueError("--request-rates is empty")
        for r in args.request_rates:
            if not r > 0:
                raise ValueError(f"--request-rates: rates must be > 0, got {r:g}")
        if len(set(args.request_rates)) != len(args.request_rates):
            raise ValueError("--request-rates lists a rate twice")
        if args.duration is not None and any(math.isinf(r) for r in args.request_rates):
            raise ValueError("--duration needs finite --request-rates")
        if args.prompts is None and args.input_len is None:
            raise ValueError("give --prompts FILE or --input-len (with --output-len) for the requests")
        if args.max_batch_tokens < args.max_requests:
            raise ValueError(f"--max-batch-tokens ({args.max_batch_tokens}) must be >= --max-requests "
                             f"({args.max_requests})")
    else:
        if args.input_len is not None and args.input_len > args.prefill_tokens:
            raise ValueError(f"--input-len {args.input_len} is longer than --prefill-tokens {args.prefill_tokens}")
    if args.prompts is not None:
        load_prompt_pairs(args.prompts)  # readable and parseable, or a one-line error
    for flag in ("json",):
        path = getattr(args, flag)
        if path and os.path.isdir(path):
            raise ValueError(f"--{flag} {path}: is a directory, expected a file path")
    if args.plots and os.path.isfile(args.plots):
        raise ValueError(f"--plots {args.plots}: is a file, expected a directory")
    if args.timeout_s <= 0:
        raise ValueError(f"--timeout-s must be > 0, got {args.timeout_s}")
    if args.semmoe_tables is not None:
        _check_tables(args, variants)
    if args.load:
        _check_load_variants(args.load, [v for v in variants if v not in PLACED])  # last: builds meta models


# --------------------------------------------------------------------------------- checkpoints


def _check_load_variants(ckpt: str, variants: list) -> None:
    """With ``--load``, every variant must keep the checkpoint's parameters (built on the meta device)."""
    from megatron.training.arguments import configs_to_dict
    from megatron.training.loading import checkpoint_configs
    from moe_variants import registry

    base = configs_to_dict(checkpoint_configs(ckpt)[0])
    changing = [v for v in variants
                if configs_to_dict(checkpoint_configs(ckpt, registry.preset_overrides(v))[0]) != base]
    if not changing:
        return
    from megatron import compat
    from megatron.training.loading import parameter_changes
    from megatron.training.parallel import initialize_parallel, single_process_group
    from moe_variants.config import ParallelConfig

    compat.apply()
    with single_process_group():
        initialize_parallel(ParallelConfig(), seed=0)
        for v in changing:
            changes = parameter_changes(ckpt, registry.preset_overrides(v))
            if changes:
                raise ValueError(f"--load with --variants {v}: {v} changes the parameters of {ckpt} ({len(changes)} "
                                 f"tensors, e.g. {changes[0]}); only connectivity-only variants (e.g. farskip, "
                                 "farskip-simple) run on another variant's checkpoint: train one checkpoint per "
                                 "variant with --config instead")


def _train_config(args, variant: str, save: str) -> dict:
    from megatron.training.arguments import load_yaml
    from moe_variants import registry

    values = load_yaml(args.config) if args.config else {}
    values.update(model_overrides(args))
    values.setdefault("expert_model_parallel_size", args.ranks)
    values.setdefault("transformer_impl", "local")
    values.update(registry.preset_overrides(variant))
    for key in ("load", "tensorboard_dir", "wandb_project"):
        values.pop(key, None)
    values.update(seed=args.seed, train_iters=args.train_steps, save=save, save_interval=args.train_steps,
                  eval_interval=0, log_interval=max(1, args.train_steps // 5))
    return values


def _finished(marker: str, key: dict) -> bool:
    """Whether a work-directory product (a trained or placed checkpoint) can be reused: its
    ``marker`` JSON, written last when the product was complete, equals ``key``."""
    try:
        with open(marker) as f:
            return json.load(f) == key
    except (OSError, ValueError):
        return False


def _train(args, variants, work_dir, budget, printer) -> dict:
    """One checkpoint per variant, trained with ``pretrain_gpt`` on loopback (same seed, same data);
    a checkpoint already in the work directory with the same settings is reused."""
    from megatron.training.checkpointing import find_latest_checkpoint

    out = {}
    for variant in variants:
        run_dir = os.path.join(work_dir, f"train-{variant}")
        save = os.path.join(run_dir, "ckpt")
        values = _train_config(args, variant, save)
        config_path = os.path.join(run_dir, "config.json")
        if _finished(config_path, values) and find_latest_checkpoint(save) is not None:
            printer.line(f"[{variant}] reusing the checkpoint in {save}")
            out[variant] = save
            continue
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        write_json(config_path + ".run",
                   dict(values, data_cache_path=values.get("data_cache_path") or os.path.join(run_dir, "data_cache")))
        t0 = time.monotonic()
        printer.line(f"[{variant}] training {args.train_steps} steps on {args.ranks} ranks (loopback) ...")
        net = netns.LoopbackNetwork(args.ranks, "training")
        with start_ranks(net, ["-m", TRAIN_MODULE, "--config", config_path + ".run"], run_dir,
                         num_threads=args.threads) as ranks:
            ranks.wait(budget.remaining())
        if find_latest_checkpoint(save) is None:
            raise LaunchError(f"training {variant} left no checkpoint in {save}")
        write_json(config_path, values)  # written last: it marks the checkpoint as complete for reuse
        printer.line(f"[{variant}] trained in {time.monotonic() - t0:.0f}s")
        out[variant] = save
    return out


def _place(args, variants, work_dir, printer) -> dict:
    """``--semmoe-tables``: the placed checkpoint of each placed variant (``tools.semmoe apply`` into
    the work directory; one placed there from the same checkpoint and tables is reused)."""
    import subprocess

    from tools import repo_root

    out = {}
    for v in variants:
        if v not in PLACED:
            continue
        tables = os.path.abspath(os.path.join(args.semmoe_tables, v))
        run_dir = os.path.join(work_dir, f"placed-{v}")
        ckpt, marker = os.path.join(run_dir, "ckpt"), os.path.join(run_dir, "placed.json")
        key = {"load": os.path.abspath(args.load), "tables": tables}
        if _finished(marker, key):
            printer.line(f"[{v}] reusing the placed checkpoint in {ckpt}")
            out[v] = ckpt
            continue
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        printer.line(f"[{v}] placing the experts of {args.load} by {tables} ...")
        proc = subprocess.run([sys.executable, "-m", "tools.semmoe", "apply", "--load", args.load, "--tables", tables,
                               "--out", ckpt], capture_output=True, text=True, cwd=repo_root(),
                              env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
        if proc.returncode != 0:
            raise LaunchError(f"tools.semmoe apply failed for {v}:\n{proc.stderr[-2000:]}")
        write_json(marker, key)  # written last: marks the placed checkpoint as complete for reuse
        out[v] = ckpt
    return out


# ------------------------------------------------------------------------------------- workload


def _tokenizer_and_context(ckpt: str):
    from megatron.training.loading import checkpoint_configs, load_tokenizer

    configs, manifest, path = checkpoint_configs(ckpt)
    return load_tokenizer(manifest, path), int(configs.model.seq_length)


def _workload(args, tokenizer, context: int) -> dict:
    """The requests of every phase (identical for every variant)."""
    tokenize = tokenizer.tokenize
    info = {"context": context}
    if args.mode == "prefill":
        per_step = math.ceil(args.prefill_tokens / args.input_len)
        num = args.ranks * per_step * args.prefill_batches
        probe_num = args.ranks * per_step
        total = num * args.prefill_repeats + probe_num * (args.probe_rounds + 1)
        reqs, info = _base_requests(args, tokenize, context, total, output_len=1, info=info)
        chunks = iter([reqs[i:i + num] for i in range(0, num * args.prefill_repeats, num)])
        rest = reqs[num * args.prefill_repeats:]
        phases = {"warmup": workload.phase_requests(rest[:probe_num], [0.0] * probe_num)}
        for k in range(args.prefill_repeats):
            phases[f"prefill-{k}"] = workload.phase_requests(next(chunks), [0.0] * num)
        probes = [workload.phase_requests(rest[probe_num * (k + 1):probe_num * (k + 2)], [0.0] * probe_num)
                  for k in range(args.probe_rounds)]
        info.update(requests_per_step=per_step, measured_requests=num)
        return {"phases": phases, "probes": probes, "info": info}
    arrivals = {}
    for k, rate in enumerate(args.request_rates):
        num = None if args.duration is not None else (args.num_requests or DEFAULT_NUM_REQUESTS)
        arrivals[rate] = workload.arrivals_for(rate, args.seed + 1 + k, num=num, duration_s=args.duration)
    longest = max([len(a) for a in arrivals.values()] + [args.warmup_requests, args.ranks * 4])
    reqs, info = _base_requests(args, tokenize, context, longest, output_len=args.output_len, info=info)
    phases = {}
    if args.warmup_requests:
        warm = [dataclasses.replace(r, max_tokens=min(r.max_tokens, 8)) for r in reqs[:args.warmup_requests]]
        phases["warmup"] = workload.phase_requests(warm, [0.0] * len(warm))
    for rate, times in arrivals.items():
        phases[f"rate-{rate:g}"] = workload.phase_requests(reqs, times)
    probe = [dataclasses.replace(r, max_tokens=min(r.max_tokens, 32)) for r in reqs[:args.ranks * 4]]
    probes = [workload.phase_requests(probe, [0.0] * len(probe)) for _ in range(args.probe_rounds)]
    info["output_tokens_mean"] = sum(r.max_tokens for r in reqs) / len(reqs)
    info["prompt_tokens_mean"] = sum(len(r.prompt) for r in reqs) / len(reqs)
    return {"phases": phases, "probes": probes, "info": info}


def _base_requests(args, tokenize, context, num, *, output_len, info):
    from megatron.training.tokenizer import DEFAULT_CORPUS

    if args.prompts:
        reqs, stats = workload.from_prompts(load_prompt_pairs(args.prompts), tokenize, num=num, context=context,
                                            seed=args.seed, input_len=args.input_len, output_len=output_len,
                                            max_output_len=min(args.max_output_len, context - 1))
        info.update(source=args.prompts, **stats)
        return reqs, info
    with open(DEFAULT_CORPUS, encoding="utf-8") as f:
        text = f.read(200_000)
    out_len = output_len or min(args.max_output_len, context - args.input_len)
    reqs = workload.from_corpus(text, tokenize, num=num, input_len=args.input_len, output_len=out_len,
                                context=context, seed=args.seed)
    info.update(source="embedded corpus (tiny-shakespeare) windows")
    return reqs, info


# ---------------------------------------------------------------------------------- running


class _Printer:
    """Log lines and the one-line progress display (redrawn in place on a terminal, else a line
    every 15 s)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.width = 0
        self.last = 0.0

    def line(self, text: str) -> None:
        self.clear()
        print(text, file=self.stream, flush=True)

    def progress(self, text: str, force: bool = False) -> None:
        if self.tty:
            self.stream.write("\r" + text.ljust(self.width))
            self.stream.flush()
            self.width = len(text)
        elif force or time.monotonic() - self.last >= 15.0:
            print(text, file=self.stream, flush=True)
            self.last = time.monotonic()

    def clear(self) -> None:
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


class _Server:
    """One variant's server ranks in the network (a context manager: SIGTERM, drain, exit)."""

    def __init__(self, net, args, ckpt: str, preset: Optional[str], run_dir: str, budget: Budget, printer,
                 label: str, extra: tuple = ()):
        self.net, self.args, self.run_dir, self.budget, self.printer, self.label = \
            net, args, run_dir, budget, printer, label
        self.ready_file = os.path.join(run_dir, "ready.json")
        if args.mode == "prefill":
            max_batch = args.prefill_tokens
            max_requests = math.ceil(args.prefill_tokens / args.input_len) + 1
        else:
            max_batch, max_requests = args.max_batch_tokens, args.max_requests
        self.engine = {"max_batch_tokens": max_batch, "max_requests": max_requests, "kv_cache_gb": args.kv_cache_gb}
        self.argv = ["-m", SERVE_MODULE, "--load", os.path.abspath(ckpt), "--expert-model-parallel-size",
                     str(args.ranks), "--host", "127.0.0.1", "--port", "0", "--ready-file", self.ready_file,
                     "--max-batch-tokens", str(max_batch), "--max-requests", str(max_requests),
                     "--kv-cache-gb", str(args.kv_cache_gb), "--seed", str(args.seed),
                     "--shutdown-timeout", str(_SHUTDOWN_TIMEOUT_S)]
        if args.routing_stats:
            self.argv.append("--routing-stats")
        if preset:
            self.argv += ["--variant", preset]
        self.argv += list(extra)
        self.ranks = None
        self.url = None
        self._tags = itertools.count()

    def __enter__(self) -> "_Server":
        shutil.rmtree(self.run_dir, ignore_errors=True)  # a kept --work-dir holds the last run's ready file
        os.makedirs(self.run_dir)
        self.ranks = start_ranks(self.net, self.argv, self.run_dir, num_threads=self.args.threads,
                                 log_prefix="server")
        try:
            deadline = time.monotonic() + _STARTUP_TIMEOUT_S
            t0 = time.monotonic()
            while not os.path.exists(self.ready_file):
                self.ranks.check()
                self.budget.remaining()
                if time.monotonic() > deadline:
                    raise LaunchError(f"the server did not start in {_STARTUP_TIMEOUT_S:.0f}s\n"
                                      f"{self.ranks.log_tail(0)}")
                self.printer.progress(f"[{self.label}] starting {self.net.num_ranks} server ranks "
                                      f"({time.monotonic() - t0:.0f}s)")
                time.sleep(0.2)
            with open(self.ready_file) as f:
                self.url = json.load(f)["url"]
        except BaseException:
            self.ranks.kill()
            raise
        self.printer.line(f"[{self.label}] serving on {self.url} inside rank 0's "
                          f"{'namespace' if self.net.shaped else 'host'} ({time.monotonic() - t0:.0f}s to start)")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.ranks.kill()
            return
        self.ranks.signal(signal.SIGTERM)
        try:
            self.ranks.wait(_SHUTDOWN_TIMEOUT_S + 30)
        except LaunchError as err:
            log.warning("[%s] the server did not stop cleanly: %s", self.label, str(err).splitlines()[0])
        finally:
            self.ranks.kill()

    def run(self, phases: dict, what: str) -> dict:
        """Run the load client on ``phases`` (name -> requests) in rank 0's namespace; its result."""
        tag = f"client{next(self._tags)}"
        spec = ClientSpec(url=self.url, phases=[{"name": n, "requests": r} for n, r in phases.items()],
                          result_path=os.path.join(self.run_dir, f"{tag}-result.json"),
                          progress_path=os.path.join(self.run_dir, f"{tag}-progress.json"))
        spec_path = os.path.join(self.run_dir, f"{tag}-spec.json")
        spec.write(spec_path)
        with start_ranks(self.net, ["-m", CLIENT_MODULE, spec_path], self.run_dir,
                         endpoints=[self.net.endpoints[0]], log_prefix=f"{tag}-") as client:
            while client.running():
                self.ranks.check()
                self.budget.remaining()
                self._show(spec.progress_path, what)
                time.sleep(0.5)
            client.wait(10.0)
        self._show(spec.progress_path, what, force=True)
        self.printer.clear()
        with open(spec.result_path) as f:
            return {p["name"]: p for p in json.load(f)["phases"]}

    def _show(self, path: str, what: str, force: bool = False) -> None:
        try:
            with open(path) as f:
                s = json.load(f)
        except (OSError, ValueError):
            return
        self.printer.progress(f"[{self.label}] {what} {s.get('phase')}: {s['sent']}/{s['total']} sent, "
                              f"{s['done']} done, {s['failed']} failed, {s.get('elapsed_s', 0):.0f}s", force)


def _tune(server: _Server, net, args, work, printer) -> dict:
    link = netns.LinkSpec(args.link_gbit, 0.0, args.shaper)

    def measure(gbit: float) -> float:
        net.set_link(dataclasses.replace(link, gbit=gbit))
        phases = server.run({f"probe-{k}": p for k, p in enumerate(work["probes"])}, f"probe {gbit:.4g} Gbit/s")
        return analysis.probe_fraction(list(phases.values()))

    result = find_rate(measure, args.target_comm_fraction, start=args.link_gbit, tol=args.fraction_tol,
                       max_probes=args.max_probes, log=printer.line)
    tuning = result.as_dict()
    tuning["probe_variant"] = server.label
    tuning["fraction_basis"] = ("engine all-to-all in flight, median / (median + fastest compute) over ranks x "
                                f"{args.probe_rounds} calibration bursts; compute = busy - exposed")
    if not result.converged:
        log.warning("rate search did not converge: %s; using the closest probe", result.message)
    net.set_link(dataclasses.replace(link, gbit=result.gbit))
    printer.line(f"link set to {result.gbit:.4g} Gbit/s (probe all-to-all share at the fastest compute "
                 f"{result.fraction:.3f})")
    return tuning


# ------------------------------------------------------------------------------------- output


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _num(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.1f}"


def serve_table(result: dict) -> str:
    header = ("variant", "rate", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "e2e p50/p99 s",
              "goodput", "a2a B/tok", "a2a %", "exposed %", "exp ms/tok", "LAR", "imbal", "speedup")
    rows = []
    for name, s in result["variants"].items():
        ratios = result["ratios"][name].get("rates", {})
        for rate, r in s["rates"].items():
            rows.append((name, rate, _num(r["requests_per_s"]), _num(r["output_tokens_per_s"], "{:.1f}"),
                         f"{_ms(r['ttft_s']['p50'])} / {_ms(r['ttft_s']['p99'])}",
                         f"{_ms(r['tpot_s']['p50'])} / {_ms(r['tpot_s']['p99'])}",
                         f"{_num(r['e2e_s']['p50'])} / {_num(r['e2e_s']['p99'])}",
                         _num(r["goodput_requests_per_s"]), _num(r["a2a_bytes_per_token"], "{:.0f}"),
                         _pct(r["a2a_fraction"]), _pct(r["exposed_fraction"]),
                         _ms(r.get("exposed_a2a_s_per_output_token")), _num(r.get("lar"), "{:.3f}"),
                         _num((r.get("load_imbalance") or {}).get("mean"), "{:.3f}"),
                         _num(ratios.get(rate, {}).get("throughput_speedup"), "{:.3f}")))
    return format_rows(header, rows, left=2)


def prefill_table(result: dict) -> str:
    header = ("variant", "prefill tok/s [min-max]", "fwd tok/s", "TTFT p50 ms", "a2a %", "exposed %", "overlap %",
              "a2a B/tok", "bytes x", "speedup", "fwd speedup", "Amdahl bound")
    rows = []

    def med(stat):
        return stat["median"] if stat else None

    for name, s in result["variants"].items():
        r = result["ratios"][name]
        tput = s["prefill_tokens_per_s"]
        rows.append((name, "-" if tput is None else f"{tput['median']:.0f} [{tput['min']:.0f}-{tput['max']:.0f}]",
                     _num(med(s["forward_tokens_per_s"]), "{:.0f}"), _ms(s["ttft_s"]["p50"]),
                     _pct(med(s["a2a_fraction"])), _pct(med(s["exposed_fraction"])),
                     _pct(s["overlap"]), _num(s["a2a_bytes_per_token"], "{:.0f}"), _num(r["bytes_ratio"], "{:.3f}"),
                     _num(r["throughput_speedup"], "{:.3f}"), _num(r["forward_speedup"], "{:.3f}"),
                     f"{_num(r['amdahl_bound'])} (bytes: {_num(r['amdahl_bound_bytes'])})"))
    return format_rows(header, rows)


def _plot_target(args):
    if args.no_plots:
        return None
    if args.plots:
        return args.plots, "bench_serve"
    if args.json:
        stem = os.path.splitext(os.path.basename(args.json))[0]
        return os.path.dirname(os.path.abspath(args.json)), stem
    return None


# --------------------------------------------------------------------------------------- main


def _benchmark(args, argv, work_dir, budget, printer) -> int:
    variants = _variants(args.variants, args.semmoe_tables)
    host_start = host_info()
    if args.load:
        checkpoints = {v: args.load for v in variants}
        if args.semmoe_tables:
            checkpoints.update(_place(args, variants, work_dir, printer))
    else:
        checkpoints = _train(args, variants, work_dir, budget, printer)
    tokenizer, context = _tokenizer_and_context(checkpoints[variants[0]])
    if args.mode == "prefill" and args.input_len is None:
        args.input_len = 2 ** int(math.log2(min(context - 1, args.prefill_tokens)))
    work = _workload(args, tokenizer, context)
    probe = (args.probe_variant or ("standard" if "standard" in variants else variants[0])) \
        if args.target_comm_fraction is not None else None
    order = sorted(variants, key=lambda v: v != probe)  # the probe variant first: it sets the link
    link = netns.LinkSpec(args.link_gbit, 0.0, args.shaper)
    phases, tuning, engine = {}, None, None
    with netns.open_network(args.ranks, link, use_netns=not args.no_netns) as net:
        if args.target_comm_fraction is not None and not net.shaped:
            raise ValueError("--target-comm-fraction needs a shaped link (network namespaces, as root)")
        for variant in order:
            t0 = time.monotonic()
            preset = variant if args.load and variant not in PLACED else None
            extra = ("--semmoe-tables", os.path.abspath(os.path.join(args.semmoe_tables, variant))) \
                if variant == "semmoe" else ()
            with _Server(net, args, checkpoints[variant], preset, os.path.join(work_dir, f"serve-{variant}"),
                         budget, printer, variant, extra) as server:
                engine = server.engine
                if "warmup" in work["phases"]:
                    server.run({"warmup": work["phases"]["warmup"]}, "warm-up")
                if variant == probe:
                    tuning = _tune(server, net, args, work, printer)
                measured = {k: v for k, v in work["phases"].items() if k != "warmup"}
                phases[variant] = server.run(measured, "load")
            printer.line(f"[{variant}] measured in {time.monotonic() - t0:.0f}s")
        network = net.describe()

    slo = {"slo_ttft_s": args.slo_ttft, "slo_tpot_s": args.slo_tpot}
    per_variant = {}
    for v in variants:
        if args.mode == "prefill":
            per_variant[v] = analysis.prefill_stats(list(phases[v].values()))
        else:
            per_rate = {name.split("-", 1)[1]: analysis.serve_stats([p], **slo) for name, p in phases[v].items()}
            for rate, s in per_rate.items():
                s["offered_rate"] = float(rate) if math.isfinite(float(rate)) else None  # inf: all at once
            per_variant[v] = analysis.pooled_serve_stats(per_rate, phases[v], **slo)
        per_variant[v]["request_scheduler"] = "semmoe-algorithm-2" if v == "semmoe" else "round-robin"
        if args.mode == "prefill":
            per_variant[v]["load_imbalance"] = analysis.load_imbalance(analysis.sum_load(
                [analysis.device_load(p["metrics_before"], p["metrics_after"]) for p in phases[v].values()]))
    if args.mode == "prefill":
        result = {"variants": per_variant, "ratios": analysis.prefill_ratios(per_variant)}
    else:
        result = report(per_variant)
    model = {"load": os.path.abspath(args.load)} if args.load else \
        {"config": args.config, "overrides": model_overrides(args), "train_steps": args.train_steps}
    result = {
        "schema": OUTPUT_SCHEMA,
        "command": argv,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"start": host_start, "end_loadavg_1_5_15": list(os.getloadavg())},
        "mode": args.mode,
        "config": {
            "ranks": args.ranks, "expert_model_parallel_size": args.ranks, "variants": variants, "seed": args.seed,
            "semmoe_tables": os.path.abspath(args.semmoe_tables) if args.semmoe_tables else None,
            "threads": args.threads, "model": model, "checkpoints": checkpoints, "server": engine,
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
        },
        "network": network,
        "tuning": tuning,
        "baseline": variants[0],
        "variants": result["variants"],
        "ratios": result["ratios"],
        "requests": {v: {name: p["requests"] for name, p in phases[v].items()} for v in variants},
    }
    print()
    print(f"network: {network['mode']}" + (f", {network['link']['gbit']:.4g} Gbit/s per rank link, "
          f"{network['link']['shaper']}" if network["shaped"] else " (UNSHAPED loopback)") +
          f"; {args.ranks} ranks (EP {args.ranks}); ratios vs {variants[0]}")
    print(prefill_table(result) if args.mode == "prefill" else serve_table(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    target = _plot_target(args)
    if target is not None:
        from .plots import write_plots

        for path in write_plots(result, *target):
            print(f"wrote {path}")
    return 0


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # upstream's import-time INFO lines stay quiet
    args = build_parser().parse_args(argv)
    command = ["python", script_path("scripts/bench_serve.py"), *argv]
    try:
        _check_args(args)
        budget = Budget(args.timeout_s)
    except ValueError as e:
        print(f"{PROG}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    return run_harness(PROG, "servers", args.work_dir, "bench_serve-",
                       lambda work_dir: _benchmark(args, command, work_dir, budget, _Printer()))
