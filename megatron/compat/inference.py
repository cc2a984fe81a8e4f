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
(``:83-88``). ``apply_inference()`` supplies plain-torch equivalents in their place
(``megatron.compat.paged_attention``: batched over all requests of a step by default, or the
per-request loop that is their reference), only where flash-attn or FlashMLA is absent, so a GPU
machine with them keeps its kernels, and relaxes that assertion to "a kernel is present";
``megatron.compat.mla.apply_mla_serving`` fixes what else keeps upstream's MLA path from running.
A decode step's kernel call carries no key-length bound (flash-attn reads each request's own
length on the device), so ``Attention.flash_decode_and_prefill`` is wrapped to cut the block table
to the blocks of the step's longest request (``max_seqlen_k``, a host int the engine holds: the
step's maximum in eager steps, the context's maximum sequence length in CUDA-graph steps) before
the equivalents see it: they gather that many blocks per request, not the table's full width. On
CPU it also replaces the NVTX range functions ``dynamic_engine`` imported at its import (``:20``,
called at ``:1191``), which raise on a CPU build of torch. Step timing needs
``CpuEvent.elapsed_time`` (``cpu_device.py``). The output rearrangement (``:1178``) needs
``einops``, a dependency of the ``serve`` extra.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Optional

import torch

from megatron.compat.paged_attention import PagedAttention, kernels
from megatron.compat.sites import MODULE, Site

__all__ = ["apply_inference", "sampling_controller_class", "step_scheduled", "PagedAttention", "INFERENCE_SITES"]

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
    # the decode-step wrapper: the forward passes the step's bound and flag positionally
    Site("transformer/attention.py", "Attention.flash_decode_and_prefill", "max_seqlen_k,"),
    Site("transformer/attention.py", "Attention.forward", "core_attn_out = self.flash_decode_and_prefill("),
    Site("transformer/attention.py", "Attention.forward", "inference_context.is_decode_only(),"),
    Site("transformer/attention.py", "Attention.forward",
         "core_attn_out = rearrange(core_attn_out, 's b h d -> s b (h d)')"),
    Site("inference/engines/dynamic_engine.py", MODULE, "from torch.cuda.nvtx import range_pop, range_push"),
    Site("inference/engines/dynamic_engine.py", "DynamicInferenceEngine.async_forward",
         'range_push("Prefill" if not is_decode_only else "Decode")'),
    Site("inference/engines/dynamic_engine.py", "DynamicInferenceEngine.async_forward",
         "step_time = self.step_start_event.elapsed_time(self.step_end_event) / 1e3"),
    Site("inference/inference_request.py", "serialize_tensor", 'torch.cuda.nvtx.range_push("serialize_tensor")'),
    # step_scheduled: the step schedules first, and a continuing chunk gives back its placeholder token
    Site("inference/engines/dynamic_engine.py", "DynamicInferenceEngine.async_forward",
         "self.schedule_waiting_requests()"),
    Site("inference/engines/dynamic_engine.py", "DynamicInferenceEngine.schedule_chunked_prefill",
         "chunk_length = self.context.max_tokens - self.context.active_token_count"),
    Site("inference/contexts/dynamic_context.py", "DynamicInferenceContext.add_request",
         "self.active_token_count -= ("),
]


_applied: Optional[dict] = None


def apply_inference(paged_attention: PagedAttention = PagedAttention.BATCHED) -> dict:
    """Make megatron-core's dynamic inference engine run here, with ``paged_attention`` where the
    plain-torch equivalents stand in for the kernels. The first call patches (idempotent); every
    call installs ``paged_attention``'s equivalents, so a benchmark can switch between engine
    builds. Returns what it did: ``{"attention_kernels": "flash-attn" | "torch",
    "mla_decode_kernel": "flash-mla" | "torch", "nvtx": "kept" | "no-op", "paged_attention":
    "batched" | "loop" (or None where both kernels are present)}``."""
    global _applied
    if _applied is None:
        _applied = _apply_once()
    from megatron.core.transformer import attention

    chosen = kernels(PagedAttention(paged_attention))
    names = (["flash_attn_varlen_func", "flash_attn_with_kvcache"] if _applied["attention_kernels"] == "torch"
             else []) + (["flash_mla_with_kvcache", "get_mla_metadata"] if _applied["mla_decode_kernel"] == "torch"
                         else [])
    for name in names:
        setattr(attention, name, chosen[name])
    return dict(_applied, paged_attention=PagedAttention(paged_attention).value if names else None)


def _apply_once() -> dict:
    from megatron import compat

    compat.apply()
    if importlib.util.find_spec("einops") is None:
        raise ValueError("serving needs einops (megatron-core's attention rearranges with it): "
                         "pip install -e '.[serve]'")
    from megatron.core.inference.engines import dynamic_engine
    from megatron.core.transformer import attention

    done = {"attention_kernels": "flash-attn", "mla_decode_kernel": "flash-mla", "nvtx": "kept"}
    if attention.flash_attn_varlen_func is None or attention.flash_attn_with_kvcache is None:
        # the version assertion guards the two kernels apply_inference supplies
        attention.is_fa_min_version = lambda version, check_equality=True: True
        done["attention_kernels"] = "torch"
    if attention.flash_mla_with_kvcache is None or attention.get_mla_metadata is None:
        done["mla_decode_kernel"] = "torch"
    if "torch" in (done["attention_kernels"], done["mla_decode_kernel"]):
        _bound_decode_blocks(attention.Attention)
    from megatron.compat.mla import apply_mla_serving

    apply_mla_serving()
    if not torch.cuda.is_available():
        dynamic_engine.range_push = torch.cuda.nvtx.range_push  # compat's no-op stand-ins
        dynamic_engine.range_pop = torch.cuda.nvtx.range_pop
        done["nvtx"] = "no-op"
    return done


def _bound_decode_blocks(attention_class) -> None:
    """Wrap ``flash_decode_and_prefill`` so that a decode step's block table [B, M] reaches the
    kernel cut to the ``ceil(max_seqlen_k / P)`` blocks of the step's longest request (module
    docstring). Shapes only: the bound is a host int, never a tensor read."""
    flash_decode_and_prefill = attention_class.flash_decode_and_prefill

    def bounded(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k, block_table,
                is_decode_only):
        if is_decode_only and isinstance(max_seqlen_k, int) and max_seqlen_k > 0 and block_table is not None:
            block_table = block_table[:, :math.ceil(max_seqlen_k / k.shape[1])]
        return flash_decode_and_prefill(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k,
                                        seqlens_k, block_table, is_decode_only)

    attention_class.flash_decode_and_prefill = bounded


def step_scheduled(engine):
    """``engine.step_modern()`` for a caller that has just scheduled the waiting requests itself
    (``engine.schedule_waiting_requests()``, to know the step's tokens before it runs): the step
    does not schedule them again. Upstream's step schedules first (``async_forward``,
    ``dynamic_engine.py:1178``), and a second pass is not harmless: a continuing chunked prefill
    is sized as ``max_tokens - active_token_count`` and then gives back its placeholder token
    (``add_request``, ``dynamic_context.py:1615``), so the first pass leaves one token of budget,
    and the second adds a one-token chunk to the same request, overwriting the chunk's query
    length and offset: the attention then treats the chunk's other tokens as padding."""
    engine.schedule_waiting_requests = lambda: None  # shadows the method for this step only
    try:
        return engine.step_modern()
    finally:
        del engine.schedule_waiting_requests


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
