"""The EP benchmark's model worker: the project's real training step for one MoE variant.

``python -m tools.bench.variant_worker SPEC.json`` (started once per rank by
``scripts/bench_ep.py``). It builds the model with the same builder and trains it with the same
``train_step`` as ``pretrain_gpt`` (megatron-core DDP, optimizer, schedule) on the embedded corpus
(identical batches for every variant: same seed, same data order), and records per measured step
the timings and the all-to-all counters that the dispatchers themselves keep.

Variants are config overrides on top of ``--config``: the registered variants' benchmark presets
(``moe_variants.registry``); ``+`` combines them (``bigmac+farskip``). A registered variant's
run-time bench variants (``Variant.bench_runtimes``, e.g. Sem-MoE's ``semmoe``) change no config:
their ``bench_runtime`` set-up changes the freshly built model before DDP wraps it (``place``) and
re-orders every step's data (``schedule``), so they combine with any preset (``semmoe+bigmac``).
The peers (``tools/bench/peers``: ``deepspeed-moe``, ``mcore-latent``, ``mcore-ep-overlap``) are
runtime variants too: the same configs, with another stack's MoE layer or schedule swapped in
through hooks (build arguments, ``before_wrap``, forward step); they run alone.

With ``options["device"] == "cuda"`` every rank joins with NCCL on GPU ``LOCAL_RANK``; the step
timers and our counters then use CUDA events (``moe_variants/common/timing.py``). The upstream peers'
layers keep no counters of ours: their bytes are counted at the ``torch.distributed`` level and
their all-to-all times are not measured (``tools/bench/peers/mcore.py``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

from megatron import compat
from moe_variants import registry
from tools import variants as variant_hooks

from . import peers
from .overlap import comm_spans, direction_totals, events_from_timeline
from .schema import RankResult, WorkerSpec, peak_rss_mb
from megatron.common.cli import UserError, run_cli, user_input
from megatron.common.files import write_json
from .worker_env import init_from_env, rank_and_world, read_spec_from_argv
from megatron.common import collectives

__all__ = ["RUNTIME_VARIANTS", "variant_overrides", "worker_configs", "main"]

# bench variants that change no config: the worker sets them up at run time (the registered
# variants' run-time bench variants, which combine with any preset, and the peers, which run alone)
RUNTIME_VARIANTS = variant_hooks.runtime_names() + peers.names()


def variant_overrides(variant: str) -> dict:
    """Config overrides of a (possibly ``+``-combined) variant name: the registered variants'
    benchmark presets (``moe_variants.registry``); ValueError names an unknown part."""
    return registry.preset_overrides(variant, extra=RUNTIME_VARIANTS)


def worker_configs(spec: WorkerSpec, world: int, fixed: Optional[dict] = None):
    """The configs a worker runs: ``--config``, the overrides, EP = ``world`` and the local
    implementation unless set, the variant's preset, the seed, then ``fixed`` (flat fields; default
    ``train_iters`` = warm-up + measured steps)."""
    from megatron.components.arguments import configs_from_dict, load_yaml

    values = load_yaml(spec.config_path) if spec.config_path else {}
    values.update(spec.overrides)
    values.setdefault("expert_model_parallel_size", world)
    values.setdefault("transformer_impl", "local")
    values.update(variant_overrides(spec.variant))
    values["seed"] = spec.seed
    values.update(fixed if fixed is not None else {"train_iters": spec.warmup + spec.steps})
    return configs_from_dict(values)


def _attach_timeline(chunks):
    from moe_variants.common.moe_layer import comm_counters
    from moe_variants.common.comm import TimelineRecorder

    timeline = TimelineRecorder()
    for counters in comm_counters(chunks):
        counters.timeline = timeline
    return timeline


def _detach_timeline(chunks) -> None:
    from moe_variants.common.moe_layer import comm_counters

    for counters in comm_counters(chunks):
        counters.timeline = None


def _write_trace(timeline, start, end, trace_dir, variant, rank) -> None:
    """Chrome trace of one step: the main thread's compute (the step minus its waits), waits,
    all-to-alls in flight, and FarSkip's forward phases."""
    from moe_variants.common.comm import TimelineRecorder

    waits = sorted((s, e) for _, lane, s, e in timeline.events if lane == "wait")
    out = TimelineRecorder()
    cursor = start
    for s, e in waits:
        if e - s < 1e-6:  # a wait that did not block does not interrupt the compute
            continue
        if s > cursor:
            out.add("compute", "compute", cursor, s)
        cursor = max(cursor, e)
    if end > cursor:
        out.add("compute", "compute", cursor, end)
    for name, lane, s, e in timeline.events:
        out.add(name, "phases" if lane == "compute" else lane, s, e)
    out.add(f"{variant} step", "step", start, end)
    trace = out.to_chrome_trace(pid=rank)
    os.makedirs(trace_dir, exist_ok=True)
    write_json(os.path.join(trace_dir, f"trace_{variant}_rank{rank}.json"), trace)


def _validation_split(c, tokenizer, global_batch: int):
    """``BenchContext.validation_split``: at least ``num_samples`` samples of the run's validation
    split, built with megatron's data pipeline; the torch RNG state is restored afterwards, so the
    model is initialised exactly as in the other variants (the data loader draws a seed)."""

    def build(num_samples: int):
        import copy
        import math

        import torch
        from megatron.core import parallel_state

        from megatron.training.data import build_data

        data_configs = copy.deepcopy(c)
        data_configs.logging.eval_iters = max(1, math.ceil(num_samples / global_batch))
        rng = torch.get_rng_state()
        _, valid, _, _ = build_data(
            data_configs, tokenizer, dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(), consumed_samples=0, global_batch=global_batch,
        )  # fmt: skip
        torch.set_rng_state(rng)
        return valid

    return build


def run(spec: WorkerSpec) -> RankResult:
    from megatron.core import parallel_state

    from moe_variants.config import validate
    from megatron.components.parallel import initialize_parallel
    from megatron.training.data import build_data
    from megatron.components.tokenizer import resolve_tokenizer
    from megatron.training.step import setup_model_and_optimizer, train_step

    rank, world = rank_and_world()
    with user_input():
        c = worker_configs(spec, world)
    c.checkpoint.save = None
    c.data.data_cache_path = c.data.data_cache_path or os.path.join(spec.output_dir, "data_cache")
    c.logging.eval_interval = 0
    validate(c.model, c.parallel, world)
    tokenizer = resolve_tokenizer(c)
    pgc = initialize_parallel(c.parallel, seed=c.training.seed)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    num_micro = c.training.num_microbatches(dp_size)
    global_batch = c.training.resolved_global_batch_size(dp_size)
    context = variant_hooks.BenchContext(configs=c, tokenizer=tokenizer, pg_collection=pgc, options=spec.options,
                                    validation_split=_validation_split(c, tokenizer, global_batch))
    runtimes = variant_hooks.bench_runtimes(spec.variant, context)
    scheduled = {name: rt for name, rt in runtimes.items() if rt.schedules}
    device = spec.options.get("device", "cpu")
    peer, hooks = peers.get(spec.variant), None
    if peer is not None:
        reason = peers.refusal(spec.variant, device, world)
        if reason is not None:
            raise UserError(reason)
        hooks = peer.load().WorkerHooks(c, pgc, {**spec.options, "variant": spec.variant})
        validate(c.model, c.parallel, world)
    placers = [rt.place for rt in runtimes.values()] + ([hooks.before_wrap] if hooks is not None else [])

    def before_wrap(model) -> None:
        for place in placers:
            place(model)

    chunks, optimizer, scheduler = setup_model_and_optimizer(
        c.model, c.parallel, c.training, vocab_size=tokenizer.vocab_size, pg_collection=pgc,
        before_wrap=before_wrap if placers else None, build_kwargs=hooks.build_kwargs if hooks else None,
    )
    forward_step_func = None  # a peer's own forward step (the combined 1F1B schedule: fwd/bwd not split)
    if hooks is not None and hooks.forward_step_factory is not None:
        forward_step_func = hooks.forward_step_factory()
    _, _, _, train_iter = build_data(
        c, tokenizer, dp_rank=dp_rank, dp_size=dp_size, consumed_samples=0, global_batch=global_batch
    )
    drops = None  # (token, expert) pairs routed and kept by the capacity, for our layers (peers count their own)
    if hooks is None:
        from moe_variants.common.moe_layer import moe_layers
        from moe_variants.common.routing import DropCounter

        drops = DropCounter(chunks).__enter__() if moe_layers(chunks[0]) else None
    fields = {k: [] for k in ("step_time_s", "fwd_time_s", "bwd_time_s", "a2a_time_s", "exposed_comm_s",
                              "a2a_bytes_dispatch", "a2a_bytes_combine", "a2a_bytes_backward", "tokens")}
    extra = {"lm_loss": [], "a2a_bytes_meta": [], "a2a_time_fwd_s": [], "a2a_time_bwd_s": [],
             "exposed_fwd_s": [], "exposed_bwd_s": [], "window_compute_fwd_s": [], "window_compute_bwd_s": [],
             "a2a_spans": []}  # each step's collectives [name, start, end]: the transfer/skew split
    for name in scheduled:
        extra[f"{name}_schedule_s"] = []
    peer_extra: dict = {}
    trace_dir = spec.options.get("trace_dir")
    total = spec.warmup + spec.steps
    for step in range(total):
        # every measured step records its collectives' timeline: the overlap bound comes from it
        timeline = _attach_timeline(chunks) if step >= spec.warmup else None
        data, schedule_s = train_iter, {}
        for name, rt in scheduled.items():  # e.g. a request schedule over this step's global batch, untimed
            t_schedule = time.perf_counter()
            data = rt.schedule(data, num_micro)
            schedule_s[name] = time.perf_counter() - t_schedule
        start = time.perf_counter()
        m = train_step(
            chunks, optimizer, scheduler, data, model_cfg=c.model, train_cfg=c.training,
            num_microbatches=num_micro, pg_collection=pgc, forward_step_func=forward_step_func,
        )
        end = time.perf_counter()
        # upstream peers' layers keep no counters of ours: their hooks count at the torch level
        comm = hooks.comm_totals(m) if hasattr(hooks, "comm_totals") else m.comm
        step_extra = hooks.step_extra(chunks) if hooks is not None else drops.take() if drops is not None else {}
        if timeline is not None:
            _detach_timeline(chunks)
            if trace_dir and step == total - 1:
                _write_trace(timeline, start, end, trace_dir, spec.variant, rank)
        if step < spec.warmup:
            continue
        directions = direction_totals(events_from_timeline(timeline))
        extra["window_compute_fwd_s"].append(directions["forward"]["window_compute_ms"] / 1e3)
        extra["window_compute_bwd_s"].append(directions["backward"]["window_compute_ms"] / 1e3)
        extra["a2a_spans"].append(comm_spans(timeline))
        for key, value in step_extra.items():
            peer_extra.setdefault(key, []).append(value)
        fields["step_time_s"].append(m.step_time_s)
        fields["fwd_time_s"].append(m.fwd_time_s)
        fields["bwd_time_s"].append(m.bwd_time_s)
        fields["a2a_time_s"].append(comm["time_fwd_s"] + comm["time_bwd_s"])
        fields["exposed_comm_s"].append(comm["exposed_fwd_s"] + comm["exposed_bwd_s"])
        fields["a2a_bytes_dispatch"].append(int(comm["bytes_dispatch"]))
        fields["a2a_bytes_combine"].append(int(comm["bytes_combine"]))
        fields["a2a_bytes_backward"].append(int(comm["bytes_backward"]))
        fields["tokens"].append(num_micro * c.training.micro_batch_size * c.model.seq_length)
        extra["lm_loss"].append(m.lm_loss)
        extra["a2a_bytes_meta"].append(int(comm["bytes_meta"]))
        extra["a2a_time_fwd_s"].append(comm["time_fwd_s"])
        extra["a2a_time_bwd_s"].append(comm["time_bwd_s"])
        extra["exposed_fwd_s"].append(comm["exposed_fwd_s"])
        extra["exposed_bwd_s"].append(comm["exposed_bwd_s"])
        for name, seconds in schedule_s.items():
            extra[f"{name}_schedule_s"].append(seconds)
    for name, rt in runtimes.items():
        extra[name] = rt.info
    extra.update(peer_extra)
    if hooks is not None:
        extra["peer"] = getattr(hooks, "info", {"peer": spec.variant})
    extra["device"] = device
    extra["config"] = c.model.flat()
    collectives.barrier()
    return RankResult(rank=rank, world_size=world, variant=spec.variant, peak_rss_mb=peak_rss_mb(),
                      extra=extra, **fields)


def main(argv=None) -> int:
    compat.quiet_warnings()
    spec = read_spec_from_argv(argv)
    init_from_env(spec.num_threads, spec.options.get("device", "cpu"))
    rank, _ = rank_and_world()
    return run_cli("variant_worker", lambda: run(spec).write(spec.result_path(rank)))


if __name__ == "__main__":
    sys.exit(main())
