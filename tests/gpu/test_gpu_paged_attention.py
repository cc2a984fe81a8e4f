"""The GPU tier's check of the batched paged attention (megatron/compat/paged_attention.py): what
the CPU cannot show, that its decode paths make no CUDA synchronisation and can be captured in a
CUDA graph.

For ``flash_attn_with_kvcache``'s and ``flash_mla_with_kvcache``'s batched equivalents in bf16:
an eager call makes no synchronising CUDA call (``tools.bench.host_syncs.count_cuda_syncs`` == 0);
the call is captured once in a CUDA graph on static buffers (queries, paged cache, block table,
key lengths), the buffers are then overwritten in place with another batch of the same shapes
(other key lengths, a zero-length request elsewhere, other blocks) and the graph replayed: its
output equals the per-request loop on the new values within the CPU tests' tolerances (bf16 3e-2;
MLA output 2e-2) and the MLA log-sum-exp within 1e-4 (both in fp32 from the same inputs, whose
GEMMs the GPU may reduce in other orders: log-sum-exps near 10 at fp32's 1e-6 relative precision).
Skipped on machines without a CUDA GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import requires_gpu
from tests.serving.test_paged_attention import paged_cache

pytestmark = [pytest.mark.gpu, requires_gpu()]

BLOCK, NUM_BLOCKS = 16, 24
BATCHES = ([13, 0, 1, 64, 7, 30], [40, 5, 0, 17, 64, 2])  # key lengths: captured with the first, replayed with the second


def _batch(lengths, channels, seed: int):
    """(cache [NUM_BLOCKS, BLOCK, *channels], table [B, 5], lengths [B]) on the GPU, bf16; the same
    shapes for every ``lengths`` of ``BATCHES``."""
    gen = torch.Generator().manual_seed(seed)
    spare = NUM_BLOCKS - sum(-(-n // BLOCK) for n in lengths)
    cache, table = paged_cache(lengths, BLOCK, channels, gen, torch.bfloat16, spare_blocks=spare)
    table = torch.cat([table, torch.full((len(lengths), 5 - table.shape[1]), -1, dtype=table.dtype)], 1)
    return cache.cuda(), table.cuda(), torch.tensor(lengths, dtype=torch.int32, device="cuda")


def _captured(fn):
    """``fn()`` captured in a CUDA graph after a warm-up on a side stream: (graph, its outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_batched_decode_is_sync_free_and_replays_from_a_cuda_graph(report):
    from megatron.compat.paged_attention import batched_kvcache_attention, loop_kvcache_attention
    from tools.bench.host_syncs import count_cuda_syncs

    heads, kv_heads, dim = 8, 2, 64
    cache, table, lengths = _batch(BATCHES[0], (kv_heads, 2 * dim), seed=0)
    q = torch.randn(len(BATCHES[0]), 1, heads, dim, device="cuda").to(torch.bfloat16)

    def call(impl):
        return impl(q=q, k_cache=cache[..., :dim], v_cache=cache[..., dim:], cache_seqlens=lengths, block_table=table,
                    softmax_scale=dim ** -0.5, causal=True, num_splits=0)

    syncs, messages = count_cuda_syncs(lambda: call(batched_kvcache_attention))
    graph, out = _captured(lambda: call(batched_kvcache_attention))
    new_cache, new_table, new_lengths = _batch(BATCHES[1], (kv_heads, 2 * dim), seed=1)
    for static, new in ((cache, new_cache), (table, new_table), (lengths, new_lengths)):
        static.copy_(new)
    q.copy_(torch.randn_like(q, dtype=torch.float32).to(torch.bfloat16))
    graph.replay()
    error = (out.float() - call(loop_kvcache_attention).float()).abs().max().item()
    report["figures"] = {"cuda_syncs": syncs, "replay_max_abs_error": error}
    report["result"] = f"batched decode: {syncs} CUDA syncs eager; graph replay vs loop max |error| {error:.2e}"
    assert syncs == 0, messages
    assert error <= 3e-2


def test_batched_mla_decode_is_sync_free_and_replays_from_a_cuda_graph(report):
    from megatron.compat.paged_attention import batched_mla_decode, loop_mla_decode
    from tools.bench.host_syncs import count_cuda_syncs

    heads, rank, rope = 16, 64, 16
    cache, table, lengths = _batch(BATCHES[0], (1, rank + rope), seed=2)
    q = torch.randn(len(BATCHES[0]), 1, heads, rank + rope, device="cuda").to(torch.bfloat16)

    def call(impl):
        return impl(q, cache, table, lengths, rank, None, None, softmax_scale=(rank + rope) ** -0.5, causal=True)

    syncs, messages = count_cuda_syncs(lambda: call(batched_mla_decode))
    graph, (out, lse) = _captured(lambda: call(batched_mla_decode))
    new_cache, new_table, new_lengths = _batch(BATCHES[1], (1, rank + rope), seed=3)
    for static, new in ((cache, new_cache), (table, new_table), (lengths, new_lengths)):
        static.copy_(new)
    q.copy_(torch.randn_like(q, dtype=torch.float32).to(torch.bfloat16))
    graph.replay()
    ref, ref_lse = call(loop_mla_decode)
    error = (out.float() - ref.float()).abs().max().item()
    lse_error = (lse.nan_to_num(neginf=0) - ref_lse.nan_to_num(neginf=0)).abs().max().item()
    report["figures"] = {"cuda_syncs": syncs, "replay_max_abs_error": error, "replay_lse_max_abs_error": lse_error}
    report["result"] = (f"batched MLA decode: {syncs} CUDA syncs eager; graph replay vs loop max |error| {error:.2e}, "
                        f"log-sum-exp {lse_error:.2e}")
    assert syncs == 0, messages
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    assert error <= 2e-2 and lse_error <= 1e-4
