"""BigMac as a registered variant: ``--moe-variant bigmac`` swaps the MoE layer class (its upstream
peer's shape for the benchmarks: ``tools/bigmac/variant_tools.py``)."""

from __future__ import annotations

from moe_variants.bigmac.config import BigMacConfig, UpProjectionInit
from moe_variants.registry import Variant, register


@register
class BigMac(Variant):
    name = "bigmac"
    config = BigMacConfig
    moe_layer = "bigmac"
    bench_presets = {"bigmac": {"moe_variant": "bigmac"}}
    off = {"moe_variant": "standard"}

    def validate(self, model, parallel) -> None:
        cfg = self.section(model)
        if cfg.bigmac_ratio is not None and not 0 < cfg.bigmac_ratio <= 1:
            raise ValueError(f"--bigmac-ratio must be in (0, 1], got {cfg.bigmac_ratio}")
        latent = cfg.latent_size(model.hidden_size)
        if not 1 <= latent <= model.hidden_size:
            raise ValueError(f"--moe-latent-size {latent} must be between 1 and --hidden-size {model.hidden_size}")

    def moe_layer_spec(self, spec, model):
        import dataclasses

        from moe_variants.bigmac.layer import BigMacMoELayer

        cfg = self.section(model)
        params = {**spec.params, "latent_size": cfg.latent_size(model.hidden_size),
                  "expert_ffn_hidden_size": cfg.expert_ffn(model),
                  "up_init_scaled": cfg.bigmac_up_init is UpProjectionInit.output_scaled}
        return dataclasses.replace(spec, module=BigMacMoELayer, params=params)

    def export_refusal(self, model, target: str):
        return f"--moe-variant bigmac: BigMac layers have no {target} equivalent"
