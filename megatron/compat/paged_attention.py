"""Plain-torch paged attention: what megatron-core's dynamic engine calls flash-attn and FlashMLA
for, in two implementations with the kernels' signatures and semantics (``megatron.compat.inference``
installs one of them where the kernels are absent):

- **batched** (``PagedAttention.BATCHED``, the default): all requests of a step at once. Each
  request's keys and values are gathered through its block table into a padded [B, M*P, Hk, D]
  tensor (M: the table's width, trimmed to the step's longest key length where the caller says it,
  ``max_seqlen_k``), a length mask (and the causal mask) is built on the device, and
  ``torch.nn.functional.scaled_dot_product_attention`` attends in the input dtype (its kernels
  accumulate in fp32). No Python loop over requests and no host sync: every shape comes from the
  arguments' shapes and the host ints the caller passes (``max_seqlen_q/k``), never from tensor
  values, so a decode step can run under CUDA graph capture (no ``.item()``/``.tolist()``, no
  tensor truth value, no op whose output size depends on data, no host-to-device copy).
- **loop** (``PagedAttention.LOOP``): one request at a time in fp32 einsums, reading each
  request's lengths on the host (one ``.tolist()``, a device sync, per call, so per layer). It is
  the reference the batched path is tested against, and what a CPU with a handful of requests
  needs no more than.

Both follow flash-attn's semantics: ``causal`` aligns the mask to the bottom right (query ``i`` of
``Lq`` sees keys ``j <= i + Lk - Lq``); grouped-query attention maps query head ``h`` to key head
``h // (Hq / Hk)`` (the batched path folds the ``Hq / Hk`` query heads of a key head into its query
axis, so keys are never repeated); rows past the last real query (the engine pads the batch to a
multiple of its token rounder) and requests with no keys come out as zeros. Cache slots past a
request's length are never trusted: the paged buffer is allocated uninitialised, so the batched
path zeroes the gathered keys and values there before attending (a NaN left in memory would
otherwise reach the output through a zero probability).

CUDA graphs (batched decode). megatron-core's dynamic engine captures whole decode steps (the
layers' forwards, attention included) for a fixed padded request count when the model's
``cuda_graph_impl`` is ``"local"`` and the context has ``num_cuda_graphs``; replaying one runs the
recorded kernels on the static metadata buffers (``GraphedMHAMetadata``: block table, key lengths)
without Python. Nothing in the batched decode prevents capture: its shapes are functions of the
arguments' shapes only (B: the graph's request count; M: the table's width, or the bound the
engine passes, which in a graph step is the context's maximum sequence length, a constant); it
reads no tensor on the host and has no op whose output size depends on the data (gathers index
with the table, masks are compared, ``where`` takes three arguments), and creates every tensor on
the inputs' device (no host-to-device copy). This is reasoned from the code here, not run: the CPU
cannot capture, and the engine in ``megatron.inference.engine`` does not enable CUDA graphs.

Memory (batched): per call, the gathered keys and values [B, Lk, Hk, D] and a boolean mask
[B, (Hq/Hk)*Lq, Lk]; queries of a prefill step are padded to [B, Lq_max, Hq, D], so a step mixing
one long prefill chunk with many decodes computes B x Lq_max x Lk scores where the loop computes
the sum of each request's.

Shape legend: ``T`` packed query tokens, ``B`` requests, ``Hq``/``Hk`` query/key heads, ``G`` query
heads per key head, ``D``/``Dv`` key/value head dim, ``N`` cache blocks, ``P`` tokens per block, ``M``
blocks per request in the block table, ``Q``/``L`` padded query/key length.
"""

from __future__ import annotations

import enum
import math
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "PagedAttention",
    "kernels",
    "loop_varlen_attention",
    "loop_kvcache_attention",
    "loop_mla_decode",
    "batched_varlen_attention",
    "batched_kvcache_attention",
    "batched_mla_decode",
    "mla_metadata",
]


class PagedAttention(enum.Enum):
    """Which plain-torch paged attention runs where flash-attn/FlashMLA are absent."""

    BATCHED = "batched"  # all requests of a step at once, no host sync (the default)
    LOOP = "loop"  # one request at a time: the reference


# --- the loop (reference) ------------------------------------------------------------------------


def _attend(q_TqHD: torch.Tensor, k_TkHD: torch.Tensor, v_TkHD: torch.Tensor, scale: float,
            causal: bool) -> torch.Tensor:
    """Attention of one request: [Lq, Hq, D] queries over [Lk, Hk, D] keys/values -> [Lq, Hq, Dv]."""
    num_q, num_heads = q_TqHD.shape[0], q_TqHD.shape[1]
    num_k, num_kv_heads = k_TkHD.shape[0], k_TkHD.shape[1]
    if num_kv_heads != num_heads:
        k_TkHD = k_TkHD.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v_TkHD = v_TkHD.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores_HQK = torch.einsum("qhd,khd->hqk", q_TqHD.float(), k_TkHD.float()) * scale
    if causal:
        q_pos = torch.arange(num_q, device=q_TqHD.device)[:, None] + (num_k - num_q)
        k_pos = torch.arange(num_k, device=q_TqHD.device)[None, :]
        scores_HQK = scores_HQK.masked_fill(k_pos > q_pos, float("-inf"))
    probs_HQK = torch.softmax(scores_HQK, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs_HQK, v_TkHD.float()).to(q_TqHD.dtype)


def _gather_blocks(cache_NPHD: torch.Tensor, blocks_M: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached tokens of one request: [length, H, D]."""
    block_size = cache_NPHD.shape[1]
    used = blocks_M[: math.ceil(length / block_size)].long()
    return cache_NPHD[used].reshape(-1, *cache_NPHD.shape[2:])[:length]


def loop_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                          dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                          causal: bool = False, block_table=None, **unsupported):
    """Plain-torch ``flash_attn_varlen_func``, one request at a time: q [T, Hq, D]; k/v packed
    [Tk, Hk, D] or, with ``block_table`` [B, M], a paged cache [N, P, Hk, D]; ``cu_seqlens_q/k``
    [B+1]. -> [T, Hq, Dv]."""
    _refuse(unsupported, dropout_p)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        q_lo, q_hi, k_len = cu_q[b], cu_q[b + 1], cu_k[b + 1] - cu_k[b]
        if q_hi <= q_lo or k_len <= 0:
            continue
        if block_table is None:
            keys, values = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        else:
            keys = _gather_blocks(k, block_table[b], k_len)
            values = _gather_blocks(v, block_table[b], k_len)
        out[q_lo:q_hi] = _attend(q[q_lo:q_hi], keys, values, scale, causal)
    return out


def loop_kvcache_attention(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                           cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                           block_table=None, softmax_scale: Optional[float] = None,
                           causal: bool = False, num_splits: int = 0, **unsupported):
    """Plain-torch ``flash_attn_with_kvcache`` for a cache already holding the new tokens (how the
    engine calls it), one request at a time: q [B, Lq, Hq, D]; paged caches [N, P, Hk, D] with
    ``block_table`` [B, M]; ``cache_seqlens`` [B]. -> [B, Lq, Hq, Dv]."""
    _refuse_kvcache(k, v, rotary_cos, cache_batch_idx, cache_leftpad, block_table, unsupported)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = q.new_zeros(*q.shape[:3], v_cache.shape[-1])
    lengths = cache_seqlens.tolist()
    for b, length in enumerate(lengths):
        if length <= 0:
            continue
        keys = _gather_blocks(k_cache, block_table[b], length)
        values = _gather_blocks(v_cache, block_table[b], length)
        out[b] = _attend(q[b], keys, values, scale, causal)
    return out


def loop_mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v: int, tile_scheduler_metadata=None,
                    num_splits=None, softmax_scale: Optional[float] = None, causal: bool = False, **unsupported):
    """Plain-torch ``flash_mla_with_kvcache`` (FlashMLA's decode kernel, as ``attention.py:845``
    calls it), one request at a time: q [B, Lq, Hq, Dk] (absorbed queries: latent channels then
    rotary channels), a paged latent cache [N, P, 1, Dk] with ``block_table`` [B, M] and
    ``cache_seqlens`` [B]; every head attends over the request's cached latents with the full Dk
    channels as keys and their first ``head_dim_v`` (the latent, ``kv_lora_rank``) as values. ->
    (out [B, Lq, Hq, head_dim_v], softmax_lse [B, Hq, Lq] fp32, -inf for a request with no keys).
    ``causal`` aligns the mask to the bottom right as FlashMLA does; the scheduler metadata and
    split count only steer FlashMLA's tiling and are ignored."""
    _refuse(unsupported, 0.0)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    num_b, num_q, num_h, _ = q.shape
    out = q.new_zeros(num_b, num_q, num_h, head_dim_v)
    lse = torch.full((num_b, num_h, num_q), float("-inf"), dtype=torch.float32, device=q.device)
    latent_NPD = k_cache.squeeze(2)
    for b, length in enumerate(cache_seqlens.tolist()):
        if length <= 0:
            continue
        keys = _gather_blocks(latent_NPD, block_table[b], length)[:, None, :]  # [L, 1, Dk]
        out[b] = _attend(q[b], keys, keys[..., :head_dim_v], scale, causal)
        scores = torch.einsum("qhd,kd->hqk", q[b].float(), keys[:, 0].float()) * scale
        if causal:
            q_pos = torch.arange(num_q, device=q.device)[:, None] + (length - num_q)
            scores = scores.masked_fill(torch.arange(length, device=q.device)[None, :] > q_pos, float("-inf"))
        lse[b] = torch.logsumexp(scores, dim=-1)
    return out, lse


# --- batched: all requests of a step at once, no host sync ----------------------------------------


def _host_bound(value, limit: int) -> int:
    """``min(value, limit)`` for a flash-attn ``max_seqlen`` argument that is a host int (as the
    engine passes it: it has the number already), else ``limit``; a tensor is never read."""
    return min(value, limit) if isinstance(value, int) and value > 0 else limit


def _gather_paged(cache_NPHD: torch.Tensor, table_BM: torch.Tensor, len_B: torch.Tensor, max_len=None) -> torch.Tensor:
    """Every request's cached tokens through its block table, padded and zero past its length:
    [B, M'*P, H, D], with M' the table's width, or the blocks ``max_len`` tokens need where it is a
    host int. Entries past a request's blocks (-1) read block 0, then are zeroed."""
    block_size = cache_NPHD.shape[1]
    width = _host_bound(math.ceil(max_len / block_size) if isinstance(max_len, int) else None, table_BM.shape[1])
    tokens_BLHD = cache_NPHD[table_BM[:, :width].long().clamp(min=0)].flatten(1, 2)
    return _zero_past(tokens_BLHD, len_B)


def _zero_past(tokens_BL_, len_B: torch.Tensor) -> torch.Tensor:
    """``tokens_BL_`` (a fresh gather, changed in place) zeroed from each request's length on."""
    unused_BL = ~_positions(len_B, tokens_BL_.shape[1])
    return tokens_BL_.masked_fill_(unused_BL.view(*unused_BL.shape, *[1] * (tokens_BL_.dim() - 2)), 0)


def _positions(lengths_B: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width]: whether position ``j`` is below the request's length."""
    return torch.arange(width, device=lengths_B.device)[None, :] < lengths_B[:, None]


def _masks(len_q_B, len_k_B, num_q: int, num_k: int, causal: bool):
    """(allowed [B, Q, L]: query i may see key j; rows [B, Q]: query i is real and sees a key)."""
    q_pos = torch.arange(num_q, device=len_q_B.device)
    k_pos = torch.arange(num_k, device=len_q_B.device)
    rows_BQ = (q_pos[None, :] < len_q_B[:, None]) & (len_k_B[:, None] > 0)
    allowed_BQL = _positions(len_k_B, num_k)[:, None, :] & rows_BQ[:, :, None]
    if causal:
        last_BQ = q_pos[None, :] + (len_k_B - len_q_B)[:, None]  # the last key query i sees
        allowed_BQL = allowed_BQL & (k_pos[None, None, :] <= last_BQ[:, :, None])
        rows_BQ = rows_BQ & (last_BQ >= 0)
    return allowed_BQL, rows_BQ


def _attend_batched(q_BQHD, k_BLHD, v_BLHD, len_q_B, len_k_B, scale: float, causal: bool) -> torch.Tensor:
    """Attention of every request at once -> [B, Q, Hq, Dv], zero in rows that are not real or see
    no key. Keys/values past ``len_k_B`` must be finite (``_gather_paged`` zeroes them)."""
    num_b, num_q, num_hq, dim = q_BQHD.shape
    num_k, num_hk, dim_v = k_BLHD.shape[1], k_BLHD.shape[2], v_BLHD.shape[-1]
    group = num_hq // num_hk
    k_BHLD, v_BHLD = k_BLHD.transpose(1, 2), v_BLHD.transpose(1, 2)
    allowed_BQL, rows_BQ = _masks(len_q_B, len_k_B, num_q, num_k, causal)
    # the G query heads of key head k: rows (g, i) of its query axis, [B, Hk, G*Q, D]
    q_BHRD = q_BQHD.view(num_b, num_q, num_hk, group, dim).permute(0, 2, 3, 1, 4).reshape(
        num_b, num_hk, group * num_q, dim)
    mask_B1RL = allowed_BQL[:, None, None].expand(num_b, 1, group, num_q, num_k).reshape(
        num_b, 1, group * num_q, num_k)
    out_BHRD = F.scaled_dot_product_attention(q_BHRD, k_BHLD, v_BHLD, attn_mask=mask_B1RL, scale=scale)
    out_BQHD = out_BHRD.view(num_b, num_hk, group, num_q, dim_v).permute(0, 3, 1, 2, 4).reshape(
        num_b, num_q, num_hq, dim_v)
    # a row without keys is zero (some SDPA backends give NaN for a fully masked row)
    return torch.where(rows_BQ[:, :, None, None], out_BQHD, 0).to(q_BQHD.dtype)


def batched_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                             dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, block_table=None, **unsupported):
    """``flash_attn_varlen_func`` over all requests at once (same arguments and result as
    ``loop_varlen_attention``). Each request's queries are gathered from the packed [T, Hq, D]
    into [B, Q, Hq, D] (Q: ``max_seqlen_q`` when it is a host int, else T) and its keys into
    [B, L, Hk, D] (L: the table's width in tokens, or ``max_seqlen_k``); the result is gathered
    back to the packed rows, zero past the last real query."""
    _refuse(unsupported, dropout_p)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    num_t, device = q.shape[0], q.device
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    len_q_B, len_k_B = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    num_q = _host_bound(max_seqlen_q, num_t)
    if block_table is None:
        num_k = _host_bound(max_seqlen_k, k.shape[0])
        rows_BL = (cu_k[:-1, None] + torch.arange(num_k, device=device)).clamp(max=k.shape[0] - 1)
        keys, values = _zero_past(k[rows_BL], len_k_B), _zero_past(v[rows_BL], len_k_B)
    else:
        keys = _gather_paged(k, block_table, len_k_B, max_seqlen_k)
        values = _gather_paged(v, block_table, len_k_B, max_seqlen_k)
    rows_BQ = (cu_q[:-1, None] + torch.arange(num_q, device=device)).clamp(max=num_t - 1)
    out_BQHD = _attend_batched(q[rows_BQ], keys, values, len_q_B, len_k_B, scale, causal)
    # packed token t is query t - cu_q[b] of the request b whose range holds it
    tokens_T = torch.arange(num_t, device=device)
    request_T = torch.searchsorted(cu_q[1:], tokens_T, right=True).clamp(max=len_q_B.shape[0] - 1)
    index_T = request_T * num_q + (tokens_T - cu_q[request_T]).clamp(0, num_q - 1)
    out_THD = out_BQHD.flatten(0, 1)[index_T]
    return torch.where((tokens_T < cu_q[-1])[:, None, None], out_THD, 0)


def batched_kvcache_attention(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                              cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                              block_table=None, softmax_scale: Optional[float] = None,
                              causal: bool = False, num_splits: int = 0, **unsupported):
    """``flash_attn_with_kvcache`` over all requests at once (same arguments and result as
    ``loop_kvcache_attention``): keys gathered to the block table's full width, so a caller that
    knows the step's longest key length trims the table first (``inference.apply_inference`` does)."""
    _refuse_kvcache(k, v, rotary_cos, cache_batch_idx, cache_leftpad, block_table, unsupported)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    keys = _gather_paged(k_cache, block_table, cache_seqlens)
    values = _gather_paged(v_cache, block_table, cache_seqlens)
    len_q_B = torch.full_like(cache_seqlens, q.shape[1])
    return _attend_batched(q, keys, values, len_q_B, cache_seqlens, scale, causal)


def batched_mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v: int, tile_scheduler_metadata=None,
                       num_splits=None, softmax_scale: Optional[float] = None, causal: bool = False,
                       **unsupported):
    """``flash_mla_with_kvcache`` over all requests at once (same arguments and result as
    ``loop_mla_decode``). SDPA cannot return the log-sum-exp, so this one is a masked softmax in
    fp32: scores [B, Hq, Lq, L] (L: the table's width in tokens; Hq*Lq*L per request, small for
    a decode step)."""
    _refuse(unsupported, 0.0)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    num_b, num_q = q.shape[:2]
    latent_BLD = _gather_paged(k_cache.squeeze(2), block_table, cache_seqlens).float()
    num_k = latent_BLD.shape[1]
    allowed_BQL, rows_BQ = _masks(torch.full_like(cache_seqlens, num_q), cache_seqlens, num_q, num_k, causal)
    scores_BHQL = torch.einsum("bqhd,bld->bhql", q.float(), latent_BLD) * scale
    scores_BHQL = scores_BHQL.masked_fill(~allowed_BQL[:, None], float("-inf"))
    lse_BHQ = torch.logsumexp(scores_BHQL, dim=-1)  # -inf where a row sees no key
    probs_BHQL = torch.where(rows_BQ[:, None, :, None], torch.exp(scores_BHQL - lse_BHQ[..., None]), 0)
    out = torch.einsum("bhql,bld->bqhd", probs_BHQL, latent_BLD[..., :head_dim_v])
    return out.to(q.dtype), lse_BHQ


def mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k):
    """Plain-torch ``get_mla_metadata``: FlashMLA's tile scheduling, which the equivalents do
    not use."""
    return None, None


def kernels(path: PagedAttention) -> dict:
    """The implementations of ``path`` by the flash-attn/FlashMLA names they stand in for."""
    if path is PagedAttention.LOOP:
        return {"flash_attn_varlen_func": loop_varlen_attention, "flash_attn_with_kvcache": loop_kvcache_attention,
                "flash_mla_with_kvcache": loop_mla_decode, "get_mla_metadata": mla_metadata}
    return {"flash_attn_varlen_func": batched_varlen_attention, "flash_attn_with_kvcache": batched_kvcache_attention,
            "flash_mla_with_kvcache": batched_mla_decode, "get_mla_metadata": mla_metadata}


def _refuse_kvcache(k, v, rotary_cos, cache_batch_idx, cache_leftpad, block_table, unsupported: dict) -> None:
    if k is not None or v is not None or rotary_cos is not None or cache_batch_idx is not None \
            or cache_leftpad is not None:
        raise NotImplementedError("paged kvcache attention: appending keys, rotary embedding and "
                                  "cache indirection are not implemented (the engine does them itself)")
    _refuse(unsupported, 0.0)
    if block_table is None:
        raise NotImplementedError("paged kvcache attention: only the paged cache (block_table) is implemented")


def _refuse(unsupported: dict, dropout_p: float) -> None:
    active = {name: value for name, value in unsupported.items()  # a tensor is refused unread
              if torch.is_tensor(value) or value not in (None, False, 0, 0.0, (-1, -1))}
    if dropout_p or active:
        raise NotImplementedError(f"plain-torch flash-attn equivalent: unsupported arguments "
                                  f"{sorted(active) + (['dropout_p'] if dropout_p else [])}")
