"""Multi-latent attention without Transformer Engine (megatron-core 0.16.1).

``multi_latent_attention.py:54-65`` imports ``TELinear`` from ``megatron.core.extensions.
transformer_engine``, which without TE still imports: it subclasses a ``MagicMock`` stand-in
(``extensions/transformer_engine.py:61-77``, ``:470``), so ``HAVE_TE`` ends up True and ``TELinear``
is a mock instance. ``MultiLatentAttention.__init__`` then calls ``isinstance(self.linear_proj,
TELinear)`` (``:184-185``), which raises ``TypeError``: MLA cannot be built at all without TE.
The flag only gates that FP8 memory tweak for TE linears, so setting it to its true value (False)
is the whole fix. Applied explicitly by the model builder when it builds MLA; idempotent.
"""

from __future__ import annotations

import importlib.util

from megatron.compat.sites import MODULE, Site

__all__ = ["apply_mla_without_te", "MLA_WITHOUT_TE_SITES"]

# the upstream text each fix depends on, by enclosing function (compat/sites.py)
MLA_WITHOUT_TE_SITES = [
    Site("transformer/multi_latent_attention.py", MODULE, "HAVE_TE = True"),
    Site("transformer/multi_latent_attention.py", "MultiLatentAttention.__init__", "HAVE_TE"),
    Site("transformer/multi_latent_attention.py", "MultiLatentAttention.__init__",
         "and isinstance(self.linear_proj, TELinear)"),
    Site("extensions/transformer_engine.py", MODULE, "te = MagicMock()"),
]


def apply_mla_without_te() -> bool:
    """Correct ``multi_latent_attention.HAVE_TE`` when Transformer Engine is absent. Returns
    whether it had to."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return False
    from megatron.core.transformer import multi_latent_attention

    changed = multi_latent_attention.HAVE_TE
    multi_latent_attention.HAVE_TE = False
    return bool(changed)


# --- serving MLA with megatron-core's dynamic engine ---------------------------------------------
#
# megatron-core 0.16.1's dynamic engine serves MLA only with ``cache_mla_latents`` (the paged cache
# holds each token's latent and rotary key; decode absorbs the key up-projection into the query and
# runs FlashMLA). Four things stop that path here, each fixed in place by ``apply_mla_serving``:
#
# 1. ``MultiLatentAttention.forward`` calls ``flash_decode_and_prefill`` without its last argument
#    ``is_decode_only`` (``multi_latent_attention.py:309-319`` against ``attention.py:756-768``): a
#    TypeError on every step, GPU or not. The forward now records the context's own decode flag and
#    the method reads it when the argument is missing.
# 2. ``prepare_for_absorption`` splits Transformer Engine's fused norm + up-projection with
#    ``split_te_layernorm_column_parallel_linear`` (``:885-944``), which needs TE. A local layer has
#    its ``kv_layernorm`` as a module already (applied before the latent is cached, ``:640``) and a
#    plain ``linear_kv_up_proj``: the local split keeps the norm and takes the linear as the
#    uncompressing projection, with the same per-head up-K / up-V weight views.
# 3. The dummy forward of an idle expert-parallel rank runs without an inference context, which the
#    latent path refuses: such a forward takes the plain path (``_without_latent_cache``).
# 4. A prefill step whose queries all have length 1 (a one-token prompt, nothing else in
#    prefill) is not decode-only, yet ``_adjust_key_value_for_inference`` hands the attention the
#    latent cache itself instead of uncompressed keys and values (it tests ``max_seqlen_q > 1``,
#    ``attention.py:611``); such a step is uncompressed here.
#
# Prefill also uncompresses the whole paged cache on every step (``:611-618``: every block of the
# buffer, used or not). Here only the blocks the step's block table names are uncompressed, read
# through the table on the device: the table [B, M] cut to the blocks of the step's longest request
# (``max_seqlen_k``, a host int the engine holds) gives B x M' blocks, uncompressed in that order,
# and the attention reads them through a table renumbered to ``arange(B * M')``. The same keys and
# values, without the cost growing with ``--kv-cache-gb`` and without reading any tensor on the host
# (entries past a request's blocks, -1, uncompress block 0, which the length mask hides).

MLA_SERVING_SITES = [
    Site("transformer/multi_latent_attention.py", "MultiLatentAttention.forward",
         "core_attn_out = self.flash_decode_and_prefill("),
    Site("transformer/multi_latent_attention.py", "MultiLatentAttention.forward", "block_table,"),
    Site("transformer/attention.py", "Attention.flash_decode_and_prefill", "is_decode_only,"),
    Site("transformer/multi_latent_attention.py", "MLASelfAttention.prepare_for_absorption",
         "def prepare_for_absorption(self):"),
    Site("transformer/multi_latent_attention.py", "MLASelfAttention.prepare_for_absorption",
         "split_te_layernorm_column_parallel_linear("),
    Site("transformer/multi_latent_attention.py", "MLASelfAttention.uncompress_kv_from_cache",
         "def uncompress_kv_from_cache(self, kv_cached):"),
    Site("transformer/attention.py", "Attention._adjust_key_value_for_inference",
         'if getattr(self.config, "cache_mla_latents", None) and max_seqlen_q > 1:'),
    Site("transformer/attention.py", "Attention._adjust_key_value_for_inference",
         "key, value = self.uncompress_kv_from_cache(kv_cache)"),
    Site("transformer/multi_latent_attention.py", "MLASelfAttention.get_query_key_value_tensors",
         "inference_context and not inference_context.is_static_batching()"),
    Site("inference/model_inference_wrappers/abstract_model_inference_wrapper.py",
         "AbstractModelInferenceWrapper.dummy_forward", "return self.model(tokens, position_ids, attention_mask)"),
    # the step's block table and key-length bound (read by _step_table), set once per step before the forward
    Site("inference/contexts/dynamic_context.py", "DynamicInferenceContext.initialize_attention_state",
         'self.active_attn_metadata["mha_metadata"].update('),
    Site("inference/contexts/attention_context/mha_metadata.py", "MHAMetadata.update",
         '"block_table": self._block_table_buf[0:padded_active_request_count, :],'),
    Site("inference/contexts/attention_context/mha_metadata.py", "NonGraphedMHAMetadata.update",
         'self.state_data["max_seqlen_k"] = torch.max(self.state_data["kv_seq_lengths"]).item()'),
]

_mla_serving_applied = False


def apply_mla_serving() -> bool:
    """Make megatron-core's MLA path of the dynamic engine run (see above; idempotent). Returns
    whether it patched anything this call."""
    global _mla_serving_applied
    if _mla_serving_applied:
        return False
    import torch

    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MultiLatentAttention

    forward = MultiLatentAttention.forward
    prepare = MLASelfAttention.prepare_for_absorption
    uncompress = MLASelfAttention.uncompress_kv_from_cache

    def mla_forward(self, hidden_states, attention_mask, *args, **kwargs):
        context = kwargs.get("inference_context")
        if context is None and len(args) >= 2:
            context = args[1]
        dynamic = context is not None and not context.is_static_batching()
        if self.cache_mla_latents and not dynamic:
            return _without_latent_cache(self, forward, hidden_states, attention_mask, *args, **kwargs)
        self._mla_decode_only = bool(dynamic and context.is_decode_only())
        self._mla_table = None
        if dynamic and self.config.cache_mla_latents and not self._mla_decode_only:
            self._mla_table = _step_table(context)
        return forward(self, hidden_states, attention_mask, *args, **kwargs)

    def mla_uncompress(self, kv_cached):
        table = getattr(self, "_mla_table", None)
        if table is None or kv_cached.dim() != 3:
            return uncompress(self, kv_cached)
        return uncompress(self, kv_cached[table.flatten()])

    def mla_flash_decode_and_prefill(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k,
                                     seqlens_k, block_table, is_decode_only=None):
        if is_decode_only is None:
            is_decode_only = self._mla_decode_only
        if not is_decode_only:
            if v is None:  # the latent cache itself (a prefill step of one-token queries only)
                k, v = mla_uncompress(self, k)
            table = getattr(self, "_mla_table", None)
            if table is not None:  # k, v hold the table's blocks in its order
                block_table = torch.arange(table.numel(), dtype=block_table.dtype,
                                           device=block_table.device).view(table.shape)
        return Attention.flash_decode_and_prefill(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q,
                                                  cu_seqlens_k, seqlens_k, block_table, is_decode_only)

    def mla_prepare(self):
        if hasattr(self, "up_k_weight") or hasattr(self.linear_kv_up_proj, "layer_norm_weight"):
            return prepare(self)  # done already, or Transformer Engine's fused layer: upstream's split
        with torch.no_grad():
            self.linear_kv_up_proj_linear = self.linear_kv_up_proj
            cfg = self.config
            weight = self.linear_kv_up_proj.weight.view(
                self.num_attention_heads_per_partition, cfg.qk_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            self.up_k_weight = weight[:, :cfg.qk_head_dim, :]  # [heads, qk_head_dim, kv_lora_rank]
            self.up_v_weight = weight[:, cfg.qk_head_dim:, :]  # [heads, v_head_dim, kv_lora_rank]

    MultiLatentAttention.forward = mla_forward
    MultiLatentAttention.flash_decode_and_prefill = mla_flash_decode_and_prefill
    MLASelfAttention.uncompress_kv_from_cache = mla_uncompress
    MLASelfAttention.prepare_for_absorption = mla_prepare
    _mla_serving_applied = True
    return True


def _step_table(context):
    """The cache blocks of ``context``'s step, as the block table names them: [B, M'] (long),
    the table cut to the blocks of the step's longest request where the engine holds that length
    as a host int (``max_seqlen_k``: every eager step), -1 entries read as block 0. Read on the
    device: no host sync."""
    table = context.active_attn_metadata["mha_metadata"].state_data["block_table"]
    _, _, max_len = context.cu_kv_lengths()
    width = table.shape[1]
    if isinstance(max_len, int) and max_len > 0:
        width = min(width, -(-max_len // context.block_size_tokens))
    return table[:, :width].long().clamp(min=0)


def _without_latent_cache(layer, forward, *args, **kwargs):
    """``forward`` of a latent-caching MLA layer called without a dynamic inference context (the
    dummy forward of an idle expert-parallel rank: ``abstract_model_inference_wrapper.py:166-180``),
    which the latent path refuses (``multi_latent_attention.py:845-848``): run the plain path,
    with the uncompressing projection standing in for the up-projection that upstream's
    absorption deleted."""
    config = layer.config
    restore_proj = not hasattr(layer, "linear_kv_up_proj") and hasattr(layer, "linear_kv_up_proj_linear")
    if restore_proj:
        layer.linear_kv_up_proj = layer.linear_kv_up_proj_linear
    layer.cache_mla_latents = config.cache_mla_latents = False
    try:
        return forward(layer, *args, **kwargs)
    finally:
        layer.cache_mla_latents = config.cache_mla_latents = True
        if restore_proj:
            del layer.linear_kv_up_proj


def use_latent_cache(model) -> int:
    """Switch every multi-latent attention layer of ``model`` to megatron-core's latent KV cache
    (``cache_mla_latents``: the only MLA path of its dynamic engine); the layers read the flag at
    construction (``multi_latent_attention.py:127``) and from the config at run time. Returns the
    number of layers switched."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    layers = [m for m in model.modules() if isinstance(m, MultiLatentAttention)]
    for layer in layers:
        layer.config.cache_mla_latents = True
        layer.cache_mla_latents = True
    return len(layers)
