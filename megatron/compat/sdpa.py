"""Which kernel torch's ``scaled_dot_product_attention`` would run, for the log line that names it.

torch picks the kernel at each call from the enabled backends (in the priority order that
``torch.nn.attention.sdpa_kernel(..., set_priority=True)`` sets) and the inputs' device, dtype,
shapes, mask and dropout; it does not say which it took. Its dispatcher's choice is exposed only
as the private ``torch._fused_sdp_choice`` (``sites.TORCH_PRIVATE_APIS``;
``tests/compat/test_staleness.py`` checks it exists), which returns the ``SDPBackend`` value the
call would use (MATH when no fused kernel accepts the inputs).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.attention import SDPBackend

__all__ = ["sdpa_kernel_choice"]


def sdpa_kernel_choice(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                       attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                       scale: Optional[float] = None, enable_gqa: bool = False) -> SDPBackend:
    """The backend ``F.scaled_dot_product_attention`` would run on these arguments under the
    currently enabled backends and priority (call it inside the same ``sdpa_kernel`` context)."""
    choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                     enable_gqa=enable_gqa)
    return SDPBackend(choice) if not isinstance(choice, SDPBackend) else choice
