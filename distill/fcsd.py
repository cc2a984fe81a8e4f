"""FCSD: convert a pretrained MoE checkpoint to FarSkip connectivity by self-distillation.

    torchrun --nproc_per_node=N -m distill.fcsd --load CKPT --farskip all --save OUT \\
        --data-path ... --tokenizer-type ... [training flags as pretrain_gpt] \\
        [--kd-loss kl|kl+l2|sft] [--kd-temperature T] [--freeze-embeddings] \\
        [--proxy heldout-kl|heldout-ppl|lm-eval] [--proxy-text FILE] [--patience P] [--min-delta D] \\
        [--proxy-task TASK [--proxy-metric M] --proxy-include-path DIR --proxy-data-dir DIR --proxy-limit N]

The teacher is a frozen copy of the checkpoint with its original connectivity (no gradients, eval
mode, not in the optimizer); the student is the same weights with ``--farskip`` connectivity and is
trained with the pretraining loop (megatron-core DDP, optimizer, schedule) on
``KL(teacher || student)`` per token (paper Eq. 4), optionally plus an intermediate hidden-state L2
(``kl+l2``), or plain next-token loss (``sft``, the baseline). Model shape flags default to the
checkpoint's. Every ``--eval-interval`` steps a proxy (held-out KL to the teacher, held-out
perplexity, or a metric of an lm-eval task through ``megatron.training.lm_eval_adapter``, its
direction taken from the task's ``higher_is_better``: accuracy up, perplexity down) is evaluated, on
``--proxy-text``, else the first ``--heldout-text``, else the training data's validation split; the
best student is kept in ``SAVE/best`` and training stops after ``--patience`` evaluations without a ``--min-delta`` (relative) improvement (paper: patience 20,
delta 2%). Tensor/expert/data parallelism as in pretraining; pipeline parallelism is not supported
(teacher and student would have to be pipelined together).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from megatron import compat
from distill.losses import student_ce
from megatron.components.parallel import destroy_parallel
from megatron.common.cli import UserError, run_cli, user_input
from distill.scoring import heldout_kl, lm_eval_scores, make_lm_eval_spec
from moe_variants.farskip.config import FarSkipConfig

__all__ = ["FCSDConfig", "KDLoss", "main", "run_fcsd"]


class KDLoss(str, enum.Enum):
    kl = "kl"
    kl_l2 = "kl+l2"
    sft = "sft"


class Proxy(str, enum.Enum):
    heldout_kl = "heldout-kl"
    heldout_ppl = "heldout-ppl"
    lm_eval = "lm-eval"  # --proxy-task's main metric through the lm-eval adapter (the paper: MBPP+)


@dataclasses.dataclass
class FCSDConfig:
    kd_loss: KDLoss = KDLoss.kl
    """distillation loss: KL to the teacher, KL plus hidden-state L2, or plain next-token loss (the SFT
    baseline)"""
    kd_temperature: float = 1.0
    """softmax temperature of the KL"""
    kd_l2_coeff: float = 1.0
    """kl+l2: weight of the hidden-state L2 term"""
    freeze_embeddings: bool = False
    """keep the input embedding and output layer frozen"""
    teacher_load: Optional[str] = None
    """teacher checkpoint; default: --load"""
    proxy: Proxy = Proxy.heldout_kl
    """early-stopping proxy: held-out KL to the teacher, held-out perplexity, or an lm-eval task's metric"""
    proxy_text: Optional[str] = None
    """text scored by the proxy; default: the first --heldout-text, else the training data's validation
    split"""
    proxy_max_windows: Optional[int] = 64
    """windows of the proxy text scored per evaluation"""
    proxy_task: Optional[str] = None
    """--proxy lm-eval: the task (e.g. local_arc_easy)"""
    proxy_metric: Optional[str] = None
    """--proxy lm-eval: metric[,filter]; default: the task's main metric"""
    proxy_limit: Optional[float] = None
    """--proxy lm-eval: examples (or a fraction) per evaluation"""
    proxy_include_path: Optional[str] = None
    """--proxy lm-eval: task YAML directory"""
    proxy_data_dir: Optional[str] = None
    """--proxy lm-eval: data of the offline local_* tasks"""
    patience: int = 20
    """evaluations without a --min-delta improvement before stopping"""
    min_delta: float = 0.02
    """relative improvement that counts (paper: 2%)"""

    def __post_init__(self):
        for name, enum_type in (("kd_loss", KDLoss), ("proxy", Proxy)):
            value = getattr(self, name)
            if not isinstance(value, enum_type):
                try:
                    setattr(self, name, enum_type(value))
                except ValueError:
                    choices = ", ".join(m.value for m in enum_type)
                    raise UserError(f"--{name.replace('_', '-')} {value!r} is not one of: {choices}") from None
        if self.kd_temperature <= 0:
            raise UserError(f"--kd-temperature must be > 0, got {self.kd_temperature}")
        if not self.kd_l2_coeff >= 0:  # also NaN
            raise UserError(f"--kd-l2-coeff must be >= 0, got {self.kd_l2_coeff}")
        if self.proxy != Proxy.lm_eval:
            for name in ("proxy_task", "proxy_metric", "proxy_limit", "proxy_include_path", "proxy_data_dir"):
                if getattr(self, name) is not None:
                    raise UserError(f"--{name.replace('_', '-')} applies to --proxy lm-eval only "
                                     f"(got --proxy {self.proxy.value})")


def _freeze_embeddings(model) -> None:
    for name, param in model.named_parameters():
        if name.startswith("embedding.") or name.startswith("output_layer."):
            param.requires_grad_(False)


class _HiddenCapture:
    """Collects each decoder layer's output (the full residual stream) for ``kl+l2``."""

    def __init__(self, model):
        from moe_variants.farskip.block import FarSkipTransformerBlock

        self.states: list = []
        self.handles = []
        block = model.decoder
        if isinstance(block, FarSkipTransformerBlock):
            block.layer_output_sink = self.states
        else:
            for layer in block.layers:
                self.handles.append(layer.register_forward_hook(lambda m, i, o: self.states.append(o[0])))

    def take(self) -> list:
        out, self.states[:] = list(self.states), []
        return out


def make_forward_step_factory(teacher, cfg: FCSDConfig):
    """The loop's ``forward_step_func`` for distillation (teacher forward, then student)."""
    from distill.losses import hidden_state_l2, kl_divergence, masked_token_mean
    from moe_variants.builder import causal_attention_mask
    from megatron.components.parallel import device
    from megatron.training.step import to_device

    def factory(timer):
        captures = {}

        def forward_step(data_iterator, model):
            if timer is not None:
                timer.begin("forward")
            batch = to_device(next(data_iterator), device())
            tokens, positions = batch["tokens"], batch["position_ids"]
            mask = causal_attention_mask(tokens.shape[1], device=tokens.device)
            student = model.module if hasattr(model, "module") else model
            if cfg.kd_loss == KDLoss.kl_l2 and "student" not in captures:
                captures["student"] = _HiddenCapture(student)
                captures["teacher"] = _HiddenCapture(teacher)
            teacher_logits = None
            if cfg.kd_loss != KDLoss.sft:
                with torch.no_grad():
                    teacher_logits = teacher(tokens, positions, mask)
            logits = model(tokens, positions, mask)

            def loss_func(student_logits):
                loss_mask = batch["loss_mask"]
                ce = masked_token_mean(student_ce(student_logits, batch["labels"]), loss_mask)
                report = {"lm_loss": ce.detach().clone()}
                if cfg.kd_loss == KDLoss.sft:
                    return ce, report
                kl = kl_divergence(student_logits, teacher_logits, loss_mask, cfg.kd_temperature)
                loss = kl
                report["kd_loss"] = kl.detach().clone()
                if cfg.kd_loss == KDLoss.kl_l2:
                    l2 = hidden_state_l2(captures["student"].take(), captures["teacher"].take(), loss_mask)
                    loss = loss + cfg.kd_l2_coeff * l2
                    report["hidden_l2"] = l2.detach().clone()
                return loss, report

            if timer is not None:
                timer.end("forward")
            return logits, loss_func

        return forward_step

    return factory


def run_fcsd(c, fcsd: FCSDConfig, prog: str = "fcsd") -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from distill.early_stopping import EarlyStopping
    from megatron.components.checkpointing import find_latest_checkpoint, new_lineage, read_manifest, save_checkpoint
    from megatron.training.data import build_heldout_windows
    from megatron.components.loading import load_model
    from megatron.training.pretrain_gpt import run_pretraining

    if c.parallel.pipeline_model_parallel_size != 1:
        raise UserError("FCSD needs --pipeline-model-parallel-size 1 (teacher and student run side by side)")
    teacher_path = fcsd.teacher_load or c.checkpoint.load
    resume = None
    if c.checkpoint.save and os.path.isdir(c.checkpoint.save):
        resume = find_latest_checkpoint(c.checkpoint.save, fallback=c.checkpoint.load_fallback, offer_fallback=True)
    if resume:  # continue this distillation run (its lineage: the best/ saves prune the same run's)
        c.checkpoint.load, c.checkpoint.finetune = c.checkpoint.save, False
        lineage = read_manifest(resume, verify=False).get("lineage") or new_lineage()
    else:  # start from the pretrained weights: new optimizer, iteration 0
        c.checkpoint.finetune = True
        lineage = new_lineage()
    proxy_text = fcsd.proxy_text or (c.data.heldout_text or [None])[0]
    with user_input():  # the proxy's task, data and metric are user input
        lm_eval_spec = _lm_eval_proxy(fcsd, c.training.micro_batch_size) if fcsd.proxy == Proxy.lm_eval else None
        if proxy_text is not None and not os.path.isfile(proxy_text):
            raise UserError(f"--proxy-text {proxy_text}: no such file")
        mode = "min"
        if lm_eval_spec is not None:
            proxy_metric, higher = _lm_eval_proxy_metric(fcsd, lm_eval_spec)
            mode = "max" if higher else "min"
    stopper = EarlyStopping(patience=fcsd.patience, min_delta=fcsd.min_delta, mode=mode)
    state = {}

    def after_setup(chunks, configs):
        with user_input():
            teacher, _, tokenizer, _ = load_model(teacher_path, parallel=configs.parallel, overrides={"farskip": "none"})
        for p in teacher.parameters():
            p.requires_grad_(False)
        windows = None
        if proxy_text is not None:
            windows = build_heldout_windows(proxy_text, tokenizer, configs.model.seq_length)
        elif lm_eval_spec is None:  # the training data's own validation split
            windows = validation_windows(configs, fcsd.proxy_max_windows or 64)
        if windows is not None and fcsd.proxy_max_windows:
            windows = windows[: fcsd.proxy_max_windows]
        state.update(teacher=teacher, windows=windows, pgc=ProcessGroupCollection.use_mpu_process_groups(),
                     tokenizer=tokenizer, seq_length=configs.model.seq_length)
        before = evaluate(0, chunks)
        if dist.get_rank() == 0:
            print(f"{prog}: student before distillation: " + json.dumps(before), flush=True)
        state["before"] = before

    def evaluate(iteration, chunks):
        student = chunks[0].module
        result = {}
        if state["windows"] is not None:
            result = heldout_kl(student, state["teacher"], state["windows"],
                                micro_batch_size=c.training.micro_batch_size, pg_collection=state["pgc"])
        if lm_eval_spec is not None:

            was_training = student.training
            student.eval()
            try:
                scores = lm_eval_scores(student, state["tokenizer"], state["seq_length"], state["pgc"], lm_eval_spec)
            finally:
                student.train(was_training)
            value = scores[fcsd.proxy_task].get(proxy_metric)
            if value is None:
                raise UserError(f"--proxy-metric {proxy_metric}: not in the results of {fcsd.proxy_task} "
                                 f"({', '.join(k for k in scores[fcsd.proxy_task] if 'stderr' not in k)})")
            result.update(lm_eval_task=fcsd.proxy_task, lm_eval_metric=proxy_metric.split(",")[0],
                          lm_eval_value=float(value), lm_eval_mode=stopper.mode)
        if iteration == 0:
            return result
        if fcsd.proxy == Proxy.lm_eval:
            value = result["lm_eval_value"]
        else:
            value = result["heldout_kl" if fcsd.proxy == Proxy.heldout_kl else "heldout_ppl"]
        new_best, stop = stopper.update(iteration, value)
        result.update(proxy=fcsd.proxy.value, best=stopper.best, best_step=stopper.best_step, stop=stop)
        if new_best and c.checkpoint.save:
            best_dir = os.path.join(c.checkpoint.save, "best")
            from megatron.components.arguments import configs_to_dict
            from megatron.components.checkpointing import layout_of
            from megatron.components.tokenizer import tokenizer_files_of

            configs = configs_to_dict(c)
            configs["tokenizer"] = {"type": c.data.tokenizer_type or "HuggingFaceTokenizer"}
            save_checkpoint(best_dir, iteration, chunks, None, None, layout=layout_of(c.parallel, c.training, dist.get_world_size()),
                            configs=configs, keep_last=1, tokenizer_files=tokenizer_files_of(c), lineage=lineage)
        return result

    summary = run_pretraining(
        c, prog=prog, forward_step_factory=make_forward_step_factory(_TeacherRef(state), fcsd),
        evaluate_hook=evaluate, after_setup=after_setup,
        before_wrap=_freeze_embeddings if fcsd.freeze_embeddings else None, lineage=lineage,
    )
    summary["before"] = state.get("before")
    summary["best"] = {"step": stopper.best_step, "value": stopper.best, "proxy": fcsd.proxy.value}
    summary["early_stopping_history"] = stopper.history
    return summary


def validation_windows(c, max_windows: int) -> torch.Tensor:
    """``[N, S+1]`` windows of the training data's validation split (the proxy's text when no
    ``--proxy-text``/``--heldout-text`` is given): the first ``max_windows`` samples, identical on
    every rank. Collective (the dataset indices are built rank-0-first)."""
    from megatron.training.data import build_pretraining_datasets
    from megatron.training.preprocess import ensure_embedded_dataset
    from megatron.components.tokenizer import resolve_tokenizer

    cache = c.data.data_cache_path or os.path.join(c.checkpoint.save or ".", "data_cache")
    data_path = c.data.data_path if c.data.data_path is not None else [ensure_embedded_dataset(cache)]
    _, valid, _ = build_pretraining_datasets(
        data_path, c.data.split, c.model.seq_length, c.training.seed, (1, max_windows, 1),
        resolve_tokenizer(c), cache)
    if valid is None or len(valid) == 0:
        raise UserError(f"FCSD early stopping needs --proxy-text FILE, --heldout-text FILE or a validation "
                         f"split of the data (--split {c.data.split} has none)")
    samples = [valid[i] for i in range(min(len(valid), max_windows))]
    return torch.stack([torch.cat([torch.as_tensor(s["tokens"]), torch.as_tensor(s["labels"])[-1:]]).long()
                        for s in samples])


def _lm_eval_proxy(fcsd: FCSDConfig, batch_size: int):
    """The lm-eval early-stopping proxy, checked before any model loads (one-line errors)."""

    if not fcsd.proxy_task:
        raise UserError("--proxy lm-eval needs --proxy-task TASK (e.g. local_arc_easy)")
    return make_lm_eval_spec(
        [fcsd.proxy_task], include_path=fcsd.proxy_include_path, data_dir=fcsd.proxy_data_dir,
        limit=fcsd.proxy_limit, batch_size=batch_size,
        flags={"tasks": "--proxy-task", "include_path": "--proxy-include-path", "data_dir": "--proxy-data-dir",
               "limit": "--proxy-limit"})


def _lm_eval_proxy_metric(fcsd: FCSDConfig, spec) -> tuple[str, bool]:
    """(results key ``metric,filter``, higher is better) of the proxy, from the task's config."""
    higher = spec.higher_is_better.get(fcsd.proxy_task)
    if higher is None:
        raise UserError(f"--proxy-task {fcsd.proxy_task}: a group or tag; the proxy needs one task")
    metric = fcsd.proxy_metric or spec.default_metric(fcsd.proxy_task)
    if metric is None:
        raise UserError(f"--proxy-task {fcsd.proxy_task}: no accuracy or perplexity metric; "
                         f"pass --proxy-metric (one of {', '.join(higher)})")
    name = metric.split(",")[0]
    if name not in higher:
        raise UserError(f"--proxy-metric {metric}: not a metric of {fcsd.proxy_task} (one of {', '.join(higher)})")
    return (metric if "," in metric else f"{metric},none"), bool(higher[name])


class _TeacherRef(torch.nn.Module):
    """Forwards to the teacher once ``after_setup`` has built it (the step factory is made first)."""

    def __init__(self, state):
        super().__init__()
        self._state = state

    def forward(self, *args, **kwargs):
        return self._state["teacher"](*args, **kwargs)

    @property
    def decoder(self):
        return self._state["teacher"].decoder


def _checkpoint_model_defaults(argv) -> dict:
    """Model-shape, tokenizer and data flags default to the checkpoint's (the student must match
    the teacher; distilling on the teacher's own training data is the no-extra-data default)."""
    from megatron.components.loading import checkpoint_configs

    load = None
    for i, arg in enumerate(argv):
        if arg == "--load" and i + 1 < len(argv):
            load = argv[i + 1]
        elif arg.startswith("--load="):
            load = arg.split("=", 1)[1]
    if load is None:
        raise UserError("FCSD needs --load CKPT (the pretrained model to convert)")
    configs, manifest, _ = checkpoint_configs(load)
    defaults = configs.model.flat()
    data = manifest["configs"].get("data", {})
    for key in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "data_path", "split"):
        if data.get(key) is not None:
            defaults[key] = data[key]
    return defaults


@record  # anything but bad input: the traceback goes into torchrun's error file too
def main(argv=None) -> int:
    import logging

    from megatron.training.pretrain_gpt import user_errors
    from megatron.common.process import EXIT_PREEMPTED

    compat.quiet_warnings()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from megatron.components.arguments import parse_configs

    argv = list(sys.argv[1:] if argv is None else argv)

    def body():
        wants_help = any(a in ("-h", "--help") for a in argv)
        with user_input():
            defaults = {} if wants_help else _checkpoint_model_defaults(argv)
            configs = parse_configs(argv, prog="fcsd", extra_sections={"fcsd": FCSDConfig}, defaults=defaults,
                                    description=__doc__)
        if FarSkipConfig.of(configs.model).farskip.empty and configs.extra["fcsd"].kd_loss != KDLoss.sft:
            raise UserError("--farskip none: nothing to convert (choose all, first:N, last:N or A-B)")
        summary = run_fcsd(configs, configs.extra["fcsd"])
        if dist.get_rank() == 0:
            print("fcsd: summary " + json.dumps({k: summary.get(k) for k in ("before", "best", "iteration", "early_stop")}), flush=True)
        return EXIT_PREEMPTED if summary["interrupted"] else 0

    return run_cli("fcsd", body, user_errors=user_errors(), cleanup=destroy_parallel)


if __name__ == "__main__":
    sys.exit(main())
