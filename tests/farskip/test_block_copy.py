"""``FarSkipTransformerBlock.forward`` is a copy of megatron-core's ``TransformerBlock.forward``
(``transformer_block.py:621-800``, listed in megatron/compat/sites.py). With no FarSkip layer
selected it must compute exactly what the upstream forward computes: outputs and parameter
gradients compared with ``torch.equal`` (the same operations in the same order), for a plain and a
``WrappedTensor`` input (how megatron-core's inference hands the embedding over)."""

import torch

from tools.spawn import run_distributed
from tests.helpers import batch, build_and_load, tiny_model_config


def _forward_backward(rank, world, swap: bool, wrapped: bool):
    from megatron.core.utils import WrappedTensor

    from moe_variants.builder import causal_attention_mask
    from moe_variants.config import ParallelConfig
    from moe_variants.farskip.block import FarSkipTransformerBlock

    torch.manual_seed(0)
    model, _ = build_and_load(tiny_model_config(moe_layer_freq=[0, 1]), ParallelConfig())
    if swap:
        model.decoder.__class__ = FarSkipTransformerBlock
    tokens, _ = batch(0)
    seq = tokens.shape[1]
    hidden = model.embedding(tokens, torch.arange(seq)[None].expand_as(tokens))
    rotary = model.rotary_pos_emb(seq)
    out = model.decoder(WrappedTensor(hidden) if wrapped else hidden, causal_attention_mask(seq),
                        rotary_pos_emb=rotary)
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def test_block_copy_is_bit_identical_to_upstream():
    for wrapped in (False, True):
        upstream = run_distributed(_forward_backward, 1, False, wrapped)[0]
        ours = run_distributed(_forward_backward, 1, True, wrapped)[0]
        assert torch.equal(upstream[0], ours[0])
        assert upstream[1].keys() == ours[1].keys() and len(ours[1]) > 10
        for name in upstream[1]:
            assert torch.equal(upstream[1][name], ours[1][name]), name
