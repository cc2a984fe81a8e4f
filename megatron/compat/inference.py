"""megatron-core's dynamic inference engine without flash-attn, NVTX or CUDA (megatron-core 0.16.1).

``DynamicInferenceEngine`` keeps the KV cache in fixed-size blocks (``DynamicInferenceContext``) and
computes attention over them with two flash-attn kernels, called from
``Attention.flash_decode_and_prefill`` (``transformer/attention.py:756-874``):

- ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  softmax_scale=, causal=True, block_table=)`` for steps with a prefill (``:814``): the queries of
  all requests packed along dim 0, the keys/values read from the paged cache through each
  request's block table;
- ``flash_attn_with_kvcache(q=, k_cache=, v_cache=, cache_seqlens=, causal=True, block_table=,
  num_splits=)`` for decode-only steps (``:872``): one query per request.

Without flash-attn both names are ``None`` (``:93-97``) and ``Attention.forward`` asserts a
flash-attn version for dynamic batching (``:926``). ``apply_inference()`` supplies the plain-torch
equivalents below in their place (only where flash-attn is absent, so a GPU machine with
flash-attn keeps its kernels) and relaxes that assertion to "a kernel is present". On CPU it also
replaces the NVTX range functions ``dynamic_engine`` imported at its import (``:20``, called at
``:1191``), which raise on a CPU build of torch. Step timing needs ``CpuEvent.elapsed_time``
(``cpu_device.py``). The output rearrangement (``:1178``) needs ``einops``, a dependency of the
``serve`` extra.

The equivalents follow flash-attn's semantics: ``causal`` aligns the mask to the bottom right
(query ``i`` of ``Lq`` sees keys ``j <= i + Lk - Lq``), grouped-query attention maps query head
``h`` to key head ``h // (Hq / Hk)``, and rows past the last real query (the engine pads the batch
to a multiple of its token rounder) or requests with no keys come out as zeros. The softmax is
computed in fp32. They loop over requests, which is what a CPU wants for a handful of requests.

Shape legend: ``T`` packed query tokens, ``B`` requests, ``Hq``/``Hk`` query/key heads, ``D`` head
dim, ``N`` cache blocks, ``P`` tokens per block, ``M`` blocks per request in the block table.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Optional

import torch

__all__ = [
    "apply_inference",
    "paged_varlen_attention",
    "paged_kvcache_attention",
    "INFERENCE_SITES",
]

# (path relative to megatron/core, 1-based line, text expected there); see compat/sites.py
INFERENCE_SITES = [
    ("transformer/attention.py", 96, "flash_attn_varlen_func = None"),
    ("transformer/attention.py", 97, "flash_attn_with_kvcache = None"),
    ("transformer/attention.py", 814, "output_total = flash_attn_varlen_func("),
    ("transformer/attention.py", 872, "output_total = flash_attn_with_kvcache(**flash_attn_args)"),
    ("transformer/attention.py", 926, "assert HAVE_FA3 or is_fa_min_version("),
    ("transformer/attention.py", 1178, "core_attn_out = rearrange(core_attn_out, 's b h d -> s b (h d)')"),
    ("inference/engines/dynamic_engine.py", 20, "from torch.cuda.nvtx import range_pop, range_push"),
    ("inference/engines/dynamic_engine.py", 1191, 'range_push("Prefill" if not is_decode_only else "Decode")'),
    ("inference/engines/dynamic_engine.py", 1199, "step_time = self.step_start_event.elapsed_time(self.step_end_event) / 1e3"),
    ("inference/inference_request.py", 26, 'torch.cuda.nvtx.range_push("serialize_tensor")'),
]


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


def paged_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                           causal: bool = False, block_table=None, **unsupported):
    """Plain-torch ``flash_attn_varlen_func``: q [T, Hq, D]; k/v packed [Tk, Hk, D] or, with
    ``block_table`` [B, M], a paged cache [N, P, Hk, D]; ``cu_seqlens_q/k`` [B+1]. -> [T, Hq, Dv]."""
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


def paged_kvcache_attention(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale: Optional[float] = None,
                            causal: bool = False, num_splits: int = 0, **unsupported):
    """Plain-torch ``flash_attn_with_kvcache`` for a cache already holding the new tokens (how the
    engine calls it): q [B, Lq, Hq, D]; paged caches [N, P, Hk, D] with ``block_table`` [B, M];
    ``cache_seqlens`` [B]. -> [B, Lq, Hq, Dv]."""
    if k is not None or v is not None or rotary_cos is not None or cache_batch_idx is not None \
            or cache_leftpad is not None:
        raise NotImplementedError("paged_kvcache_attention: appending keys, rotary embedding and "
                                  "cache indirection are not implemented (the engine does them itself)")
    _refuse(unsupported, 0.0)
    if block_table is None:
        raise NotImplementedError("paged_kvcache_attention: only the paged cache (block_table) is implemented")
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


def _refuse(unsupported: dict, dropout_p: float) -> None:
    active = {name: value for name, value in unsupported.items()
              if value not in (None, False, 0, 0.0, (-1, -1))}
    if dropout_p or active:
        raise NotImplementedError(f"plain-torch flash-attn equivalent: unsupported arguments "
                                  f"{sorted(active) + (['dropout_p'] if dropout_p else [])}")


_applied: Optional[dict] = None


def apply_inference() -> dict:
    """Make megatron-core's dynamic inference engine run here (idempotent). Returns what it did:
    ``{"attention_kernels": "flash-attn" | "torch", "nvtx": "kept" | "no-op"}``."""
    global _applied
    if _applied is not None:
        return _applied
    from megatron import compat

    compat.apply()
    if importlib.util.find_spec("einops") is None:
        raise ValueError("serving needs einops (megatron-core's attention rearranges with it): "
                         "pip install -e '.[serve]'")
    from megatron.core.inference.engines import dynamic_engine
    from megatron.core.transformer import attention

    done = {"attention_kernels": "flash-attn", "nvtx": "kept"}
    if attention.flash_attn_varlen_func is None or attention.flash_attn_with_kvcache is None:
        attention.flash_attn_varlen_func = paged_varlen_attention
        attention.flash_attn_with_kvcache = paged_kvcache_attention
        # the version assertion guards the two kernels just supplied
        attention.is_fa_min_version = lambda version, check_equality=True: True
        done["attention_kernels"] = "torch"
    if not torch.cuda.is_available():
        dynamic_engine.range_push = torch.cuda.nvtx.range_push  # compat's no-op stand-ins
        dynamic_engine.range_pop = torch.cuda.nvtx.range_pop
        done["nvtx"] = "no-op"
    _applied = done
    return done
