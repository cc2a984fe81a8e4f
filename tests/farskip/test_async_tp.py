"""FarSkip's §4.2 inference variant: with TP > 1 the attention projection's tensor-parallel
reduction flies behind the layer's MoE (``--farskip-async-tp``).

TP=2 x EP=2 on 4 CPU ranks (sequence parallel, as megatron-core requires for MoE with TP): the
forward-only logits equal the synchronous path exactly (the same collective, waited later; the
same additions in the same order), and the layer does wait the reduction after its experts.
"""

import pytest
import torch

from tools.spawn import run_distributed
from moe_variants.config import ParallelConfig
from tests.helpers import batch, build_and_load, forward_loss, tiny_model_config


def _logits(rank, world, async_tp):
    from moe_variants.builder import causal_attention_mask
    from moe_variants.common import comm
    from moe_variants.common.moe_layer import comm_counters

    cfg = tiny_model_config(farskip="all", farskip_impl="overlapped", farskip_async_tp=async_tp)
    model, _ = build_and_load(cfg, ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2))
    model.eval()
    timeline = comm.TimelineRecorder()
    for counters in comm_counters(model):
        counters.timeline = timeline
    tokens, _ = batch(rank // 2)  # the two TP ranks of a data-parallel replica see the same batch
    seq = tokens.shape[1]
    with torch.no_grad():
        logits = model(tokens, torch.arange(seq)[None].expand_as(tokens), causal_attention_mask(seq))
    waited = [e[0] for e in timeline.events if e[0].startswith("finish attention reduction")]
    return logits, len(waited)


def test_async_tp_reduction_equals_the_synchronous_path():
    sync = run_distributed(_logits, 4, False, timeout_s=300)
    asynchronous = run_distributed(_logits, 4, True, timeout_s=300)
    for rank in range(4):
        assert torch.equal(sync[rank][0], asynchronous[rank][0])
        assert sync[rank][1] == 0 and asynchronous[rank][1] == 2  # one per FarSkip MoE layer


def _train_step(rank, world):
    cfg = tiny_model_config(farskip="all", farskip_impl="overlapped", farskip_async_tp=True)
    model, _ = build_and_load(cfg, ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2))
    tokens, labels = batch(rank // 2)
    try:
        forward_loss(model, tokens, labels)
    except ValueError as err:
        return str(err)
    return None


def test_async_tp_is_refused_with_gradients():
    assert run_distributed(_train_step, 4, timeout_s=300) == ["--farskip-async-tp is for inference (forward only, no gradients)"] * 4


def test_async_tp_needs_the_overlapped_full_mode():
    with pytest.raises(ValueError, match="--farskip-async-tp needs --farskip-impl overlapped"):
        from moe_variants.config import validate

        validate(tiny_model_config(farskip="all", farskip_async_tp=True), ParallelConfig())
