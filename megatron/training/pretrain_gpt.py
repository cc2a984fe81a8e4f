"""Pretrain a GPT MoE with megatron-core: ``torchrun --nproc_per_node=N -m megatron.training.pretrain_gpt``.

Megatron-LM's flag names (``--num-layers --hidden-size --num-experts --moe-router-topk ...
--data-path --split --save --load``), optionally from ``--config FILE.yaml`` (flags override it).
Without ``--data-path`` it trains on the embedded tiny-shakespeare corpus with the embedded BPE.

    torchrun --nproc_per_node=2 -m megatron.training.pretrain_gpt --config examples/tiny_moe_cpu.yaml

Per ``--log-interval`` rank 0 prints a line (with elapsed time and ETA) and appends a JSON object
to ``SAVE/metrics.jsonl`` (``--metrics-file``); validation loss/perplexity every
``--eval-interval``; checkpoints every ``--save-interval`` and at the end; the resolved
configuration goes to ``SAVE/config.yaml`` (``--print-config`` prints it too).

Resuming: ``--save DIR --load DIR`` continues from DIR's newest checkpoint, or starts from scratch
when there is none yet. A ``--save`` directory holding another run's checkpoints is refused at
start-up (``--load`` it, use a new ``--save``, or ``--overwrite-save``); one run writes to a
directory at a time (``SAVE/writer.lock``).

SIGTERM/SIGINT (to torchrun or to the ranks) finish the current step, save a checkpoint and exit.
A watchdog (``megatron/training/watchdog.py``) ends the job when a rank stops beating
(``--heartbeat-timeout``, 30 s) or no step finishes (``--step-timeout``, 180 s), or as soon as a
rank fails; with ``torchrun --max-restarts N`` and ``--save D --load D`` the job resumes by itself.
Exit codes: 0 finished, 75 stopped by a signal after saving (run again to resume), 2 bad input
(one line), 3 ended by the watchdog (a rank lost, hung or failed elsewhere), 1 a crash on this rank
(its traceback, also in torchrun's error file).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron import compat
from megatron.training.arguments import Configs, configs_to_dict, parse_configs
from megatron.training.parallel import destroy_parallel
from moe_variants.common import collectives
from torch.distributed.elastic.multiprocessing.errors import record

from moe_variants.common.cli import UserError, one_line, run_cli, user_input

logger = logging.getLogger("megatron.training")

__all__ = ["main", "run_pretraining", "resolve_tokenizer", "build_data"]


def resolve_tokenizer(c: Configs):
    """The tokenizer named by the data flags, or the embedded BPE when none is given."""
    from megatron.training.tokenizer import DEFAULT_TOKENIZER_MODEL, build_tokenizer

    d = c.data
    if d.tokenizer_type is None:
        if d.data_path is not None:
            raise UserError("--data-path needs --tokenizer-type (and its model/vocab files)")
        return build_tokenizer("HuggingFaceTokenizer", DEFAULT_TOKENIZER_MODEL)
    if d.data_path is None:
        raise UserError(
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
                raise UserError(f"--data-path {prefix}: {path} does not exist (run scripts/preprocess_data.py)")
    for path in c.data.heldout_text or []:
        if not os.path.isfile(path):
            raise UserError(f"--heldout-text {path}: no such file")


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


class Throughput:
    """TFLOP/s per GPU, MFU and peak GPU memory of a logged step (``megatron/training/flops.py``)."""

    def __init__(self, flops_per_token: float, world_size: int, peak: Optional[float]):
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak = peak

    @classmethod
    def of(cls, model, c: Configs, world_size: int) -> "Throughput":
        from megatron.core import parallel_state

        from megatron.training.flops import active_weights, flops_per_token, peak_tflops

        p = c.parallel
        num_local = (c.model.num_experts or 0) // max(p.expert_model_parallel_size, 1)
        active = torch.tensor([float(active_weights(
            model, num_experts=c.model.num_experts, topk=c.model.moe_router_topk or 0,
            tp_size=p.tensor_model_parallel_size, expert_tp_size=p.expert_tensor_parallel_size or 1,
            num_local_experts=max(num_local, 1)))], dtype=torch.float64)
        if p.pipeline_model_parallel_size > 1:  # each stage counts its own layers
            collectives.all_reduce(active, group=parallel_state.get_pipeline_model_parallel_group())
        per_token = flops_per_token(model.config, int(active.item()), seq_length=c.model.seq_length)
        return cls(per_token, world_size, c.training.peak_tflops or peak_tflops(c.model.bf16))

    def record(self, m) -> dict:
        out = {}
        if m.step_time_s > 0:
            tflops = self.flops_per_token * m.tokens / m.step_time_s / self.world_size / 1e12
            out["tflops_per_gpu"] = tflops
            if self.peak:
                out["mfu"] = tflops / self.peak
        if torch.cuda.is_available():
            out["gpu_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out


def _on_rank0(fn, rank: int):
    """Run ``fn`` on rank 0 only; every rank returns its (picklable) result or raises its one-line
    error (``fn`` validates: its ``ValueError`` is a ``UserError``), so a refusal never leaves the
    other ranks waiting in a collective."""
    from megatron.training.checkpointing import CheckpointError, broadcast_object

    out = None
    if rank == 0:
        try:
            out = ("ok", fn())
        except CheckpointError as e:
            out = ("checkpoint", str(e))
        except ValueError as e:
            out = ("value", str(e))
    kind, value = broadcast_object(out)
    if kind == "checkpoint":
        raise CheckpointError(value)
    if kind == "value":
        raise UserError(value)
    return value


def _has_checkpoint(directory: str) -> bool:
    from megatron.training.checkpointing import MANIFEST, checkpoint_candidates

    if not os.path.isdir(directory):
        return False
    return os.path.isfile(os.path.join(directory, MANIFEST)) or bool(checkpoint_candidates(directory))


def _same_dir(a: Optional[str], b: Optional[str]) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def config_yaml(config_dict: dict, prog: str) -> str:
    """The resolved configuration as flat YAML, loadable again with ``--config``."""
    import yaml

    lines = [f"# The resolved configuration of this {prog} run; `--config` accepts this file as is."]
    for section, fields in config_dict.items():
        if section == "tokenizer" or not fields:
            continue
        lines += ["", f"# {section}", yaml.safe_dump(fields, sort_keys=False).rstrip()]
    return "\n".join(lines) + "\n"


def _duration(seconds: float) -> str:
    from megatron.training.metrics import format_duration

    return format_duration(seconds)


def run_pretraining(
    c: Configs,
    *,
    prog: str = "pretrain_gpt",
    forward_step_factory: Optional[Callable] = None,
    evaluate_hook: Optional[Callable] = None,
    after_setup: Optional[Callable] = None,
    before_wrap: Optional[Callable] = None,
    lineage: Optional[str] = None,
) -> dict:
    """The training loop. Returns the final summary (also written as a JSONL event); its
    ``interrupted`` entry is true when a signal stopped the run (after saving).

    ``forward_step_factory(timer)`` replaces the next-token forward step (FCSD distillation);
    ``evaluate_hook(iteration, model_chunks) -> dict`` adds metrics at each evaluation (a true
    ``"stop"`` entry, identical on all ranks, ends training early), ``after_setup(model_chunks,
    configs)`` runs once the model is built and loaded, and ``before_wrap(model)`` on the bare model
    before DDP and the optimizer are built. ``lineage`` fixes the run's lineage id (default: the
    resumed checkpoint's, else a new one).
    """
    import time

    from megatron.core import parallel_state

    from megatron.training.checkpointing import layout_of, load_checkpoint, new_lineage, save_checkpoint
    from megatron.training.data import build_heldout_windows, check_token_ids, parse_data_path
    from megatron.training.metrics import MetricsWriter, format_step_line, peak_rss_mb
    from megatron.training.parallel import initialize_parallel
    from megatron.training.save_dir import SaveDirLock, prepare_save_dir
    from megatron.training import faults
    from megatron.training.signals import StopFlag, stop_with_launcher
    from megatron.training.watchdog import WatchdogConfig, start_watchdog
    from megatron.training.training import (
        Timer,
        evaluate,
        evaluate_windows,
        lm_forward_step,
        setup_model_and_optimizer,
        train_step,
    )
    from moe_variants.common.files import write_text
    from moe_variants.config import validate

    started = time.monotonic()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ck = c.checkpoint
    with user_input():
        validate(c.model, c.parallel, world)
        if ck.save_interval and not ck.save:
            raise UserError("--save-interval needs --save DIR")
        if ck.overwrite_save and not ck.save:
            raise UserError("--overwrite-save needs --save DIR")
        check_data_paths(c)
        tokenizer = resolve_tokenizer(c)
    stop = StopFlag().install()
    stop_with_launcher()
    lock = None
    watchdog = None
    try:
        pgc = initialize_parallel(c.parallel, seed=c.training.seed,
                                  timeout_minutes=c.training.distributed_timeout_minutes)
        rank = dist.get_rank()
        # the stop flag is agreed on every step: on a CPU (gloo) group it never waits for the GPU
        stop_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        watchdog = start_watchdog(WatchdogConfig(c.training.heartbeat_timeout, c.training.step_timeout), prog=prog)
        if ck.save:  # one writer per directory, refused before anything is built
            def take_lock():
                nonlocal lock
                lock = SaveDirLock(ck.save).acquire()
            _on_rank0(take_lock, rank)
        if c.data.data_path is not None:
            prefixes = parse_data_path(c.data.data_path)[0]
            _on_rank0(lambda: check_token_ids(prefixes, tokenizer.vocab_size), rank)
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

        iteration, consumed, loaded = 0, 0, None
        load = ck.load
        if load and _same_dir(load, ck.save) and not _on_rank0(lambda: _has_checkpoint(load), rank):
            if rank == 0:  # Megatron-LM's `--save DIR --load DIR` idiom on a first run
                print(f"{prog}: no checkpoint in {load} yet; starting from scratch", flush=True)
            load = None
        if load:
            with user_input():
                loaded = load_checkpoint(
                    load, chunks, optimizer, scheduler, layout=layout,
                    load_optimizer=not (ck.no_load_optim or ck.finetune),
                    load_rng=not (ck.no_load_rng or ck.finetune),
                    fallback=ck.load_fallback, expected_configs=config_dict,
                )
            if loaded is None:
                if rank == 0:
                    print(f"{prog}: no checkpoint in {load}; starting from scratch", flush=True)
            elif not ck.finetune:
                iteration, consumed = loaded.iteration, loaded.consumed_samples
                if not loaded.optimizer_loaded:
                    scheduler.step(increment=iteration)  # keep the LR schedule's position
        resumed_from = loaded.path if loaded is not None and not ck.finetune else None
        if lineage is None:
            lineage = (loaded.manifest.get("lineage") if resumed_from else None) or new_lineage()
        start_iteration = iteration
        metrics_path = c.logging.metrics_file or (os.path.join(ck.save, "metrics.jsonl") if ck.save else None)
        if ck.save:
            default_metrics = None if c.logging.metrics_file else metrics_path
            _on_rank0(lambda: prepare_save_dir(
                ck.save, resumed_from=resumed_from, start_iteration=iteration, lineage=lineage,
                configs=config_dict, overwrite=ck.overwrite_save, run_files=(default_metrics,),
            ), rank)
        if after_setup is not None:
            after_setup(chunks, c)

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
        dump = config_yaml(config_dict, prog)
        config_file = os.path.join(ck.save, "config.yaml") if ck.save else None
        if config_file and rank == 0:
            write_text(config_file, dump)
        if c.logging.print_config:
            writer.print(f"{prog}: resolved configuration\n{dump}")
        writer.print(
            f"{prog}: world size {world} (data-parallel {dp_size}), {num_micro} micro-batch(es) of "
            f"{c.training.micro_batch_size} per step, global batch {global_batch}, starting at iteration "
            f"{iteration}" + (f"; configuration in {config_file}" if config_file else "")
        )

        with user_input():
            train_ds, valid_ds, test_ds, train_iter = build_data(
                c, tokenizer, dp_rank=dp_rank, dp_size=dp_size, consumed_samples=consumed, global_batch=global_batch
            )
        in_save_dir = bool(resumed_from) and _same_dir(os.path.dirname(resumed_from), ck.save)
        last_saved = {"iteration": iteration if in_save_dir else None, "path": resumed_from if in_save_dir else None}

        def save(step):
            with paused():
                path = save_checkpoint(
                    ck.save, step, chunks, optimizer, scheduler, consumed_samples=consumed,
                    layout=layout, configs=config_dict, keep_last=ck.keep_last_checkpoints,
                    tokenizer_files=tokenizer_files, lineage=lineage,
                )
            last_saved.update(iteration=step, path=path)
            writer.log_event("checkpoint", step, path=path)
            writer.print(f"{prog}: saved checkpoint {path}")

        def paused():  # evaluation and saves have no step deadline
            return watchdog.paused() if watchdog is not None else contextlib.nullcontext()

        def run_eval(step, split="valid", dataset=None):
            with paused():
                return _run_eval(step, split, dataset)

        def _run_eval(step, split, dataset):
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

        timer_factory = forward_step_factory or (lambda timer: lm_forward_step(timer))
        throughput = Throughput.of(chunks[0].module, c, world)
        last_record = None
        interrupted = False
        summary_stop = None
        loop_start = time.monotonic()
        while iteration < c.training.train_iters:
            if stop.agreed(stop_group):
                interrupted = True
                writer.print(f"{prog}: {stop.name} received; saving and exiting after iteration {iteration}")
                break
            timer = Timer()
            # metrics are read (host syncs, collectives) only on the steps that log them
            log_now = (iteration + 1) % c.logging.log_interval == 0 or iteration + 1 == c.training.train_iters
            m = train_step(
                chunks, optimizer, scheduler, train_iter, model_cfg=c.model, train_cfg=c.training,
                num_microbatches=num_micro, pg_collection=pgc, forward_step_func=timer_factory(timer),
                reduce_metrics=log_now,
            )
            iteration += 1
            consumed += global_batch
            if watchdog is not None:
                watchdog.step_done(iteration)
            faults.inject(rank, iteration)
            if log_now:
                m.fwd_time_s = timer.forward_s
                m.bwd_time_s = max(m.step_time_s - m.optimizer_time_s - timer.forward_s, 0.0)
                last_record = _step_record(iteration, m, peak_rss_mb())
                last_record.update(throughput.record(m))
                elapsed = time.monotonic() - loop_start
                done = iteration - start_iteration
                last_record["elapsed_s"] = elapsed
                writer.log_step(last_record)
                if c.logging.log_progress:
                    writer.print(format_step_line(
                        last_record, c.training.train_iters, elapsed_s=elapsed,
                        eta_s=elapsed / done * (c.training.train_iters - iteration),
                    ))
            if c.logging.eval_interval and iteration % c.logging.eval_interval == 0 and iteration < c.training.train_iters:
                if run_eval(iteration).get("stop"):
                    writer.print(f"{prog}: early stop at iteration {iteration}")
                    summary_stop = iteration
                    break
            if ck.save and ck.save_interval and iteration % ck.save_interval == 0:
                save(iteration)

        summary = {"iteration": iteration, "interrupted": interrupted, "early_stop": summary_stop}
        if interrupted:
            summary["signal"] = stop.name
        if ck.save and iteration > start_iteration and last_saved["iteration"] != iteration:
            save(iteration)
        if not interrupted:
            summary["valid"] = run_eval(iteration, "valid")
            if test_ds is not None and c.logging.eval_iters > 0:
                summary["test"] = run_eval(iteration, "test", test_ds)
            for path in c.data.heldout_text or []:
                with user_input(), paused():
                    windows = build_heldout_windows(path, tokenizer, c.model.seq_length)
                with paused():
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
        summary["checkpoint"] = last_saved["path"] if ck.save else None
        summary["metrics_file"] = metrics_path
        summary["wall_time_s"] = time.monotonic() - started
        writer.log_event("summary", iteration, **{k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
        writer.print(_closing_line(prog, summary, c, start_iteration))
        writer.close()
        if watchdog is not None:
            watchdog.finish()
        return summary
    except BaseException as e:
        if watchdog is not None:  # every other rank stops within two heartbeats, not at the collective timeout
            watchdog.fail(f"{type(e).__name__}: {one_line(e)}" if not isinstance(e, UserError) else one_line(e))
        raise
    finally:
        if lock is not None:
            lock.release()
        stop.restore()


def _closing_line(prog: str, summary: dict, c: Configs, start_iteration: int) -> str:
    from megatron.training.signals import PREEMPTED_EXIT_CODE

    took = _duration(summary["wall_time_s"])
    ckpt = summary.get("checkpoint") or ("none (no --save)" if not c.checkpoint.save else "none")
    where = f"checkpoint {ckpt}; metrics {summary.get('metrics_file') or 'not written (no --save)'}"
    steps = summary["iteration"] - start_iteration
    if summary["interrupted"]:
        return (f"{prog}: stopped by {summary.get('signal', 'a signal')} at iteration {summary['iteration']} "
                f"after {steps} step(s) in {took}; {where}; resume with --load {c.checkpoint.save or 'DIR'} "
                f"(exit code {PREEMPTED_EXIT_CODE})")
    return f"{prog}: finished at iteration {summary['iteration']} ({steps} step(s)) in {took}; {where}"


@record  # anything but bad input: the traceback goes into torchrun's error file too
def main(argv=None, prog: str = "pretrain_gpt") -> int:
    from megatron.training.signals import PREEMPTED_EXIT_CODE

    compat.quiet_warnings()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    def body():
        with user_input():
            configs = parse_configs(argv, prog=prog, description=__doc__)
        try:
            summary = run_pretraining(configs, prog=prog)
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, without saving
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
            return 130
        except dist.DistBackendError as e:  # a peer rank died or hung past --distributed-timeout-minutes
            print(f"{prog}: error: lost contact with another rank ({str(e).strip().splitlines()[0]})",
                  file=sys.stderr, flush=True)
            return 1
        return PREEMPTED_EXIT_CODE if summary["interrupted"] else 0

    return run_cli(prog, body, user_errors=user_errors(), cleanup=destroy_parallel)


def user_errors() -> tuple:
    """The exceptions the training entry points report as one line (exit 2): bad input, and
    checkpoints that cannot be read or written (``CheckpointError`` names the file and the cause,
    e.g. a full disk). Anything else, a ``ValueError`` from inside a step included, keeps its
    traceback."""
    from megatron.training.checkpointing import CheckpointError

    return (UserError, CheckpointError)


if __name__ == "__main__":
    sys.exit(main())
