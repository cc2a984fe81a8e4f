"""One optimizer step through megatron-core's DDP, optimizer and pipeline schedule.

This is the loop body shared by pretraining, FCSD distillation and the EP benchmark: the same
``setup_model_and_optimizer`` / ``train_step`` / ``evaluate`` run on 2 CPU ranks (gloo, through
the compat seam) and on GPU clusters (NCCL). Batches are dicts of ``tokens``, ``labels``,
``loss_mask`` and ``position_ids`` ([b, s] each) as megatron-core's ``GPTDataset`` yields them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from moe_variants.config import ModelConfig, ParallelConfig
from megatron.components.config import TrainingConfig
from moe_variants.builder import build_model, causal_attention_mask
from moe_variants.common.moe_layer import comm_totals, reset_comm_counters
from megatron.common import collectives
from moe_variants.common import timing

logger = logging.getLogger("megatron.training")

__all__ = [
    "StepMetrics",
    "setup_model_and_optimizer",
    "train_step",
    "evaluate",
    "lm_forward_step",
]


@dataclasses.dataclass
class StepMetrics:
    """What one optimizer step did, reduced over data-parallel ranks where it is a loss."""

    lm_loss: float
    aux_loss: float
    grad_norm: Optional[float]
    lr: float
    step_time_s: float
    fwd_time_s: float
    bwd_time_s: float
    optimizer_time_s: float
    tokens: int  # tokens processed by all data-parallel ranks in this step
    skipped: bool
    comm: dict  # expert-parallel communication counters summed over this rank's MoE layers
    extra: dict = dataclasses.field(default_factory=dict)  # other reported losses (e.g. kd_loss)

    @property
    def loss(self) -> float:
        return self.lm_loss + self.aux_loss

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0


def setup_model_and_optimizer(
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    train_cfg: TrainingConfig,
    *,
    vocab_size: int,
    pg_collection=None,
    before_wrap=None,
    build_kwargs: Optional[dict] = None,
):
    """Build the model, wrap it in megatron-core DDP, and create the optimizer and LR schedule.

    ``before_wrap(model)`` runs on the bare model first (e.g. to freeze parameters: DDP and the
    optimizer only take parameters that require gradients). ``build_kwargs`` go to ``build_model``
    (the EP benchmark's upstream peers build megatron-core's own MoE layer).

    Returns ``(model_chunks, optimizer, scheduler)``; ``model_chunks`` is a one-element list of
    ``DistributedDataParallel`` (megatron-core's convention for virtual pipeline chunks).
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model = build_model(model_cfg, parallel, vocab_size=vocab_size, pg_collection=pg_collection, **(build_kwargs or {}))
    if before_wrap is not None:
        before_wrap(model)
    config = model.config
    if train_cfg.overlap_grad_reduce:
        from moe_variants.common import wgrad

        if wgrad.disable(model):
            logger.warning("--overlap-grad-reduce: deferred expert weight gradients are off (they would "
                           "reach megatron-core's gradient buckets after the buckets are reduced)")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=train_cfg.use_distributed_optimizer,
        overlap_grad_reduce=train_cfg.overlap_grad_reduce,
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    opt_config = OptimizerConfig(
        optimizer=train_cfg.optimizer.value,
        lr=train_cfg.lr,
        min_lr=train_cfg.min_lr,
        weight_decay=train_cfg.weight_decay,
        adam_beta1=train_cfg.adam_beta1,
        adam_beta2=train_cfg.adam_beta2,
        adam_eps=train_cfg.adam_eps,
        clip_grad=train_cfg.clip_grad,
        bf16=model_cfg.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=train_cfg.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    decay_iters = train_cfg.lr_decay_iters or train_cfg.train_iters
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if train_cfg.lr_warmup_iters else train_cfg.lr,
        max_lr=train_cfg.lr,
        min_lr=train_cfg.min_lr,
        lr_warmup_steps=train_cfg.lr_warmup_iters,
        lr_decay_steps=max(decay_iters, train_cfg.lr_warmup_iters + 1),
        lr_decay_style=train_cfg.lr_decay_style.value,
        start_wd=train_cfg.weight_decay,
        end_wd=train_cfg.weight_decay,
        wd_incr_steps=decay_iters,
        wd_incr_style="constant",
        wsd_decay_steps=train_cfg.lr_wsd_decay_iters,
        lr_wsd_decay_style="linear" if train_cfg.lr_decay_style.value == "WSD" else None,
    )
    use_fused_adam(optimizer)
    return [ddp], optimizer, scheduler


def torch_optimizers(optimizer) -> list:
    """The ``torch.optim`` optimizers under a megatron-core optimizer (chained or not)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for opt in chained for inner in torch_optimizers(opt)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def use_fused_adam(optimizer, fused: bool = True) -> int:
    """Step torch's Adam/AdamW under ``optimizer`` with torch's fused kernel (``fused=True``: one
    kernel over all tensors of a group, instead of the multi-tensor ``foreach`` loop megatron-core
    gets by default without Transformer Engine or apex, whose own Adam is fused). Applies to groups
    whose parameters are all floating CUDA or CPU tensors (the devices torch's fused Adam runs on);
    the step is the same Adam up to float rounding. Call it again after loading optimizer state
    (a checkpoint's parameter groups carry their own switches). Returns the groups switched."""
    switched = 0
    for opt in torch_optimizers(optimizer):
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in opt.param_groups:
            if all(p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in group["params"]):
                group["fused"], group["foreach"] = (True, False) if fused else (None, None)
                switched += 1
    return switched


def masked_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of a [b, s] loss over tokens where ``loss_mask`` is 1."""
    mask = loss_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def to_device(batch: dict, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


class Timer(timing.SpanTimer):
    """The step's timers on this rank's device clock (``moe_variants.common.timing``): host time on
    CPU, CUDA events on the compute stream on GPU (host clocks there would time kernel launches).
    ``forward`` spans accumulate over micro-batches; ``forward_s`` reads them (and waits for them)."""

    def __init__(self, clock=None):
        from megatron.components.parallel import device

        super().__init__(clock if clock is not None else timing.clock_for(device()))

    @property
    def forward_s(self) -> float:
        return self.seconds("forward")


def lm_forward_step(timer: Optional[Timer] = None, loss_fn: Optional[Callable] = None):
    """A megatron-core ``forward_step_func`` for next-token prediction.

    ``loss_fn(per_token_loss, batch, model) -> (loss, report_dict)`` can replace the default
    masked-mean cross entropy (FCSD uses this to add distillation terms).
    """
    from megatron.components.parallel import device

    def forward_step(data_iterator, model):
        if timer is not None:
            timer.begin("forward")
        batch = to_device(next(data_iterator), device())
        tokens = batch["tokens"]
        seq = tokens.shape[1]
        output = model(
            tokens,
            batch["position_ids"],
            causal_attention_mask(seq, device=tokens.device),
            labels=batch["labels"],
        )

        def loss_func(per_token_loss):
            if loss_fn is not None:
                loss, report = loss_fn(per_token_loss, batch, model)
            else:
                loss = masked_mean(per_token_loss.float(), batch["loss_mask"])
                report = {"lm_loss": loss.detach().clone()}
            return loss, report

        if timer is not None:
            timer.end("forward")
        return output, loss_func

    return forward_step


def _reduce_mean(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    collectives.all_reduce(t, group=group)
    return float(t.item()) / dist.get_world_size(group)


def device_loss_means(reports: list) -> dict:
    """{name: mean over micro-batches} of the reported losses, as device tensors (no host sync)."""
    if not reports:
        return {}
    return {key: torch.stack([r[key].detach().float().reshape(()) for r in reports]).mean() for key in reports[0]}


def reduce_loss_means(losses: dict, group, *, count: int = 1) -> dict:
    """Data-parallel means of ``losses`` (device tensors summed over ``count`` steps), as floats:
    one all-reduce and one host sync for all of them."""
    if not losses:
        return {}
    keys = sorted(losses)
    packed = torch.stack([losses[k].double() for k in keys])
    collectives.all_reduce(packed, group=group)
    values = (packed / (dist.get_world_size(group) * count)).tolist()
    return dict(zip(keys, values))


def _moe_aux_loss(model_cfg: ModelConfig, num_microbatches: int, pg_collection) -> float:
    """Coefficient-weighted MoE auxiliary losses (summed over layers) accumulated in megatron-core's
    tracker over ``num_microbatches`` micro-batches (one step's, or a log interval's), then reset."""
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if not tracker:
        return 0.0
    moe_utils.reduce_aux_losses_tracker_across_ranks(pg_collection=pg_collection)
    coeff = {"load_balancing_loss": model_cfg.moe_aux_loss_coeff, "z_loss": model_cfg.moe_z_loss_coeff or 0.0}
    total = 0.0
    for name, entry in tracker.items():
        total += coeff.get(name, 0.0) * float(entry["values"].sum()) / num_microbatches
    moe_utils.clear_aux_losses_tracker()
    return total


def train_step(
    model_chunks,
    optimizer,
    scheduler,
    data_iterator: Iterator[dict],
    *,
    model_cfg: ModelConfig,
    train_cfg: TrainingConfig,
    num_microbatches: int,
    pg_collection=None,
    forward_step_func=None,
    reduce_metrics: bool = True,
) -> StepMetrics:
    """Run ``num_microbatches`` forward/backward passes (gradient accumulation) and one update.

    ``reduce_metrics=False`` (the training loop's steps between log intervals) skips everything
    that waits for the device or the other ranks: the losses are not read or reduced (NaN in the
    result), the MoE auxiliary-loss tracker is zeroed on the device, the timers and the
    all-to-all counters are not read. megatron-core's gradient clipping still reads the norm on
    the host, as in Megatron-LM."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    reset_comm_counters(model_chunks)
    timer = Timer()
    step_fn = forward_step_func or lm_forward_step(timer)
    timer.mark("start")
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reports = _run_schedule(step_fn, data_iterator, model_chunks, num_microbatches, model_cfg, train_cfg,
                            forward_only=False)
    timer.mark("forward_backward")
    update_ok, grad_norm, _ = optimizer.step()
    if update_ok:
        scheduler.step(increment=1)
    timer.mark("end")
    dp = dist.get_world_size(pg_collection.dp)
    tokens = num_microbatches * train_cfg.micro_batch_size * model_cfg.seq_length * dp
    if not reduce_metrics:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.clear_aux_losses_tracker()
        nan = float("nan")
        return StepMetrics(lm_loss=nan, aux_loss=nan, grad_norm=None if grad_norm is None else float(grad_norm),
                           lr=optimizer.param_groups[0]["lr"], step_time_s=0.0, fwd_time_s=0.0, bwd_time_s=0.0,
                           optimizer_time_s=0.0, tokens=tokens, skipped=not update_ok, comm={})
    # off the last pipeline stage there are no reports
    values = reduce_loss_means(device_loss_means(reports), pg_collection.dp) if reports else {}
    lm_loss = values.pop("lm_loss", 0.0)
    extra = values
    aux = _moe_aux_loss(model_cfg, num_microbatches, pg_collection)
    return StepMetrics(
        lm_loss=lm_loss,
        aux_loss=aux,
        grad_norm=None if grad_norm is None else float(grad_norm),
        lr=optimizer.param_groups[0]["lr"],
        step_time_s=timer.between("start", "end"),
        fwd_time_s=timer.forward_s,
        bwd_time_s=max(timer.between("start", "forward_backward") - timer.forward_s, 0.0),
        optimizer_time_s=timer.between("forward_backward", "end"),
        tokens=tokens,
        skipped=not update_ok,
        comm=comm_totals(model_chunks),
        extra=extra,
    )


def _run_schedule(step_fn, data_iterator, model_chunks, num_microbatches: int, model_cfg: ModelConfig,
                  train_cfg: TrainingConfig, *, forward_only: bool) -> list:
    """One call of megatron-core's pipeline schedule (``get_forward_backward_func``): the reports of
    every micro-batch on the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=step_fn, data_iterator=data_iterator, model=model_chunks,
        num_microbatches=num_microbatches, seq_length=model_cfg.seq_length,
        micro_batch_size=train_cfg.micro_batch_size, forward_only=forward_only,
    )


@torch.no_grad()
def evaluate(
    model_chunks,
    data_iterator: Iterator[dict],
    *,
    model_cfg: ModelConfig,
    train_cfg: TrainingConfig,
    eval_iters: int,
    num_microbatches: int = 1,
    pg_collection=None,
) -> dict:
    """Mean next-token loss and perplexity over ``eval_iters`` x ``num_microbatches`` batches."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils

    pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    for chunk in model_chunks:
        chunk.eval()
    losses = []
    try:
        for _ in range(eval_iters):
            reports = _run_schedule(lm_forward_step(), data_iterator, model_chunks, num_microbatches, model_cfg,
                                    train_cfg, forward_only=True)
            if reports:
                losses.extend(float(r["lm_loss"]) for r in reports)
    finally:
        for chunk in model_chunks:
            chunk.train()
        moe_utils.clear_aux_losses_tracker()
    loss = sum(losses) / len(losses) if losses else 0.0
    loss = _reduce_mean(loss, pg_collection.dp)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}


@torch.no_grad()
def evaluate_windows(
    model_chunks,
    windows: torch.Tensor,
    *,
    model_cfg: ModelConfig,
    micro_batch_size: int,
    pg_collection=None,
) -> dict:
    """Perplexity of fixed token windows [N, S+1] (e.g. ``data.build_heldout_windows``).

    Windows are dealt round-robin to data-parallel ranks; ranks with fewer batches run dummy
    batches with an all-zero loss mask, so every rank issues the same collectives (expert
    parallelism needs the ranks in lockstep). Returns the token-weighted ``loss`` and ``ppl``.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils

    pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    dp_rank = dist.get_rank(pg_collection.dp)
    dp_size = dist.get_world_size(pg_collection.dp)
    seq = windows.shape[1] - 1
    if seq != model_cfg.seq_length:
        raise ValueError(f"windows of {seq} tokens but --seq-length is {model_cfg.seq_length}")
    mine = windows[dp_rank::dp_size]
    num_batches = torch.tensor([math.ceil(len(mine) / micro_batch_size)], dtype=torch.long)
    collectives.all_reduce(num_batches, op=dist.ReduceOp.MAX, group=pg_collection.dp)
    batches = []
    for i in range(int(num_batches.item())):
        chunk = mine[i * micro_batch_size : (i + 1) * micro_batch_size]
        mask = torch.ones(len(chunk), seq)
        if len(chunk) < micro_batch_size:  # pad with dummies that score nothing
            pad = micro_batch_size - len(chunk)
            chunk = torch.cat([chunk, windows[:1].expand(pad, -1)], 0)
            mask = torch.cat([mask, torch.zeros(pad, seq)], 0)
        batches.append({
            "tokens": chunk[:, :-1], "labels": chunk[:, 1:], "loss_mask": mask,
            "position_ids": torch.arange(seq)[None].expand(micro_batch_size, -1),
        })

    def nll_sum(per_token_loss, batch, model):
        mask = batch["loss_mask"].to(per_token_loss.dtype)
        total = (per_token_loss.float() * mask).sum()
        return total, {"nll": total.detach().clone(), "tokens": mask.sum().detach().clone()}

    for chunk in model_chunks:
        chunk.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    try:
        reports = get_forward_backward_func()(
            forward_step_func=lm_forward_step(loss_fn=nll_sum),
            data_iterator=iter(batches),
            model=model_chunks,
            num_microbatches=len(batches),
            seq_length=seq,
            micro_batch_size=micro_batch_size,
            forward_only=True,
        ) if batches else []
        for r in reports or []:
            totals[0] += float(r["nll"])
            totals[1] += float(r["tokens"])
    finally:
        for chunk in model_chunks:
            chunk.train()
        moe_utils.clear_aux_losses_tracker()
    collectives.all_reduce(totals, group=pg_collection.dp)
    loss = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": int(totals[1])}
