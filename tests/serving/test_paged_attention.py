"""The batched paged attention (megatron/compat/paged_attention.py) equals the per-request loop,
its reference, on ragged batches: prefill (``flash_attn_varlen_func``), decode
(``flash_attn_with_kvcache``) and MLA decode (``flash_mla_with_kvcache``, output and log-sum-exp).

Each batch mixes requests of different key lengths (0, 1, within one block, spanning several
blocks, with and without a partly filled last block), queries that are a whole prompt, a chunk after
cached keys or one decode token, zero-query requests and padded rows past the last real query;
the blocks of different requests are disjoint and shuffled over a cache whose unused slots hold
NaN (the engine allocates it uninitialised: a slot read past a request's length must not leak).
Grouped-query attention (8 query heads over 2 and over 1 key heads, and 4 over 4), block sizes 1,
4 and 64, and unequal key and value head dims (MLA prefill's uncompressed keys) are covered.

Tolerances. fp32: 1e-5 absolute (the same math in another order: SDPA's blocked softmax against
the loop's fp32 einsums). bf16: the loop computes in fp32 from the same bf16 inputs and rounds once;
SDPA computes in bf16 with fp32 accumulation and may round the probabilities to bf16 before
multiplying by the values, so outputs (|x| < 3 here) may differ by a few bf16 ulps at that
magnitude: 3e-2 absolute (measured on these batches: at most 0.008, one ulp). The MLA decode
computes in fp32 on both paths: output 1e-5 (bf16: one rounding apart, 2e-2), log-sum-exp 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron.compat.paged_attention import (batched_kvcache_attention, batched_mla_decode, batched_varlen_attention,
                                             loop_kvcache_attention, loop_mla_decode, loop_varlen_attention)

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
HEADS = pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 1), (4, 4)])


def paged_cache(lengths, block, channels, gen, dtype, spare_blocks=3):
    """A cache [N, block, *channels] holding each request's tokens in disjoint shuffled blocks and
    NaN everywhere else; its block table [B, M] (-1 past a request's blocks, one spare column)."""
    counts = [math.ceil(n / block) for n in lengths]
    num_blocks = sum(counts) + spare_blocks
    cache = torch.full((num_blocks, block, *channels), float("nan"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lengths), max(counts) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(lengths):
        tokens = torch.randn(n, *channels, generator=gen)
        for j in range(counts[b]):
            table[b, j] = order.pop()
            piece = tokens[j * block:(j + 1) * block]
            cache[table[b, j], :piece.shape[0]] = piece
    return cache.to(dtype), table


def cumulative(lengths) -> torch.Tensor:
    return torch.tensor([0] + torch.cumsum(torch.tensor(lengths), 0).tolist(), dtype=torch.int32)


# (query length, key length) per request: a prompt, a request without keys, a chunk after 9 cached
# keys, decode tokens, a prompt spanning blocks, a one-token prompt
PREFILL = [(5, 5), (0, 0), (7, 16), (1, 11), (1, 1), (23, 23), (1, 40)]


@DTYPES
@HEADS
@pytest.mark.parametrize("block", [1, 4, 64])
def test_varlen_prefill_batched_equals_loop(dtype, heads, kv_heads, block):
    gen = torch.Generator().manual_seed(block * 100 + heads + kv_heads)
    q_lens, k_lens = [q for q, _ in PREFILL], [k for _, k in PREFILL]
    k_cache, table = paged_cache(k_lens, block, (kv_heads, 16 + 8), gen, dtype)
    k_cache, v_cache = k_cache[..., :16], k_cache[..., 16:]  # the same table; value dim 8 != key dim 16
    pad = 5  # padded rows past the last real query
    q = torch.randn(sum(q_lens) + pad, heads, 16, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, cumulative(q_lens), cumulative(k_lens), max(q_lens), max(k_lens))
    kwargs = dict(softmax_scale=0.3, causal=True, block_table=table)
    ref, got = loop_varlen_attention(*args, **kwargs), batched_varlen_attention(*args, **kwargs)
    assert got.shape == ref.shape == (q.shape[0], heads, 8) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=0)
    assert torch.equal(got[-pad:], torch.zeros_like(got[-pad:]))


def test_varlen_without_bounds_or_block_table_equals_loop():
    """No ``max_seqlen_q/k`` (the batched path pads to the packed sizes), keys packed without a
    cache, non-causal."""
    gen = torch.Generator().manual_seed(7)
    q_lens, k_lens = [3, 0, 6, 1], [4, 0, 6, 9]
    q = torch.randn(sum(q_lens) + 2, 4, 8, generator=gen)
    k, v = torch.randn(2, sum(k_lens), 2, 8, generator=gen)
    args = (q, k, v, cumulative(q_lens), cumulative(k_lens))
    for causal in (True, False):
        ref = loop_varlen_attention(*args, causal=causal)
        torch.testing.assert_close(batched_varlen_attention(*args, causal=causal), ref, atol=1e-5, rtol=0)


DECODE = [13, 0, 1, 64, 7, 30]  # key lengths; 0: a padded row


@DTYPES
@HEADS
@pytest.mark.parametrize("block", [1, 4, 64])
def test_kvcache_decode_batched_equals_loop(dtype, heads, kv_heads, block):
    gen = torch.Generator().manual_seed(block * 10 + heads + kv_heads)
    kv_cache, table = paged_cache(DECODE, block, (kv_heads, 32), gen, dtype)
    q = torch.randn(len(DECODE), 1, heads, 16, generator=gen).to(dtype)
    kwargs = dict(q=q, k_cache=kv_cache[..., :16], v_cache=kv_cache[..., 16:],
                  cache_seqlens=torch.tensor(DECODE, dtype=torch.int32), block_table=table, softmax_scale=0.25,
                  causal=True, num_splits=0)
    ref, got = loop_kvcache_attention(**kwargs), batched_kvcache_attention(**kwargs)
    assert got.shape == ref.shape == (len(DECODE), 1, heads, 16) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=0)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@DTYPES
@pytest.mark.parametrize("num_q", [1, 2])
@pytest.mark.parametrize("block", [4, 64])
def test_mla_decode_batched_equals_loop(dtype, num_q, block):
    """Absorbed queries over the paged latent cache (16 latent + 4 rotary channels); ``num_q`` 2 is
    FlashMLA's multi-token decode with the bottom-right causal mask (every request with keys has at
    least ``num_q``: with fewer, a row sees no key, which the loop gives as NaN and the batched
    path, as FlashMLA, as zero)."""
    gen = torch.Generator().manual_seed(block + num_q)
    rank, rope, heads = 16, 4, 8
    decode = [n if n == 0 else max(n, num_q) for n in DECODE]
    cache, table = paged_cache(decode, block, (1, rank + rope), gen, dtype)
    lengths = torch.tensor(decode, dtype=torch.int32)
    q = torch.randn(len(DECODE), num_q, heads, rank + rope, generator=gen).to(dtype)
    args = (q, cache, table, lengths, rank, None, None)
    ref, ref_lse = loop_mla_decode(*args, softmax_scale=0.2, causal=True)
    got, got_lse = batched_mla_decode(*args, softmax_scale=0.2, causal=True)
    assert got.shape == ref.shape == (len(DECODE), num_q, heads, rank) and got.dtype == dtype
    assert got_lse.shape == ref_lse.shape == (len(DECODE), heads, num_q) and got_lse.dtype == torch.float32
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
    assert torch.equal(got_lse.isneginf(), ref_lse.isneginf()) and bool(got_lse[1].isneginf().all())
    torch.testing.assert_close(got_lse.nan_to_num(neginf=0), ref_lse.nan_to_num(neginf=0), atol=1e-5, rtol=0)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
