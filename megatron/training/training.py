"""The training loop as a small trainer with named steps (``Trainer``: validate, setup, loop,
finalize), shared by pretraining (``pretrain_gpt``), FCSD distillation (``distill.fcsd``) and the
time-to-quality benchmark. What it uses lives by purpose: the tokenizer the flags name
(``tokenizer``), the datasets and iterators (``data``), a step's record and throughput
(``metrics``, ``flops``), the resolved configuration (``arguments``). Behaviour, flags and exit
codes: ``megatron/training/pretrain_gpt.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Callable, Optional

import torch.distributed as dist

from megatron.components.arguments import Configs, config_yaml, configs_to_dict
from megatron.common.cli import UserError, one_line, user_input
from megatron.common.events import Event
from megatron.common.process import EXIT_PREEMPTED, record_failure
from megatron.training.data import build_data, check_data_paths, eval_iterator
from megatron.training.flops import Throughput
from megatron.training.metrics import step_record
from megatron.components.tokenizer import resolve_tokenizer, tokenizer_files_of

__all__ = ["Trainer", "TrainerHooks", "STEP_END"]

# Emitted with the step's number (1-based) on every rank after each training step, before its
# evaluation and save; what subscribes from outside the loop (``tools.faults.rank``) runs there.
STEP_END = Event("training step end")


def _on_rank0(fn, rank: int):
    """Run ``fn`` (a validation) on rank 0 only; every rank returns its result or raises its
    one-line error (``checkpointing.from_rank0``)."""
    from megatron.components.checkpointing import from_rank0

    return from_rank0(fn, user_errors=True)


def _has_checkpoint(directory: str) -> bool:
    from megatron.components.checkpointing import MANIFEST, checkpoint_candidates

    if not os.path.isdir(directory):
        return False
    return os.path.isfile(os.path.join(directory, MANIFEST)) or bool(checkpoint_candidates(directory))


def _same_dir(a: Optional[str], b: Optional[str]) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def _duration(seconds: float) -> str:
    from megatron.training.metrics import format_duration

    return format_duration(seconds)


@dataclasses.dataclass
class TrainerHooks:
    """What an application changes in the loop (FCSD distillation uses all of them).

    ``forward_step_factory(timer)`` replaces the next-token forward step; ``evaluate(iteration,
    model_chunks) -> dict`` adds metrics at each evaluation (a true ``"stop"`` entry, identical on
    all ranks, ends training early); ``after_setup(model_chunks, configs)`` runs once the model is
    built and loaded; ``before_wrap(model)`` on the bare model before DDP and the optimizer."""

    forward_step_factory: Optional[Callable] = None
    evaluate: Optional[Callable] = None
    after_setup: Optional[Callable] = None
    before_wrap: Optional[Callable] = None


class Trainer:
    """The training loop in named steps: ``validate`` (before any process group: bad input is one
    line), ``setup`` (process groups, watchdog, save-directory lock, model and optimizer, resume,
    metrics, data), ``loop`` (steps, evaluations, saves, the stop signal), ``finalize`` (last save,
    final evaluations, the summary). ``run`` does all four and returns the summary; its
    ``interrupted`` entry is true when a signal stopped the run (after saving)."""

    def __init__(self, c: Configs, *, prog: str = "pretrain_gpt", hooks: Optional[TrainerHooks] = None,
                 lineage: Optional[str] = None):
        self.c = c
        self.prog = prog
        self.hooks = hooks or TrainerHooks()
        self.lineage = lineage  # default: the resumed checkpoint's, else a new one
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.started = time.monotonic()
        self.watchdog = None
        self.lock = None
        self.stop = None

    # ------------------------------------------------------------------------------------ run
    def run(self) -> dict:
        self.validate()
        from megatron.training.signals import StopFlag, stop_with_launcher

        self.stop = StopFlag().install()
        stop_with_launcher()
        try:
            self.setup()
            self.loop()
            summary = self.finalize()
            if self.watchdog is not None:
                self.watchdog.finish()
            return summary
        except BaseException as e:
            if self.watchdog is not None:  # the other ranks stop within two heartbeats, not at the collective timeout
                self.watchdog.fail(one_line(e) if isinstance(e, UserError) else f"{type(e).__name__}: {one_line(e)}")
            raise
        finally:
            if self.lock is not None:
                self.lock.release()
            self.stop.restore()

    # ------------------------------------------------------------------------------- validate
    def validate(self) -> None:
        from moe_variants.config import validate

        c, ck = self.c, self.c.checkpoint
        with user_input():
            validate(c.model, c.parallel, self.world)
            if ck.save_interval and not ck.save:
                raise UserError("--save-interval needs --save DIR")
            if ck.overwrite_save and not ck.save:
                raise UserError("--overwrite-save needs --save DIR")
            check_data_paths(c)
            self.tokenizer = resolve_tokenizer(c)

    # ---------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        from megatron.core import parallel_state

        from megatron.components.checkpointing import layout_of
        from megatron.training.data import check_token_ids, parse_data_path
        from megatron.components.parallel import initialize_parallel
        from megatron.training.save_dir import SaveDirLock
        from megatron.training.step import lm_forward_step, setup_model_and_optimizer
        from megatron.training.watchdog import WatchdogConfig, start_watchdog

        c, ck, t = self.c, self.c.checkpoint, self.c.training
        self.pgc = initialize_parallel(c.parallel, seed=t.seed, timeout_minutes=t.distributed_timeout_minutes)
        self.rank = dist.get_rank()
        # the stop flag is agreed on every step: on a CPU (gloo) group it never waits for the GPU
        self.stop_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self.watchdog = start_watchdog(WatchdogConfig.of(t), prog=self.prog, armed_at=self.started)
        if ck.save:  # one writer per directory, refused before anything is built
            def take_lock():
                self.lock = SaveDirLock(ck.save).acquire()
            _on_rank0(take_lock, self.rank)
        if c.data.data_path is not None:
            prefixes = parse_data_path(c.data.data_path)[0]
            _on_rank0(lambda: check_token_ids(prefixes, self.tokenizer.vocab_size), self.rank)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.num_micro = t.num_microbatches(self.dp_size)
        self.global_batch = t.resolved_global_batch_size(self.dp_size)
        self.chunks, self.optimizer, self.scheduler = setup_model_and_optimizer(
            c.model, c.parallel, t, vocab_size=self.tokenizer.vocab_size, pg_collection=self.pgc,
            before_wrap=self.hooks.before_wrap,
        )
        self.config_dict = configs_to_dict(c)
        self.tokenizer_files = tokenizer_files_of(c)
        self.config_dict["tokenizer"] = {
            "type": c.data.tokenizer_type or "HuggingFaceTokenizer", "vocab_size": self.tokenizer.vocab_size,
        }
        self.layout = layout_of(c.parallel, t, self.world)
        self._resume()
        if self.hooks.after_setup is not None:
            self.hooks.after_setup(self.chunks, c)
        self._open_metrics()
        self.train_ds, self.valid_ds, self.test_ds, self.train_iter = build_data(
            c, self.tokenizer, dp_rank=self.dp_rank, dp_size=self.dp_size, consumed_samples=self.consumed,
            global_batch=self.global_batch,
        )
        self.forward_step_factory = self.hooks.forward_step_factory or (lambda timer: lm_forward_step(timer))
        self.throughput = Throughput.of(self.chunks[0].module, c, self.world)

    def _resume(self) -> None:
        """Load ``--load`` (if it has a checkpoint) and prepare the save directory."""
        from megatron.components.checkpointing import load_checkpoint, new_lineage
        from megatron.training.save_dir import prepare_save_dir
        from megatron.training.step import use_fused_adam

        c, ck, rank = self.c, self.c.checkpoint, self.rank
        self.iteration, self.consumed, loaded = 0, 0, None
        load = ck.load
        if load and _same_dir(load, ck.save) and not _on_rank0(lambda: _has_checkpoint(load), rank):
            if rank == 0:  # Megatron-LM's `--save DIR --load DIR` idiom on a first run
                print(f"{self.prog}: no checkpoint in {load} yet; starting from scratch", flush=True)
            load = None
        if load:
            loaded = load_checkpoint(
                load, self.chunks, self.optimizer, self.scheduler, layout=self.layout,
                load_optimizer=not (ck.no_load_optim or ck.finetune),
                load_rng=not (ck.no_load_rng or ck.finetune),
                fallback=ck.load_fallback, offer_fallback=True, expected_configs=self.config_dict,
                verify=ck.verify_checkpoint,
            )
            if loaded is None:
                if not ck.allow_empty_load:  # a mistyped fine-tune source must not train from random weights
                    err = UserError(f"--load {load} holds no checkpoint (a mistyped path?): pass "
                                    "--allow-empty-load to start from scratch when it is empty")
                    err.agreed = True  # every rank found none
                    raise err
                if rank == 0:
                    print(f"{self.prog}: no checkpoint in {load}; starting from scratch", flush=True)
            else:
                if loaded.optimizer_loaded:
                    use_fused_adam(self.optimizer)  # the checkpoint's parameter groups replaced the switch
                if not ck.finetune:
                    self.iteration, self.consumed = loaded.iteration, loaded.consumed_samples
                    if not loaded.optimizer_loaded:
                        self.scheduler.step(increment=self.iteration)  # keep the LR schedule's position
        resumed_from = loaded.path if loaded is not None and not ck.finetune else None
        self.loaded_from = loaded.path if loaded is not None else None
        if self.lineage is None:
            self.lineage = (loaded.manifest.get("lineage") if resumed_from else None) or new_lineage()
        self.start_iteration = self.iteration
        self.metrics_path = c.logging.metrics_file or (os.path.join(ck.save, "metrics.jsonl") if ck.save else None)
        if ck.save:
            default_metrics = None if c.logging.metrics_file else self.metrics_path
            _on_rank0(lambda: prepare_save_dir(
                ck.save, resumed_from=resumed_from, start_iteration=self.iteration, lineage=self.lineage,
                configs=self.config_dict, overwrite=ck.overwrite_save, run_files=(default_metrics,),
            ), rank)
        in_save_dir = bool(resumed_from) and _same_dir(os.path.dirname(resumed_from), ck.save)
        self.last_saved = {"iteration": self.iteration if in_save_dir else None,
                           "path": resumed_from if in_save_dir else None}

    def _open_metrics(self) -> None:
        from megatron.training.metrics import MetricsWriter
        from megatron.common.files import write_text

        c, ck = self.c, self.c.checkpoint
        self.writer = MetricsWriter(
            enabled=self.rank == self.world - 1 if c.parallel.pipeline_model_parallel_size > 1 else self.rank == 0,
            jsonl_path=self.metrics_path,
            tensorboard_dir=c.logging.tensorboard_dir,
            wandb_project=c.logging.wandb_project,
            wandb_exp_name=c.logging.wandb_exp_name,
            wandb_mode=c.logging.wandb_mode.value,
            wandb_save_dir=c.logging.wandb_save_dir,
            config=self.config_dict,
        )
        dump = config_yaml(self.config_dict, self.prog)
        config_file = os.path.join(ck.save, "config.yaml") if ck.save else None
        if config_file and self.rank == 0:
            write_text(config_file, dump)
        if c.logging.print_config:
            self.writer.print(f"{self.prog}: resolved configuration\n{dump}")
        self.writer.print(
            f"{self.prog}: world size {self.world} (data-parallel {self.dp_size}), {self.num_micro} micro-batch(es) "
            f"of {c.training.micro_batch_size} per step, global batch {self.global_batch}, starting at iteration "
            f"{self.iteration}{_loaded_note(self.loaded_from, ck.finetune)}"
            + (f"; configuration in {config_file}" if config_file else "")
        )
        from moe_variants import attention
        from moe_variants.common import experts

        for what, line in (("attention", attention.describe(self.chunks[0])),
                           ("routed experts", experts.describe(self.chunks[0]))):
            if line:
                self.writer.print(f"{self.prog}: {what}: {line}")

    # ----------------------------------------------------------------------------------- loop
    def loop(self) -> None:
        """Train until ``--train-iters``, a stop signal (``self.interrupted``) or an early stop."""
        c, ck = self.c, self.c.checkpoint
        self.last_record = None
        self.interrupted = False
        self.early_stop = None
        self.loop_start = time.monotonic()
        if self.watchdog is not None:
            self.watchdog.loop_started(self.iteration)
        while self.iteration < c.training.train_iters:
            if self.stop.agreed(self.stop_group):
                self.interrupted = True
                self.writer.print(f"{self.prog}: {self.stop.name} received; saving and exiting after iteration "
                                  f"{self.iteration}")
                break
            self.train_one_step()
            STEP_END.emit(self.iteration)
            it = self.iteration
            if c.logging.eval_interval and it % c.logging.eval_interval == 0 and it < c.training.train_iters:
                if self.evaluate(it).get("stop"):
                    self.writer.print(f"{self.prog}: early stop at iteration {it}")
                    self.early_stop = it
                    break
            if ck.save and ck.save_interval and it % ck.save_interval == 0:
                self.save(it)

    def train_one_step(self) -> None:
        from megatron.training.metrics import format_step_line, peak_rss_mb
        from megatron.training.step import Timer, train_step

        c = self.c
        timer = Timer()
        # metrics are read (host syncs, collectives) only on the steps that log them
        log_now = (self.iteration + 1) % c.logging.log_interval == 0 or self.iteration + 1 == c.training.train_iters
        m = train_step(
            self.chunks, self.optimizer, self.scheduler, self.train_iter, model_cfg=c.model, train_cfg=c.training,
            num_microbatches=self.num_micro, pg_collection=self.pgc,
            forward_step_func=self.forward_step_factory(timer), reduce_metrics=log_now,
        )
        self.iteration += 1
        self.consumed += self.global_batch
        if self.watchdog is not None:
            self.watchdog.step_done(self.iteration)
        if not log_now:
            return
        m.fwd_time_s = timer.forward_s
        m.bwd_time_s = max(m.step_time_s - m.optimizer_time_s - timer.forward_s, 0.0)
        record = step_record(self.iteration, m, peak_rss_mb())
        record.update(self.throughput.record(m))
        elapsed = time.monotonic() - self.loop_start
        record["elapsed_s"] = elapsed
        self.writer.log_step(record)
        self.last_record = record
        if c.logging.log_progress:
            done = self.iteration - self.start_iteration
            self.writer.print(format_step_line(
                record, c.training.train_iters, elapsed_s=elapsed,
                eta_s=elapsed / done * (c.training.train_iters - self.iteration),
            ))

    def paused(self, what: str):
        """Evaluation and saves have their own deadline instead of the step's (``--eval-timeout``,
        ``--save-timeout``; ``megatron.training.watchdog.PAUSES``)."""
        return self.watchdog.paused(what) if self.watchdog is not None else contextlib.nullcontext()

    def save(self, step: int) -> None:
        from megatron.components.checkpointing import save_checkpoint

        ck = self.c.checkpoint
        self.finish_pending_save()
        with self.paused("checkpoint save"):
            path = save_checkpoint(
                ck.save, step, self.chunks, self.optimizer, self.scheduler, consumed_samples=self.consumed,
                layout=self.layout, configs=self.config_dict, keep_last=ck.keep_last_checkpoints,
                tokenizer_files=self.tokenizer_files, lineage=self.lineage,
                verify=ck.verify_checkpoint, async_save=ck.async_save,
            )
        self.last_saved.update(iteration=step, path=path)
        if ck.async_save:
            self.writer.print(f"{self.prog}: writing checkpoint {path} in the background")
        else:
            self.writer.log_event("checkpoint", step, path=path)
            self.writer.print(f"{self.prog}: saved checkpoint {path}")

    def finish_pending_save(self) -> None:
        """An ``--async-save`` in flight becomes a checkpoint (collective)."""
        from megatron.components.checkpointing import finalize_pending_save

        with self.paused("checkpoint save"):
            done = finalize_pending_save()
        if done:
            self.writer.log_event("checkpoint", self.last_saved["iteration"], path=done)
            self.writer.print(f"{self.prog}: saved checkpoint {done}")

    def evaluate(self, step: int, split: str = "valid", dataset=None) -> dict:
        from megatron.training.step import evaluate

        c = self.c
        dataset = self.valid_ds if dataset is None else dataset
        result = {}
        with self.paused("evaluation"):
            if dataset is not None and c.logging.eval_iters > 0:
                result = evaluate(
                    self.chunks, eval_iterator(dataset, c, self.dp_rank, self.dp_size), model_cfg=c.model,
                    train_cfg=c.training, eval_iters=c.logging.eval_iters,
                    num_microbatches=self.num_micro, pg_collection=self.pgc,
                )
            if self.hooks.evaluate is not None:
                result.update(self.hooks.evaluate(step, self.chunks))
        if result:
            self.writer.log_event(split, step, **result)
            self.writer.print(
                f"{self.prog}: {split} at iter {step}: "
                + " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
            )
        return result

    # ------------------------------------------------------------------------------- finalize
    def finalize(self) -> dict:
        """The last save (and the one in flight), the final evaluations and the summary."""
        from megatron.training.data import build_heldout_windows
        from megatron.training.metrics import peak_rss_mb
        from megatron.training.step import evaluate_windows

        c, ck, it = self.c, self.c.checkpoint, self.iteration
        summary = {"iteration": it, "interrupted": self.interrupted, "early_stop": self.early_stop}
        if self.interrupted:
            summary["signal"] = self.stop.name
        if ck.save and it > self.start_iteration and self.last_saved["iteration"] != it:
            self.save(it)
        if ck.save:
            self.finish_pending_save()
        if not self.interrupted:
            summary["valid"] = self.evaluate(it, "valid")
            if self.test_ds is not None and c.logging.eval_iters > 0:
                summary["test"] = self.evaluate(it, "test", self.test_ds)
            for path in c.data.heldout_text or []:
                with user_input(), self.paused("evaluation"):
                    windows = build_heldout_windows(path, self.tokenizer, c.model.seq_length)
                with self.paused("evaluation"):
                    result = evaluate_windows(
                        self.chunks, windows, model_cfg=c.model, micro_batch_size=c.training.micro_batch_size,
                        pg_collection=self.pgc,
                    )
                result["file"] = path
                summary.setdefault("heldout", []).append(result)
                self.writer.log_event("heldout", it, **result)
                self.writer.print(
                    f"{self.prog}: held-out {path}: loss {result['loss']:.4f} | ppl {result['ppl']:.2f} "
                    f"over {result['tokens']} tokens"
                )
        if self.last_record is not None:
            summary["last_step"] = self.last_record
        summary["peak_rss_mb"] = peak_rss_mb()
        summary["checkpoint"] = self.last_saved["path"] if ck.save else None
        summary["metrics_file"] = self.metrics_path
        summary["wall_time_s"] = time.monotonic() - self.started
        self.writer.log_event("summary", it, **{k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
        closing = _closing_line(self.prog, summary, c, self.start_iteration)
        self.writer.print(closing)
        if self.interrupted:  # exit 75 under torchrun: its closing summary shows how to resume
            record_failure(closing)
        self.writer.close()
        return summary


def _loaded_note(path, finetune: bool) -> str:
    """Where the start line says the run's state came from: the checkpoint it resumed from (its
    iteration is the start) or, for ``--finetune``, the one whose weights it starts with."""
    if path is None:
        return ""
    return f" (weights of {path})" if finetune else f" (resumed from {path})"


def _closing_line(prog: str, summary: dict, c: Configs, start_iteration: int) -> str:
    took = _duration(summary["wall_time_s"])
    ckpt = summary.get("checkpoint") or ("none (no --save)" if not c.checkpoint.save else "none")
    where = f"checkpoint {ckpt}; metrics {summary.get('metrics_file') or 'not written (no --save)'}"
    steps = summary["iteration"] - start_iteration
    if summary["interrupted"]:
        return (f"{prog}: stopped by {summary.get('signal', 'a signal')} at iteration {summary['iteration']} "
                f"after {steps} step(s) in {took}; {where}; resume with --load {c.checkpoint.save or 'DIR'} "
                f"(exit code {EXIT_PREEMPTED})")
    return f"{prog}: finished at iteration {summary['iteration']} ({steps} step(s)) in {took}; {where}"
