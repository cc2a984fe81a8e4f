"""BigMac's side in the benchmark tools (the variant itself: ``moe_variants/bigmac/variant.py``)."""

from __future__ import annotations

from moe_variants.bigmac.config import BigMacConfig
from tools.variants import VariantTools, register


@register
class BigMacTools(VariantTools):
    name = "bigmac"

    def upstream_moe_config(self, model):
        """megatron-core 0.16.1's own latent MoE (``moe_latent_size``) at this model's shape: latent
        L = r x H and expert FFN F / r from the BigMac section, whether or not the model selects the
        BigMac layer (the EP benchmark's ``mcore-latent`` peer)."""
        cfg = BigMacConfig.of(model)
        return {"moe_latent_size": cfg.latent_size(model.hidden_size), "moe_ffn_hidden_size": cfg.expert_ffn(model)}
