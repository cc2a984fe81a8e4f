"""A tiny MoE trained with ``--attention-backend local`` (megatron-core's ``DotProductAttention``)
and with the SDPA backends gives the same losses, and the two models hold the same checkpoint.

Six training steps (Adam, lr 1e-2) of the tests' 2-layer MoE at sequence 64 on one gloo rank,
through the trainer's ``setup_model_and_optimizer`` and ``train_step``, for a standard model and
an MLA one, from the same seed and data. Tolerance: 1e-5 relative per step's loss. The attention
outputs differ by a few fp32 ulps (``test_sdpa_attention``: up to 3.6e-7 relative); Adam's
normalised updates and six steps at lr 1e-2 amplify that: measured 0 (standard) and 1e-7 (MLA).

The models have the same parameters (none in either core attention): the same ``state_dict`` and
dist-checkpoint keys and shapes, so a checkpoint saved with one backend loads with the other.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tools.spawn import run_distributed

TOLERANCE = 1e-5
STEPS = 6
SEQ = 64


def _train(rank, world, backend: str, mla: bool):
    from megatron.core.utils import unwrap_model

    from megatron.components.config import TrainingConfig
    from megatron.components.parallel import initialize_parallel
    from megatron.training.step import setup_model_and_optimizer, train_step
    from moe_variants.attention import describe
    from moe_variants.config import ParallelConfig
    from tests.helpers import VOCAB, batch, tiny_model_config

    extra = dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
                 v_head_dim=8) if mla else {}
    model_cfg = tiny_model_config(attention_backend=backend, seq_length=SEQ, **extra)
    parallel = ParallelConfig()
    train_cfg = TrainingConfig(micro_batch_size=2, global_batch_size=2, train_iters=STEPS, lr=1e-2, lr_warmup_iters=0)
    pgc = initialize_parallel(parallel, seed=5)
    chunks, optimizer, scheduler = setup_model_and_optimizer(model_cfg, parallel, train_cfg, vocab_size=VOCAB,
                                                             pg_collection=pgc)
    losses = []
    for step in range(STEPS):
        tokens, labels = batch(step, seq_length=SEQ)
        micro = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(tokens, dtype=torch.float),
                 "position_ids": torch.arange(SEQ)[None].expand_as(tokens)}
        losses.append(train_step(chunks, optimizer, scheduler, itertools.repeat(micro), model_cfg=model_cfg,
                                 train_cfg=train_cfg, num_microbatches=1, pg_collection=pgc).lm_loss)
    model = unwrap_model(chunks[0])
    keys = {k: tuple(v.shape) for k, v in model.state_dict().items() if torch.is_tensor(v)}
    sharded = sorted(model.sharded_state_dict(metadata={"dp_cp_group": pgc.dp_cp}).keys())
    return losses, keys, sharded, describe(model)


@pytest.mark.parametrize("mla", [False, True], ids=["gqa-free", "mla"])
def test_same_losses_and_checkpoint_with_either_attention(mla):
    [(ref_losses, ref_keys, ref_sharded, ref_line)] = run_distributed(_train, 1, "local", mla, timeout_s=300)
    [(losses, keys, sharded, line)] = run_distributed(_train, 1, "auto", mla, timeout_s=300)
    errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    assert max(errors) <= TOLERANCE, f"losses {losses} vs {ref_losses}"
    assert losses[-1] < losses[0]  # it trained
    assert keys == ref_keys and sharded == ref_sharded
    assert ref_line == "megatron-core DotProductAttention (--attention-backend local)"
    assert line == "torch scaled_dot_product_attention, flash kernel (--attention-backend auto)"
