"""bench_serve's command line: the parser and the checks that run before anything is written."""

from __future__ import annotations

import argparse
import math
import os

from moe_variants import registry
from tools import variants as variant_hooks
from megatron.common.cli import UserError, float_list, nonneg_int, positive_float, positive_int
from tools.bench import netns
from tools.bench.cli import add_model_options, model_overrides
from tools.bench.discipline import add_discipline_arguments

from .loadgen import load_prompt_pairs
from .variant_configs import placed, train_config, variant_list

__all__ = ["build_parser", "check_args", "check_load_variants", "PROG", "DEFAULT_NUM_REQUESTS"]

PROG = "bench_serve.py"
# a p99 needs 100 samples for one to be expected beyond it (loadgen.samples_needed)
DEFAULT_NUM_REQUESTS = 100


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("network")
    g.add_argument("--ranks", type=positive_int, default=2, help="server ranks (1-4; default 2)")
    g.add_argument("--tensor-model-parallel-size", type=positive_int, default=1,
                   help="attention tensor parallelism of the servers (divides --ranks; data-parallel engines = "
                        "--ranks / TP; expert parallelism: --expert-model-parallel-size, default --ranks / TP)")
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
    variant_hooks.add_serve_bench_arguments(g)
    g.add_argument("--train-steps", type=positive_int, default=30,
                   help="with --config (or the default model): training steps per variant's checkpoint")
    g.add_argument("--variants", default="standard", help="comma-separated registry presets ("
                   + ", ".join(registry.bench_presets()) + "; '+' combines) or placed variants ("
                   + ", ".join(variant_hooks.serve_placement_names()) + ", with --load)")
    g.add_argument("--seed", type=int, default=1234, help="training, prompt order, arrivals")
    g.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    g = ap.add_argument_group("load")
    g.add_argument("--mode", choices=["serve", "prefill"], default="serve")
    g.add_argument("--request-rates", type=float_list, default=[1.0, 2.0, 4.0], help="requests/s, comma-separated "
                   "(inf: all at once)")
    g.add_argument("--num-requests", type=positive_int, default=None,
                   help=f"requests per rate and run (default {DEFAULT_NUM_REQUESTS}: a percentile p needs "
                        "100 / (100 - p) samples for one to be expected beyond it, so p50 2, p90 10, p99 100; the "
                        "table marks a percentile resting on fewer)")
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
    add_discipline_arguments(g, runs_help="each run restarts every variant's servers; latency percentiles are "
                                          "also pooled over the runs")
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
    g.add_argument("--expert-comm", choices=("alltoall", "allreduce"), default="alltoall",
                   help="serve --expert-comm: alltoall, or allreduce (vLLM's layout, TP = EP: every rank holds every "
                        "token and one all-reduce sums the local experts)")
    g.add_argument("--routing-stats", action=argparse.BooleanOptionalAction, default=True,
                   help="servers count local activations and expert load (serve --routing-stats: the LAR and "
                        "imbalance columns); --no-routing-stats serves as the server's default does")
    g = ap.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write the results here")
    g.add_argument("--plots", metavar="DIR", help="PNG plots here (default: beside --json)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--work-dir", help="keep checkpoints, logs and raw results here (default: temporary); a "
                   "checkpoint trained there with the same settings is reused")
    g.add_argument("--resume", action="store_true", help="reuse the variant-runs an earlier command with the "
                   "same arguments finished in --work-dir (each run directory's done.json) and serve only the "
                   "rest; needs --work-dir and a fixed --link-gbit")
    g.add_argument("--timeout-s", type=float, default=3600.0, help="wall-clock limit of the whole command")
    return ap


# ------------------------------------------------------------------------------------ validation


def check_args(args) -> None:
    """Everything that can be checked before any process starts or any file is written."""
    variants = variant_list(args.variants, args)
    # --expert-model-parallel-size is a layout of the servers, not a model change: --load takes it
    if args.load and (args.config or set(model_overrides(args)) - {"expert_model_parallel_size"}):
        raise UserError("--load serves a checkpoint as it is: drop --config and the model overrides")
    if args.config and not os.path.isfile(args.config):
        raise UserError(f"--config {args.config}: no such file")
    if args.load:
        from megatron.components.checkpointing import CheckpointError, find_latest_checkpoint

        try:
            if find_latest_checkpoint(args.load) is None:
                raise UserError(f"--load {args.load}: no complete checkpoint found")
        except CheckpointError as err:
            raise UserError(str(err)) from None
    if not 1 <= args.ranks <= netns.MAX_RANKS:
        raise UserError(f"--ranks must be between 1 and {netns.MAX_RANKS}, got {args.ranks}")
    tp = args.tensor_model_parallel_size
    if args.ranks % tp:
        raise UserError(f"--tensor-model-parallel-size {tp} does not divide --ranks {args.ranks}")
    args.serve_ep = args.expert_model_parallel_size or args.ranks // tp  # the servers' expert parallelism
    if args.expert_comm == "allreduce" and not (tp > 1 and args.serve_ep == tp):
        raise UserError(f"--expert-comm allreduce needs --tensor-model-parallel-size = expert parallelism > 1, "
                        f"got TP {tp}, EP {args.serve_ep}")
    if args.ranks % args.serve_ep:
        raise UserError(f"--expert-model-parallel-size {args.serve_ep} does not divide --ranks {args.ranks}")
    netns.LinkSpec(args.link_gbit, 0.0, args.shaper)  # validates the rate
    if args.target_comm_fraction is not None:
        if not 0 < args.target_comm_fraction < 1:
            raise UserError(f"--target-comm-fraction must be in (0, 1), got {args.target_comm_fraction}")
        if args.no_netns:
            raise UserError("--target-comm-fraction needs a shaped link (network namespaces, as root); it cannot "
                            "be used with --no-netns")
        ok, why = netns.netns_available()
        if not ok:
            raise UserError(f"--target-comm-fraction needs a shaped link: {why}")
    if args.probe_variant and args.probe_variant not in variants:
        raise UserError(f"--probe-variant {args.probe_variant} is not one of --variants")
    if args.num_requests is not None and args.duration is not None:
        raise UserError("give --num-requests or --duration, not both")
    if not args.load:  # each variant is trained on --ranks first: its batch sizes must fit them
        from megatron.components.arguments import configs_from_dict

        for v in variants:
            configs = configs_from_dict(train_config(args, v, "unused"))
            configs.training.num_microbatches(configs.parallel.data_parallel_size(args.ranks))
    if args.mode == "serve":
        if not args.request_rates:
            raise UserError("--request-rates is empty")
        for r in args.request_rates:
            if not r > 0:
                raise UserError(f"--request-rates: rates must be > 0, got {r:g}")
        if len(set(args.request_rates)) != len(args.request_rates):
            raise UserError("--request-rates lists a rate twice")
        if args.duration is not None and any(math.isinf(r) for r in args.request_rates):
            raise UserError("--duration needs finite --request-rates")
        if args.prompts is None and args.input_len is None:
            raise UserError("give --prompts FILE or --input-len (with --output-len) for the requests")
        if args.max_batch_tokens < args.max_requests:
            raise UserError(f"--max-batch-tokens ({args.max_batch_tokens}) must be >= --max-requests "
                            f"({args.max_requests})")
    else:
        if args.input_len is not None and args.input_len > args.prefill_tokens:
            raise UserError(f"--input-len {args.input_len} is longer than --prefill-tokens {args.prefill_tokens}")
    if args.prompts is not None:
        load_prompt_pairs(args.prompts)  # readable and parseable, or a one-line error
    for flag in ("json",):
        path = getattr(args, flag)
        if path and os.path.isdir(path):
            raise UserError(f"--{flag} {path}: is a directory, expected a file path")
    if args.plots and os.path.isfile(args.plots):
        raise UserError(f"--plots {args.plots}: is a file, expected a directory")
    if args.resume and not args.work_dir:
        raise UserError("--resume needs --work-dir (the directory whose finished runs it reuses)")
    if args.resume and args.target_comm_fraction is not None:
        raise UserError("--resume needs a fixed link: pass the rate the first command's search chose as "
                        "--link-gbit instead of --target-comm-fraction")
    if args.timeout_s <= 0:
        raise UserError(f"--timeout-s must be > 0, got {args.timeout_s}")
    if not args.load_threshold >= 0:
        raise UserError(f"--load-threshold must be >= 0, got {args.load_threshold}")
    manifest = None
    if args.load:
        from megatron.components.checkpointing import find_latest_checkpoint, read_manifest

        manifest = read_manifest(find_latest_checkpoint(args.load), verify=False)
    variant_hooks.check_serve_bench(args, variants, manifest)  # the variants' own options (e.g. placements' inputs)
    if args.load:
        check_load_variants(args.load, [v for v in variants if v not in placed(variants)])  # last: builds meta models


# --------------------------------------------------------------------------------- checkpoints


def check_load_variants(ckpt: str, variants: list) -> None:
    """With ``--load``, every variant must keep the checkpoint's parameters (built on the meta device)."""
    from megatron.components.arguments import configs_to_dict
    from megatron.components.loading import checkpoint_configs

    base = configs_to_dict(checkpoint_configs(ckpt)[0])
    changing = [v for v in variants
                if configs_to_dict(checkpoint_configs(ckpt, registry.preset_overrides(v))[0]) != base]
    if not changing:
        return
    from megatron import compat
    from megatron.components.loading import parameter_changes
    from megatron.components.parallel import initialize_parallel, single_process_group
    from moe_variants.config import ParallelConfig

    compat.apply()
    with single_process_group():
        initialize_parallel(ParallelConfig(), seed=0)
        for v in changing:
            changes = parameter_changes(ckpt, registry.preset_overrides(v))
            if changes:
                raise UserError(f"--load with --variants {v}: {v} changes the parameters of {ckpt} ({len(changes)} "
                                f"tensors, e.g. {changes[0]}); only presets that keep the parameters (connectivity-only "
                                "ones) run on another variant's checkpoint: train one checkpoint per variant with "
                                "--config instead")
