"""The plain-torch flash-attn equivalents (megatron/compat/paged_attention.py: the per-request loop
and the batched path, each) against megatron-core's static-batching attention path.

The reference is megatron-core's own ``DotProductAttention`` (what ``Attention.forward`` runs
with a ``StaticInferenceContext`` or no context) on dense [s, b, h, d] tensors with a causal mask;
the equivalents read the same keys/values scattered over a paged cache through a shuffled block
table, for a mixed batch of prefills, a chunked prefill (queries after cached keys) and decodes.
Tolerance 1e-5 absolute in fp32: same math, different summation order.

The FlashMLA equivalent (``paged_mla_decode``) is checked against multi-latent attention computed
the unabsorbed way: per-head keys and values up-projected from the latents, then softmax attention;
its absorbed queries over the paged latent cache, followed by the value up-projection, must give
the same outputs (1e-5) and the same log-sum-exp.
"""

import pytest
import torch

from megatron.compat.paged_attention import PagedAttention, kernels

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def _core_attention(q_SHD, k_SHD, v_SHD):
    """megatron-core's DotProductAttention (static path) on one sequence, GQA, causal (call under
    ``_in_world``)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                            num_query_groups=KV_HEADS, attention_dropout=0.0, use_cpu_initialization=True)
    attn = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                               pg_collection=ProcessGroupCollection.use_mpu_process_groups()).eval()
    lq, lk = q_SHD.shape[0], k_SHD.shape[0]
    # bottom-right causal: query i of the chunk sits at position lk - lq + i
    mask = torch.ones(lq, lk, dtype=torch.bool).triu(lk - lq + 1)[None, None]
    with torch.no_grad():
        out = attn(q_SHD[:, None], k_SHD[:, None], v_SHD[:, None], mask, attn_mask_type=AttnMaskType.arbitrary)
    return out[:, 0].reshape(lq, HEADS, DIM)


def _in_world(fn):
    """Run ``fn`` in a forked one-rank world with megatron-core's parallel state."""
    from tools.spawn import run_distributed

    def rank_fn(rank, world_size):
        from megatron.components.parallel import initialize_parallel
        from moe_variants.config import ParallelConfig

        initialize_parallel(ParallelConfig(), seed=0)
        return fn()

    return run_distributed(rank_fn, 1, timeout_s=120)[0]


def _paged(keys_per_request, gen):
    """Scatter each request's [L, Hk, D] keys over a cache of shuffled blocks."""
    num_blocks = sum((k.shape[0] + BLOCK - 1) // BLOCK for k in keys_per_request) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)  # garbage where unused
    max_blocks = max((k.shape[0] + BLOCK - 1) // BLOCK for k in keys_per_request)
    table = torch.full((len(keys_per_request), max_blocks), -1, dtype=torch.int32)
    for b, k in enumerate(keys_per_request):
        for j in range((k.shape[0] + BLOCK - 1) // BLOCK):
            blk = order.pop()
            table[b, j] = blk
            piece = k[j * BLOCK:(j + 1) * BLOCK]
            cache[blk, :piece.shape[0]] = piece
    return cache, table


PATHS = pytest.mark.parametrize("path", list(PagedAttention), ids=lambda p: p.value)


@PATHS
def test_varlen_prefill_and_chunk_match_static_attention(path):
    _in_world(lambda: _varlen_case(kernels(path)["flash_attn_varlen_func"]))


def _varlen_case(paged_varlen_attention):
    gen = torch.Generator().manual_seed(0)
    # (query length, key length): two prefills, a prefill chunk after 6 cached tokens, a decode
    shapes = [(5, 5), (9, 9), (3, 9), (1, 7)]
    qs = [torch.randn(lq, HEADS, DIM, generator=gen) for lq, _ in shapes]
    ks = [torch.randn(lk, KV_HEADS, DIM, generator=gen) for _, lk in shapes]
    vs = [torch.randn(lk, KV_HEADS, DIM, generator=gen) for _, lk in shapes]
    k_cache, table = _paged(ks, torch.Generator().manual_seed(1))
    v_cache, _ = _paged(vs, torch.Generator().manual_seed(1))
    pad = 3  # the engine pads the packed tokens; padded rows must come out zero
    q = torch.cat(qs + [torch.randn(pad, HEADS, DIM, generator=gen)])
    cu_q = torch.tensor([0] + torch.cumsum(torch.tensor([s[0] for s in shapes]), 0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.cumsum(torch.tensor([s[1] for s in shapes]), 0).tolist(), dtype=torch.int32)
    out = paged_varlen_attention(q, k_cache, v_cache, cu_q, cu_k, 9, 9, softmax_scale=DIM ** -0.5,
                                 causal=True, block_table=table)
    for b in range(len(shapes)):
        ref = _core_attention(qs[b], ks[b], vs[b])
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], ref, atol=1e-5, rtol=0)
    assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:]))


@PATHS
def test_kvcache_decode_matches_static_attention(path):
    _in_world(lambda: _kvcache_case(kernels(path)["flash_attn_with_kvcache"]))


def _kvcache_case(paged_kvcache_attention):
    gen = torch.Generator().manual_seed(2)
    lengths = [1, 6, 13]
    ks = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in lengths]
    vs = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in lengths]
    k_cache, table = _paged(ks, torch.Generator().manual_seed(3))
    v_cache, _ = _paged(vs, torch.Generator().manual_seed(3))
    # a padded decode row: no blocks, length 0
    table = torch.cat([table, torch.full((1, table.shape[1]), -1, dtype=torch.int32)])
    q = torch.randn(len(lengths) + 1, 1, HEADS, DIM, generator=gen)
    out = paged_kvcache_attention(q=q, k_cache=k_cache, v_cache=v_cache,
                                  cache_seqlens=torch.tensor(lengths + [0], dtype=torch.int32),
                                  causal=True, block_table=table, num_splits=0)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b], _core_attention(q[b], ks[b], vs[b]), atol=1e-5, rtol=0)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@PATHS
def test_unsupported_arguments_are_refused(path):
    paged_varlen_attention = kernels(path)["flash_attn_varlen_func"]
    q = torch.zeros(2, 1, HEADS, DIM)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        paged_varlen_attention(q[:, 0], q[:, 0], q[:, 0], torch.tensor([0, 2]), torch.tensor([0, 2]), dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="window_size"):
        paged_varlen_attention(q[:, 0], q[:, 0], q[:, 0], torch.tensor([0, 2]), torch.tensor([0, 2]),
                               window_size=(4, 0))


@PATHS
def test_mla_decode_over_paged_latents_equals_unabsorbed_attention(path):
    paged_mla_decode = kernels(path)["flash_mla_with_kvcache"]
    gen = torch.Generator().manual_seed(5)
    heads, rank, rope, dk, dv, block = 4, 16, 4, 8, 6, 4
    lengths = [1, 7, 12]
    w_uk = torch.randn(heads, dk, rank, generator=gen) / rank ** 0.5  # [H, dk, R]
    w_uv = torch.randn(heads, dv, rank, generator=gen) / rank ** 0.5  # [H, dv, R]
    latents = [torch.randn(n, rank + rope, generator=gen) for n in lengths]  # [L, R + rope] per request
    num_blocks = sum((n + block - 1) // block for n in lengths) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.randn(num_blocks, block, 1, rank + rope, generator=gen)
    table = torch.zeros(len(lengths), 3, dtype=torch.int32)
    for b, lat in enumerate(latents):
        for j in range((lat.shape[0] + block - 1) // block):
            table[b, j] = blk = order.pop()
            piece = lat[j * block:(j + 1) * block]
            cache[blk, :piece.shape[0], 0] = piece
    q_nope = torch.randn(len(lengths), heads, dk, generator=gen)
    q_pe = torch.randn(len(lengths), heads, rope, generator=gen)
    scale = (dk + rope) ** -0.5
    q_abs = torch.cat([torch.einsum("bhd,hdr->bhr", q_nope, w_uk), q_pe], -1)[:, None]  # [B, 1, H, R + rope]
    out, lse = paged_mla_decode(q_abs, cache, table, torch.tensor(lengths, dtype=torch.int32), rank,
                                None, None, softmax_scale=scale, causal=True)
    out = torch.einsum("bshr,hdr->bshd", out, w_uv)[:, 0]  # the value up-projection after attention
    for b, lat in enumerate(latents):
        c, k_pe = lat[:, :rank], lat[:, rank:]
        keys = torch.cat([torch.einsum("lr,hdr->lhd", c, w_uk), k_pe[:, None].expand(-1, heads, -1)], -1)
        values = torch.einsum("lr,hdr->lhd", c, w_uv)
        scores = torch.einsum("hd,lhd->hl", torch.cat([q_nope[b], q_pe[b]], -1), keys) * scale
        ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(lse[b, :, 0], torch.logsumexp(scores, -1), atol=1e-5, rtol=0)
