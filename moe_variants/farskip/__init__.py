"""FarSkip-Collective: connectivity that lets dispatch/combine overlap attention and the next layer.

``apply_farskip(gpt, model_cfg)`` switches a built model's selected layers (``--farskip``) to the
two-stream connectivity, executed ``simple`` (blocking, the reference) or ``overlapped``.
"""

from moe_variants.farskip.block import FarSkipTransformerBlock, apply_farskip, check_farskip_supported
from moe_variants.farskip.connectivity import FarSkipState, parse_farskip_layers
from moe_variants.farskip.layer import FarSkipTransformerLayer

__all__ = [
    "apply_farskip",
    "check_farskip_supported",
    "parse_farskip_layers",
    "FarSkipState",
    "FarSkipTransformerBlock",
    "FarSkipTransformerLayer",
]
