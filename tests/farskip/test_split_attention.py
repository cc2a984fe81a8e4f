"""``megatron.compat.split_attention``: a prefill step's core attention computed in two halves by heads
equals the undivided call, bit for bit, with both plain-torch paged kernels; the output projection
waits for ``finish()``; decode steps and unsupported attentions are not split."""

from __future__ import annotations

import types

import pytest
import torch

from megatron.compat.paged_attention import batched_varlen_attention, loop_varlen_attention
from megatron.compat.split_attention import HeadSplit, head_halves

BLOCK, BLOCKS, HEADS, DIM, DIM_V = 16, 64, 4, 24, 16


def _step(q_lengths, k_lengths, seed=0):
    """A paged prefill step: packed queries, caches, block table and cumulative lengths."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(BLOCKS, BLOCK, HEADS, DIM, generator=gen)
    v_cache = torch.randn(BLOCKS, BLOCK, HEADS, DIM_V, generator=gen)
    table = torch.randperm(BLOCKS, generator=gen)[: 3 * 16].view(3, 16).int()[: len(q_lengths)]
    cu_q = torch.tensor([0, *q_lengths]).cumsum(0).int()
    cu_k = torch.tensor([0, *k_lengths]).cumsum(0).int()
    q = torch.randn(int(cu_q[-1]) + 3, HEADS, DIM, generator=gen)  # 3 padding rows, as the engine pads
    return q, k_cache, v_cache, table, cu_q, cu_k


def _kv_heads(step, heads):
    q, k, v, table, cu_q, cu_k = step
    k, v = k[..., :heads, :].contiguous(), v[..., :heads, :].contiguous()
    return q, k, v, table, cu_q, cu_k


@pytest.mark.parametrize("kernel", [batched_varlen_attention, loop_varlen_attention])
@pytest.mark.parametrize("key_heads", [HEADS, 2, 1])  # multi-head, grouped-query, multi-query
def test_heads_in_two_halves_equal_the_whole_call(kernel, key_heads):
    """Requests of 64 new tokens over 64 keys, 50 over 150 (a cached prefix) and 1 over 9."""
    q, k, v, table, cu_q, cu_k = _kv_heads(_step([64, 50, 1], [64, 150, 9]), key_heads)
    whole = kernel(q, k, v, cu_q, cu_k, 64, 150, causal=True, block_table=table)
    halves = head_halves(HEADS, key_heads)
    parts = [kernel(q[..., qh, :], k[..., kh, :], v[..., kh, :], cu_q, cu_k, 64, 150, causal=True, block_table=table)
             for qh, kh in halves]
    assert torch.equal(torch.cat(parts, dim=-2), whole)


def test_head_halves_pair_query_heads_with_the_key_heads_they_read():
    assert head_halves(8, 4) == [(slice(0, 4), slice(0, 2)), (slice(4, 8), slice(2, 4))]
    assert head_halves(8, 1) == [(slice(0, 4), slice(0, 1)), (slice(4, 8), slice(0, 1))]
    assert head_halves(1, 1) is None and head_halves(6, 3) is None and head_halves(3, 3) is None


class _Projection(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(HEADS * DIM_V, 8))

    def forward(self, x):
        return x @ self.weight, None


class _Attention(torch.nn.Module):
    """upstream's dynamic-engine tail: kernel, a view to [T, 1, H*Dv], the output projection"""

    def __init__(self, **config):
        super().__init__()
        self.config = types.SimpleNamespace(**config)
        self.linear_proj = _Projection()
        self.calls = 0

    def flash_decode_and_prefill(self, q, k, v, max_q, max_k, cu_q, cu_k, seqlens_k, table, decode_only):
        self.calls += 1
        out = batched_varlen_attention(q.squeeze(1), k, v, cu_q, cu_k, max_q, max_k, causal=True, block_table=table)
        return out.unsqueeze(1)

    def forward(self, step, decode_only=False):
        q, k, v, table, cu_q, cu_k = step
        out = self.flash_decode_and_prefill(q[:, None], k, v, 64, 150, cu_q, cu_k, cu_k[1:] - cu_k[:-1], table,
                                            decode_only)
        return self.linear_proj(out.view(out.shape[0], 1, -1))


def test_the_forward_defers_its_second_half_and_projection_until_finish():
    step = _step([64, 50, 1], [64, 150, 9])
    attn = _Attention()
    with torch.no_grad():
        reference, _ = attn(step)
        split = HeadSplit(attn)
        with split.early():
            early = attn(step)
        assert early == (None, None) and split.deferred and attn.calls == 2
        output, bias = split.finish()
        assert torch.equal(output, reference) and bias is None and attn.calls == 3
        assert "forward" not in attn.linear_proj.__dict__ and "flash_decode_and_prefill" not in attn.__dict__
        with pytest.raises(RuntimeError, match="nothing deferred"):
            split.finish()
        with split.early():  # a decode step runs whole
            output, _ = attn(step, decode_only=True)
        assert not split.deferred and torch.equal(output, reference)


def test_an_attention_that_changes_the_kernel_output_is_refused():
    with pytest.raises(ValueError, match="output gate"):
        with HeadSplit(_Attention(attention_output_gate=True)).early():
            pass


@pytest.mark.parametrize("extra,message", [
    ({}, "--farskip-inference-heads needs --farskip-impl overlapped"),
    ({"farskip_impl": "overlapped", "farskip_inference_split": True}, "cannot be combined with --farskip-inference-split"),
    ({"farskip_impl": "overlapped", "farskip_async_tp": True}, "cannot be combined with --farskip-inference-split or"),
])
def test_the_heads_schedule_is_refused_where_it_cannot_run(extra, message):
    from moe_variants.config import ParallelConfig, validate
    from tests.helpers import tiny_model_config

    with pytest.raises(ValueError, match=message):
        validate(tiny_model_config(farskip="all", farskip_inference_heads=True, **extra), ParallelConfig())
