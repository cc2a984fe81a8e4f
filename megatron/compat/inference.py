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

Multi-latent attention decodes with FlashMLA instead (``:826-855``): ``get_mla_metadata`` and
``flash_mla_with_kvcache(q, kv_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
num_splits, softmax_scale=, causal=True)`` over the paged *latent* cache (one "head" of
``kv_lora_rank + qk_pos_emb_head_dim`` channels per token, blocks of 64 tokens), with queries
already absorbed through the key up-projection; its prefill steps go through
``flash_attn_varlen_func`` over the cache uncompressed to per-head keys and values
(``:611-618``).

Without flash-attn both names are ``None`` (``:93-97``) and ``Attention.forward`` asserts a
flash-attn version for dynamic batching (``:926``); without FlashMLA its two names are ``None``
(``:83-88``). ``apply_inference()`` supplies the plain-torch
equivalents below in their place (only where flash-attn or FlashMLA is absent, so a GPU machine
with them keeps its kernels, and with a one-line warning the first time an MLA model decodes
through the equivalent: slow but correct) and relaxes that assertion to "a kernel is present";
``megatron.compat.mla.apply_mla_serving`` fixes what else keeps upstream's MLA path from running. On CPU it also
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

import functools
import importlib.util
import math
from typing import Optional

import torch

from megatron.compat.sites import MODULE, Site

__all__ = [
    "apply_inference",
    "sampling_controller_class",
    "paged_varlen_attention",
    "paged_kvcache_attention",
    "paged_mla_decode",
    "mla_metadata",
    "INFERENCE_SITES",
]

# the upstream text each fix depends on, by enclosing function (compat/sites.py)
INFERENCE_SITES = [
    Site("transformer/attention.py", MODULE, "flash_attn_varlen_func = None"),
    Site("transformer/attention.py", MODULE, "flash_attn_with_kvcache = None"),
    Site("transformer/attention.py", MODULE, "flash_mla_with_kvcache = None"),
    Site("transformer/attention.py", MODULE, "get_mla_metadata = None"),
    Site("transformer/attention.py", "Attention.flash_decode_and_prefill",
         "tile_scheduler_metadata, num_splits = get_mla_metadata("),
    Site("transformer/attention.py", "Attention.flash_decode_and_prefill",
         "output_total, softmax_lse = flash_mla_with_kvcache("),
    Site("transformer/attention.py", "Attention.flash_decode_and_prefill", "output_total = flash_attn_varlen_func("),
    Site("transformer/attention.py", "Attention.flash_decode_and_prefill",
         "output_total = flash_attn_with_kvcache(**flash_attn_args)"),
    Site("transformer/attention.py", "Attention.forward", "assert HAVE_FA3 or is_fa_min_version("),
    Site("transformer/attention.py", "Attention.forward",
         "core_attn_out = rearrange(core_attn_out, 's b h d -> s b (h d)')"),
    Site("inference/engines/dynamic_engine.py", MODULE, "from torch.cuda.nvtx import range_pop, range_push"),
    Site("inference/engines/dynamic_engine.py", "DynamicInferenceEngine.async_forward",
         'range_push("Prefill" if not is_decode_only else "Decode")'),
    Site("inference/engines/dynamic_engine.py", "DynamicInferenceEngine.async_forward",
         "step_time = self.step_start_event.elapsed_time(self.step_end_event) / 1e3"),
    Site("inference/inference_request.py", "serialize_tensor", 'torch.cuda.nvtx.range_push("serialize_tensor")'),
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


def paged_mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v: int, tile_scheduler_metadata=None,
                     num_splits=None, softmax_scale: Optional[float] = None, causal: bool = False, **unsupported):
    """Plain-torch ``flash_mla_with_kvcache`` (FlashMLA's decode kernel, as ``attention.py:845``
    calls it): q [B, Lq, Hq, Dk] (absorbed queries: latent channels then rotary channels), a paged
    latent cache [N, P, 1, Dk] with ``block_table`` [B, M] and ``cache_seqlens`` [B]; every head
    attends over the request's cached latents with the full Dk channels as keys and their first
    ``head_dim_v`` (the latent, ``kv_lora_rank``) as values. -> (out [B, Lq, Hq, head_dim_v],
    softmax_lse [B, Hq, Lq] fp32). ``causal`` aligns the mask to the bottom right as FlashMLA does;
    the scheduler metadata and split count only steer FlashMLA's tiling and are ignored."""
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


def mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k):
    """Plain-torch ``get_mla_metadata``: FlashMLA's tile scheduling, which the equivalent does
    not use."""
    return None, None


def _refuse(unsupported: dict, dropout_p: float) -> None:
    active = {name: value for name, value in unsupported.items()
              if value not in (None, False, 0, 0.0, (-1, -1))}
    if dropout_p or active:
        raise NotImplementedError(f"plain-torch flash-attn equivalent: unsupported arguments "
                                  f"{sorted(active) + (['dropout_p'] if dropout_p else [])}")


_applied: Optional[dict] = None


def apply_inference() -> dict:
    """Make megatron-core's dynamic inference engine run here (idempotent). Returns what it did:
    ``{"attention_kernels": "flash-attn" | "torch", "mla_decode_kernel": "flash-mla" | "torch",
    "nvtx": "kept" | "no-op"}``."""
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
    done["mla_decode_kernel"] = "flash-mla"
    if attention.flash_mla_with_kvcache is None or attention.get_mla_metadata is None:
        attention.flash_mla_with_kvcache = paged_mla_decode
        attention.get_mla_metadata = mla_metadata
        done["mla_decode_kernel"] = "torch"
    from megatron.compat.mla import apply_mla_serving

    apply_mla_serving()
    if not torch.cuda.is_available():
        dynamic_engine.range_push = torch.cuda.nvtx.range_push  # compat's no-op stand-ins
        dynamic_engine.range_pop = torch.cuda.nvtx.range_pop
        done["nvtx"] = "no-op"
    _applied = done
    return done


@functools.lru_cache(maxsize=None)
def sampling_controller_class():
    """megatron-core's ``TextGenerationController`` with its two private per-step hooks turned into
    public methods, so that a subclass (the server's ``ServingController``) samples and scores itself
    without touching upstream's private names (``sites.SERVING_SITES``):

    - ``before_step_context()``: called at the start of each step's context initialisation
      (``_dynamic_step_context_init``, ``text_generation_controller.py:491``), e.g. to set the
      context's ``materialize_only_last_token_logits`` for that step's forward;
    - ``sample_step(logits) -> tokens [B]``: replaces upstream's sampling of a step
      (``_dynamic_step_sample_logits``, ``:631``, called at ``:906``); the returned tokens of the
      step's active requests become the step's sample (upstream's ``_sampled_tokens_cuda``,
      allocated at ``:106``, which the step returns).
    """
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class SamplingController(TextGenerationController):
        def before_step_context(self) -> None:
            """Called before each step's context is initialised (default: nothing)."""

        def sample_step(self, logits):
            """The step's sampled tokens [B] of its active requests from the forward's ``logits``."""
            raise NotImplementedError

        def _dynamic_step_context_init(self, *args, **kwargs):
            self.before_step_context()
            return super()._dynamic_step_context_init(*args, **kwargs)

        def _dynamic_step_sample_logits(self, logits):
            tokens_B = self.sample_step(logits)
            self._sampled_tokens_cuda[: len(tokens_B)] = tokens_B

    return SamplingController
