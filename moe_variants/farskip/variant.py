"""FarSkip-Collective as a registered variant: ``--farskip`` rewires the selected layers of the
built model (no parameter changes, so any checkpoint loads with either connectivity)."""

from __future__ import annotations

from moe_variants.farskip.config import FarSkipConfig, FarSkipImpl
from moe_variants.registry import Variant, register


@register
class FarSkip(Variant):
    name = "farskip"
    config = FarSkipConfig
    bench_presets = {
        "farskip-simple": {"farskip": "all", "farskip_impl": "simple"},
        "farskip": {"farskip": "all", "farskip_impl": "overlapped"},
        "farskip-eager-wgrad": {"farskip": "all", "farskip_impl": "overlapped", "farskip_defer_wgrad": False},
        # inference at TP > 1 (paper §4.2): the attention output's TP reduction flies behind the MoE
        "farskip-async-tp": {"farskip": "all", "farskip_impl": "overlapped", "farskip_async_tp": True},
        # inference: attention split at its input projections, the rest behind the dispatch
        "farskip-split": {"farskip": "all", "farskip_impl": "overlapped", "farskip_inference_split": True},
        # inference: a prefill's core attention in two halves by heads, the second behind the dispatch
        "farskip-heads": {"farskip": "all", "farskip_impl": "overlapped", "farskip_inference_heads": True},
        "farskip-split-async-tp": {"farskip": "all", "farskip_impl": "overlapped", "farskip_inference_split": True,
                                   "farskip_async_tp": True},
    }
    off = {"farskip": "none"}

    def enabled(self, model) -> bool:
        return not self.section(model).farskip.empty

    def validate(self, model, parallel) -> None:
        cfg = self.section(model)
        cfg.layers(model.num_layers)  # raises on a selection outside the model
        if cfg.farskip_impl == FarSkipImpl.overlapped and model.is_moe \
                and model.moe_token_dispatcher_type.value != "alltoall":
            raise ValueError("--farskip-impl overlapped needs --moe-token-dispatcher-type alltoall")
        if cfg.farskip_async_tp and (cfg.farskip_impl != FarSkipImpl.overlapped or cfg.farskip_mode.value != "full"):
            raise ValueError("--farskip-async-tp needs --farskip-impl overlapped and --farskip-mode full")
        if cfg.farskip_inference_split and (cfg.farskip_impl != FarSkipImpl.overlapped
                                            or cfg.farskip_mode.value != "full"):
            raise ValueError("--farskip-inference-split needs --farskip-impl overlapped and --farskip-mode full")
        if cfg.farskip_inference_heads and (cfg.farskip_impl != FarSkipImpl.overlapped
                                           or cfg.farskip_mode.value != "full"):
            raise ValueError("--farskip-inference-heads needs --farskip-impl overlapped and --farskip-mode full")
        if cfg.farskip_inference_heads and (cfg.farskip_inference_split or cfg.farskip_async_tp):
            raise ValueError("--farskip-inference-heads cannot be combined with --farskip-inference-split or "
                             "--farskip-async-tp (each places attention's parts differently)")

    def apply(self, gpt, model) -> None:
        from moe_variants.config import moe_layer_pattern
        from moe_variants.farskip.block import apply_farskip

        apply_farskip(gpt, self.section(model), moe_layer_pattern(model))

    def export_refusal(self, model, target: str):
        return (f"--farskip {self.section(model).farskip}: FarSkip connectivity has no {target} equivalent "
                "(export the teacher, or distil back to standard connectivity)")
