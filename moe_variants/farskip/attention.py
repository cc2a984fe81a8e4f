"""megatron-core self-attention split in stages, so a collective can run between them.

``attention_qkv`` is the query/key/value preparation: for ``SelfAttention`` the QKV projection plus
RoPE, for multi-latent attention (``MLASelfAttention``, DeepSeek-V2/V3) the down-projections, the
latent norms, the up-projections and RoPE (megatron-core's ``get_query_key_value_tensors``).
``attention_out`` is core attention plus the output projection. ``core_attention_rows`` runs core
attention on a slice of the micro-batch (sequences are independent in core attention) and
``attention_proj`` projects the concatenated slices, so the overlapped FarSkip layer can spread
core attention over two communication windows.

Together they are the training path of ``Attention.forward`` (``transformer/attention.py:875-1215``)
and of ``MultiLatentAttention.forward`` (``transformer/multi_latent_attention.py:201-358``): no
inference context, packed sequences, output gate, activation offloading, core-attention or up-
projection recompute, cached MLA latents or DSA; with the same operations in the same order, so the
result is bit-identical (tests/farskip/test_farskip.py). Other attention classes, and those
settings, are not split: ``can_split`` is False and the caller runs the module whole.

At inference (megatron-core's KV-cached path, which this module does not re-implement) attention
is split at its input projections instead: ``project_inputs`` runs the linears attention applies to
its input directly (``SelfAttention``'s QKV projection; MLA's query and KV down-projections) ahead
of time, and inside ``projected_inputs`` those linears hand back the stored outputs when upstream's
``Attention.forward`` calls them on that same tensor, so the forward runs only the rest (norms,
up-projections, RoPE, the cache write, core attention over the cache, the output projection).
The same operations on the same tensors: the result is bit-identical.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["can_split", "attention_qkv", "attention_out", "core_attention_rows", "attention_proj",
           "input_projections", "project_inputs", "projected_inputs"]


def _is_mla(attn) -> bool:
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    return type(attn) is MLASelfAttention


def can_split(attn) -> bool:
    from megatron.core.transformer.attention import SelfAttention

    cfg = attn.config
    plain = (
        not getattr(attn, "checkpoint_core_attention", False)
        and not getattr(attn, "offload_qkv_linear", False)
        and not getattr(attn, "offload_core_attention", False)
        and not getattr(attn, "offload_attn_proj", False)
    )
    if type(attn) is SelfAttention:
        return plain and not cfg.attention_output_gate and not getattr(cfg, "fused_single_qkv_rope", False)
    if _is_mla(attn):
        return (plain and not getattr(attn, "recompute_up_proj", False) and not cfg.cache_mla_latents
                and getattr(cfg, "experimental_attention_variant", None) is None)
    return False


def attention_qkv(attn, hidden: torch.Tensor, rotary_pos_emb=None):
    """[s, b, h] -> (query, key, value) with rotary embeddings applied."""
    if _is_mla(attn):  # MLA applies its own (YaRN) rotary embedding inside
        query, key, value, _, _ = attn.get_query_key_value_tensors(hidden, None, None, None, inference_context=None)
        return query.contiguous(), key.contiguous(), value.contiguous()
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    cfg = attn.config
    if cfg.no_rope_freq and cfg.no_rope_freq[attn.layer_number - 1]:
        rotary_pos_emb = None
    query, key, value = attn.get_query_key_value_tensors(hidden, None, output_gate=False, split_qkv=True)
    if rotary_pos_emb is not None:
        if not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb,) * 2
        q_pos, k_pos = rotary_pos_emb
        mscale = _yarn_get_concentration_factor_from_config(cfg)
        if q_pos is not None:
            query = apply_rotary_pos_emb(
                query, q_pos, config=cfg, cu_seqlens=None, mscale=mscale, cp_group=attn.pg_collection.cp
            )
        if k_pos is not None:
            key = apply_rotary_pos_emb(
                key, k_pos, config=cfg, cu_seqlens=None, mscale=mscale, cp_group=attn.pg_collection.cp
            )
    return query, key, value


def attention_out(attn, query, key, value, attention_mask):
    """Core attention + output projection: ``(output, bias)`` like ``Attention.forward``."""
    core = attn.core_attention(
        query, key, value, attention_mask, attn_mask_type=attn.attn_mask_type,
        attention_bias=None, packed_seq_params=None,
    )
    return attn.linear_proj(core)


def core_attention_rows(attn, query, key, value, attention_mask, start: int, stop: int) -> torch.Tensor:
    """Core attention of the sequences ``start:stop`` of the micro-batch: [s, stop-start, h].

    Each sequence's attention reads only that sequence, so the slices concatenated along the
    batch dimension equal ``attn.core_attention`` on the whole micro-batch.
    """
    mask = attention_mask
    if mask is not None and mask.dim() == 4 and mask.size(0) == query.size(1) and mask.size(0) > 1:
        mask = mask[start:stop]
    return attn.core_attention(
        query[:, start:stop], key[:, start:stop], value[:, start:stop], mask,
        attn_mask_type=attn.attn_mask_type, attention_bias=None, packed_seq_params=None,
    )


def attention_proj(attn, core_parts):
    """Output projection of core-attention slices (concatenated along the batch): ``(output, bias)``."""
    core = core_parts[0] if len(core_parts) == 1 else torch.cat(core_parts, dim=1)
    return attn.linear_proj(core)


def input_projections(attn) -> list:
    """The linears ``attn`` applies to its input itself: ``SelfAttention``'s QKV projection; MLA's
    query projection (or query down-projection with ``q_lora_rank``) and KV down-projection. Empty
    for other attention classes."""
    from megatron.core.transformer.attention import SelfAttention

    if _is_mla(attn):
        query = attn.linear_q_down_proj if attn.config.q_lora_rank is not None else attn.linear_q_proj
        return [query, attn.linear_kv_down_proj]
    if type(attn) is SelfAttention and not getattr(attn, "offload_qkv_linear", False):
        return [attn.linear_qkv]
    return []


class ProjectedInputs:
    """Outputs of ``attn``'s input projections on one tensor (``project_inputs``); ``used`` counts
    how many of them the forward then took instead of recomputing."""

    def __init__(self, hidden: torch.Tensor, outputs: list):
        self.hidden = hidden
        self.outputs = outputs  # [(module, output)]
        self.used = 0


def project_inputs(attn, hidden: torch.Tensor) -> ProjectedInputs:
    """Run ``input_projections(attn)`` on ``hidden`` now (the first stage of attention)."""
    return ProjectedInputs(hidden, [(m, m(hidden)) for m in input_projections(attn)])


@contextlib.contextmanager
def projected_inputs(projected: ProjectedInputs):
    """Within the block, each input projection called on ``projected.hidden`` (the very tensor)
    returns its stored output, once; any other call runs the module."""
    patched = []
    for module, output in projected.outputs:
        previous = module.__dict__.get("forward")  # an instance-level forward someone else set
        original = previous if previous is not None else module.forward
        pending = [output]

        def forward(x, *args, _original=original, _pending=pending, **kwargs):
            if x is projected.hidden and _pending and not args and not kwargs:
                projected.used += 1
                return _pending.pop()
            return _original(x, *args, **kwargs)

        module.forward = forward
        patched.append((module, previous))
    try:
        yield
    finally:
        for module, previous in patched:
            if previous is None:
                del module.forward
            else:
                module.forward = previous
