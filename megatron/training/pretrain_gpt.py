"""Pretrain a GPT MoE with megatron-core: ``torchrun --nproc_per_node=N -m megatron.training.pretrain_gpt``.

Megatron-LM's flag names (``--num-layers --hidden-size --num-experts --moe-router-topk ...
--data-path --split --save --load``), optionally from ``--config FILE.yaml`` (flags override it).
Without ``--data-path`` it trains on the embedded tiny-shakespeare corpus with the embedded BPE.

    torchrun --nproc_per_node=2 -m megatron.training.pretrain_gpt --config examples/tiny_moe_cpu.yaml

Per ``--log-interval`` rank 0 prints a line and appends a JSON object to ``SAVE/metrics.jsonl``
(``--metrics-file``); validation loss/perplexity every ``--eval-interval``; checkpoints every
``--save-interval`` and at the end (resume with ``--load``). SIGTERM/SIGINT finish the current
step, save a checkpoint and exit.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron import compat
from megatron.training.parallel import destroy_parallel
from moe_variants.common.cli import run_cli
from megatron.training.arguments import Configs, configs_to_dict, parse_configs
from moe_variants.common import collectives

logger = logging.getLogger("megatron.training")

__all__ = ["main", "run_pretraining", "resolve_tokenizer", "build_data"]


class _StopFlag:
    """Set by SIGTERM/SIGINT; checked (and agreed on by all ranks) between steps."""

    def __init__(self):
        self.requested = False
        self.signal = None

    def install(self):
        def handler(signum, frame):
            self.requested = True
            self.signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    def agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0])
        collectives.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


def resolve_tokenizer(c: Configs):
    """The tokenizer named by the data flags, or the embedded BPE when none is given."""
    from megatron.training.tokenizer import DEFAULT_TOKENIZER_MODEL, build_tokenizer

    d = c.data
    if d.tokenizer_type is None:
        if d.data_path is not None:
            raise ValueError("--data-path needs --tokenizer-type (and its model/vocab files)")
        return build_tokenizer("HuggingFaceTokenizer", DEFAULT_TOKENIZER_MODEL)
    if d.data_path is None:
        raise ValueError(
            f"--tokenizer-type {d.tokenizer_type} needs --data-path: the embedded corpus is "
            "tokenized with the embedded tokenizer"
        )
    return build_tokenizer(
        d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file, vocab_size=c.model.vocab_size
    )


def check_data_paths(c: Configs) -> None:
    """Fail early (before any process group exists) when a ``--data-path`` prefix is missing."""
    from megatron.training.data import indexed_dataset_paths, parse_data_path

    if c.data.data_path is None:
        return
    prefixes, _ = parse_data_path(c.data.data_path)
    for prefix in prefixes:
        for path in indexed_dataset_paths(prefix):
            if not os.path.isfile(path):
                raise ValueError(f"--data-path {prefix}: {path} does not exist (run scripts/preprocess_data.py)")
    for path in c.data.heldout_text or []:
        if not os.path.isfile(path):
            raise ValueError(f"--heldout-text {path}: no such file")


def tokenizer_files_of(c: Configs) -> dict:
    """The files that define the tokenizer ({flag role: path}), copied into every checkpoint."""
    from megatron.training.tokenizer import DEFAULT_TOKENIZER_MODEL

    d = c.data
    if d.tokenizer_type is None:
        return {"tokenizer_model": DEFAULT_TOKENIZER_MODEL}
    if d.tokenizer_type == "HuggingFaceTokenizer":
        path = d.tokenizer_model
        if path and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        return {"tokenizer_model": path}
    if d.tokenizer_type == "GPT2BPETokenizer":
        return {"vocab_file": d.vocab_file, "merge_file": d.merge_file}
    return {}


def build_data(c: Configs, tokenizer, *, dp_rank: int, dp_size: int, consumed_samples: int, global_batch: int):
    """Train/valid/test datasets and the (resumable) train iterator."""
    from megatron.training.data import (
        build_data_iterator,
        build_pretraining_datasets,
        ensure_embedded_dataset,
        get_train_valid_test_num_samples,
    )

    cache = c.data.data_cache_path or os.path.join(c.checkpoint.save or ".", "data_cache")
    data_path = c.data.data_path
    if data_path is None:
        data_path = [ensure_embedded_dataset(cache)]
    num_samples = get_train_valid_test_num_samples(
        c.training.train_iters, global_batch, c.logging.eval_interval, c.logging.eval_iters
    )
    train_ds, valid_ds, test_ds = build_pretraining_datasets(
        data_path, c.data.split, c.model.seq_length, c.training.seed, num_samples, tokenizer, cache
    )
    train_iter = build_data_iterator(
        train_ds, c.training.micro_batch_size, consumed_samples, dp_rank, dp_size,
        num_workers=c.data.num_workers,
    )
    return train_ds, valid_ds, test_ds, train_iter


def _eval_iter(dataset, c: Configs, dp_rank, dp_size):
    from megatron.training.data import build_data_iterator

    if dataset is None:
        return None
    # every evaluation reads the same batches, so validation curves are comparable over time
    return build_data_iterator(dataset, c.training.micro_batch_size, 0, dp_rank, dp_size, cyclic=True)


def _step_record(step: int, m, rss_mb: float) -> dict:
    comm = m.comm
    return {
        "step": step,
        "loss": m.loss,
        "lm_loss": m.lm_loss,
        "aux_loss": m.aux_loss,
        "lr": m.lr,
        "grad_norm": m.grad_norm,
        "tokens_per_sec": m.tokens_per_sec,
        "step_time_s": m.step_time_s,
        "fwd_time_s": m.fwd_time_s,
        "bwd_time_s": m.bwd_time_s,
        "optimizer_time_s": m.optimizer_time_s,
        "skipped": m.skipped,
        "a2a_bytes_dispatch": comm["bytes_dispatch"],
        "a2a_bytes_combine": comm["bytes_combine"],
        "a2a_bytes_meta": comm["bytes_meta"],
        "a2a_bytes_backward": comm["bytes_backward"],
        "a2a_time_s": comm["time_fwd_s"] + comm["time_bwd_s"],
        "exposed_comm_s": comm["exposed_fwd_s"] + comm["exposed_bwd_s"],
        "peak_rss_mb": rss_mb,
        **m.extra,
    }


def run_pretraining(
    c: Configs,
    *,
    prog: str = "pretrain_gpt",
    forward_step_factory: Optional[Callable] = None,
    evaluate_hook: Optional[Callable] = None,
    after_setup: Optional[Callable] = None,
    before_wrap: Optional[Callable] = None,
) -> dict:
    """The training loop. Returns the final summary (also written as a JSONL event).

    ``forward_step_factory(timer)`` replaces the next-token forward step (FCSD distillation);
    ``evaluate_hook(iteration, model_chunks) -> dict`` adds metrics at each evaluation (a true
    ``"stop"`` entry, identical on all ranks, ends training early), ``after_setup(model_chunks,
    configs)`` runs once the model is built and loaded, and ``before_wrap(model)`` on the bare model
    before DDP and the optimizer are built.
    """
    from megatron.core import parallel_state

    from megatron.training.checkpointing import layout_of, load_checkpoint, save_checkpoint
    from moe_variants.config import validate
    from megatron.training.data import build_heldout_windows
    from megatron.training.metrics import MetricsWriter, format_step_line, peak_rss_mb
    from megatron.training.parallel import initialize_parallel
    from megatron.training.training import (
        Timer,
        evaluate,
        evaluate_windows,
        lm_forward_step,
        setup_model_and_optimizer,
        train_step,
    )

    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate(c.model, c.parallel, world)
    if c.checkpoint.save_interval is not None and c.checkpoint.save_interval < 1:
        raise ValueError("--save-interval must be >= 1")
    if c.checkpoint.save_interval and not c.checkpoint.save:
        raise ValueError("--save-interval needs --save DIR")
    check_data_paths(c)
    tokenizer = resolve_tokenizer(c)
    pgc = initialize_parallel(c.parallel, seed=c.training.seed)
    rank = dist.get_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    num_micro = c.training.num_microbatches(dp_size)
    global_batch = c.training.resolved_global_batch_size(dp_size)
    chunks, optimizer, scheduler = setup_model_and_optimizer(
        c.model, c.parallel, c.training, vocab_size=tokenizer.vocab_size, pg_collection=pgc,
        before_wrap=before_wrap,
    )
    config_dict = configs_to_dict(c)
    tokenizer_files = tokenizer_files_of(c)
    config_dict["tokenizer"] = {
        "type": c.data.tokenizer_type or "HuggingFaceTokenizer", "vocab_size": tokenizer.vocab_size,
    }
    layout = layout_of(c.parallel, c.training, world)

    iteration, consumed = 0, 0
    if c.checkpoint.load:
        loaded = load_checkpoint(
            c.checkpoint.load, chunks, optimizer, scheduler, layout=layout,
            load_optimizer=not (c.checkpoint.no_load_optim or c.checkpoint.finetune),
            load_rng=not (c.checkpoint.no_load_rng or c.checkpoint.finetune),
        )
        if loaded is None:
            if rank == 0:
                print(f"{prog}: no checkpoint in {c.checkpoint.load}; starting from scratch", flush=True)
        elif not c.checkpoint.finetune:
            iteration, consumed = loaded.iteration, loaded.consumed_samples
            if not loaded.optimizer_loaded:
                scheduler.step(increment=iteration)  # keep the LR schedule's position
    if after_setup is not None:
        after_setup(chunks, c)

    metrics_path = c.logging.metrics_file or (
        os.path.join(c.checkpoint.save, "metrics.jsonl") if c.checkpoint.save else None
    )
    writer = MetricsWriter(
        enabled=rank == world - 1 if c.parallel.pipeline_model_parallel_size > 1 else rank == 0,
        jsonl_path=metrics_path,
        tensorboard_dir=c.logging.tensorboard_dir,
        wandb_project=c.logging.wandb_project,
        wandb_exp_name=c.logging.wandb_exp_name,
        wandb_mode=c.logging.wandb_mode,
        wandb_save_dir=c.logging.wandb_save_dir,
        config=config_dict,
    )
    writer.print(f"{prog}: resolved configuration\n" + json.dumps(config_dict, indent=1))
    writer.print(
        f"{prog}: world size {world} (data-parallel {dp_size}), {num_micro} micro-batch(es) of "
        f"{c.training.micro_batch_size} per step, global batch {global_batch}, starting at iteration {iteration}"
    )

    train_ds, valid_ds, test_ds, train_iter = build_data(
        c, tokenizer, dp_rank=dp_rank, dp_size=dp_size, consumed_samples=consumed, global_batch=global_batch
    )

    def save(step):
        path = save_checkpoint(
            c.checkpoint.save, step, chunks, optimizer, scheduler, consumed_samples=consumed,
            layout=layout, configs=config_dict, keep_last=c.checkpoint.keep_last_checkpoints,
            tokenizer_files=tokenizer_files,
        )
        writer.log_event("checkpoint", step, path=path)
        writer.print(f"{prog}: saved checkpoint {path}")

    def run_eval(step, split="valid", dataset=None):
        dataset = valid_ds if dataset is None else dataset
        result = {}
        if dataset is not None and c.logging.eval_iters > 0:
            result = evaluate(
                chunks, _eval_iter(dataset, c, dp_rank, dp_size), model_cfg=c.model,
                train_cfg=c.training, eval_iters=c.logging.eval_iters,
                num_microbatches=num_micro, pg_collection=pgc,
            )
        if evaluate_hook is not None:
            result.update(evaluate_hook(step, chunks))
        if result:
            writer.log_event(split, step, **result)
            writer.print(
                f"{prog}: {split} at iter {step}: "
                + " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
            )
        return result

    stop = _StopFlag()
    stop.install()
    timer_factory = forward_step_factory or (lambda timer: lm_forward_step(timer))
    last_record = None
    interrupted = False
    summary_stop = None
    while iteration < c.training.train_iters:
        timer = Timer()
        m = train_step(
            chunks, optimizer, scheduler, train_iter, model_cfg=c.model, train_cfg=c.training,
            num_microbatches=num_micro, pg_collection=pgc, forward_step_func=timer_factory(timer),
        )
        m.fwd_time_s = timer.forward_s
        m.bwd_time_s = max(m.step_time_s - m.optimizer_time_s - timer.forward_s, 0.0)
        iteration += 1
        consumed += global_batch
        if iteration % c.logging.log_interval == 0 or iteration == c.training.train_iters:
            last_record = _step_record(iteration, m, peak_rss_mb())
            writer.log_step(last_record)
            writer.print(format_step_line(last_record, c.training.train_iters))
        if c.logging.eval_interval and iteration % c.logging.eval_interval == 0 and iteration < c.training.train_iters:
            if run_eval(iteration).get("stop"):
                writer.print(f"{prog}: early stop at iteration {iteration}")
                summary_stop = iteration
                break
        if stop.agreed():
            interrupted = True
            writer.print(f"{prog}: signal received; saving and exiting after iteration {iteration}")
            break
        if c.checkpoint.save and c.checkpoint.save_interval and iteration % c.checkpoint.save_interval == 0:
            save(iteration)

    summary = {"iteration": iteration, "interrupted": interrupted, "early_stop": summary_stop}
    if c.checkpoint.save and (interrupted or not os.path.isdir(
        os.path.join(c.checkpoint.save, f"iter_{iteration:07d}")
    )):
        save(iteration)
    if not interrupted:
        summary["valid"] = run_eval(iteration, "valid")
        if test_ds is not None and c.logging.eval_iters > 0:
            summary["test"] = run_eval(iteration, "test", test_ds)
        for path in c.data.heldout_text or []:
            windows = build_heldout_windows(path, tokenizer, c.model.seq_length)
            result = evaluate_windows(
                chunks, windows, model_cfg=c.model, micro_batch_size=c.training.micro_batch_size,
                pg_collection=pgc,
            )
            result["file"] = path
            summary.setdefault("heldout", []).append(result)
            writer.log_event("heldout", iteration, **result)
            writer.print(
                f"{prog}: held-out {path}: loss {result['loss']:.4f} | ppl {result['ppl']:.2f} "
                f"over {result['tokens']} tokens"
            )
    if last_record is not None:
        summary["last_step"] = last_record
    summary["peak_rss_mb"] = peak_rss_mb()
    writer.log_event("summary", iteration, **{k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
    writer.close()
    return summary


def main(argv=None, prog: str = "pretrain_gpt") -> int:
    compat.quiet_warnings()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from megatron.training.checkpointing import CheckpointError

    def body():
        run_pretraining(parse_configs(argv, prog=prog), prog=prog)

    return run_cli(prog, body, user_errors=(ValueError, CheckpointError, FileNotFoundError), cleanup=destroy_parallel)


if __name__ == "__main__":
    sys.exit(main())
