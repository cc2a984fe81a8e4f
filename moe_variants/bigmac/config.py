"""BigMac's config section: the low dimension of the all-to-all and the reversed experts' width.

Flags: ``--moe-variant bigmac`` selects the layer; ``--bigmac-ratio r`` (default 0.25, the paper's)
or ``--moe-latent-size L`` (megatron-core's name for the same dimension) sets L = r x hidden;
``--bigmac-ffn-hidden-size F`` sets the reversed experts' intermediate size (default f / r, which
keeps the expert parameters of the fine-grained baseline); ``--bigmac-up-init plain`` initialises the
up-projection L -> H like the down-projection instead of with the output-layer scaling (the ablation
of docs/results/bigmac.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from moe_variants.config import Choice, coerce_enums
from moe_variants.registry import VariantConfig

__all__ = ["BigMacConfig", "UpProjectionInit"]


class UpProjectionInit(Choice):
    """The up-projection's initialisation: megatron-core's output-layer init (std / sqrt(2 x layers),
    as every projection that writes into the residual stream), or the plain init (std)."""

    output_scaled = "output_scaled"
    plain = "plain"


@dataclasses.dataclass
class BigMacConfig(VariantConfig):
    """BigMac (DCCA): descend, communicate, compute, communicate, ascend (docs/design/bigmac.md)."""

    SECTION = "bigmac"

    bigmac_ratio: Optional[float] = 0.25
    """r: the all-to-all runs at r x --hidden-size (with --moe-variant bigmac)"""
    moe_latent_size: Optional[int] = None
    """the low dimension L itself (megatron-core's name); overrides --bigmac-ratio"""
    bigmac_ffn_hidden_size: Optional[int] = None
    """reversed experts' intermediate size F (default: expert FFN / r)"""
    bigmac_up_init: UpProjectionInit = UpProjectionInit.output_scaled
    """up-projection L -> H init: output_scaled (std / sqrt(2 x layers)) or plain (std)"""

    def __post_init__(self):
        coerce_enums(self)

    def latent_size(self, hidden_size: int) -> int:
        """L = r x h, or ``--moe-latent-size`` when given."""
        if self.moe_latent_size is not None:
            return self.moe_latent_size
        return int(round((0.25 if self.bigmac_ratio is None else self.bigmac_ratio) * hidden_size))

    def expert_ffn(self, model) -> int:
        """F: set, or the parameter-matching f / r."""
        if self.bigmac_ffn_hidden_size is not None:
            return self.bigmac_ffn_hidden_size
        f = model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
        return int(math.ceil(f / (self.latent_size(model.hidden_size) / model.hidden_size)))
