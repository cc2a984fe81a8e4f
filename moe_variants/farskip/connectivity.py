"""Which layers are FarSkip, and the two residual streams they pass along.

FarSkip-Collective (paper §3) keeps two streams between layers: the full stream ``o_k`` (R) and
the attention-input stream A_k = o_{k-1} + attn-out_k + shared-exp-out_k, i.e. everything except
layer k's routed-expert output, which may still be in flight in the combine all-to-all. Layer k+1's
attention reads A_k and its MoE reads o_k... one layer earlier: mlp-in_{k+1} = o_k (the residual
*before* layer k+1's attention), so its dispatch can overlap that attention.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

__all__ = ["FarSkipState", "PendingRouted"]


@dataclasses.dataclass
class PendingRouted:
    """A layer's routed-expert output still in its combine all-to-all.

    ``finish()`` waits for the collective, un-permutes (and, for BigMac, up-projects) with the
    owning layer's dispatcher state, and returns the full stream o_k = A_k + routed_k.
    """

    moe: torch.nn.Module  # the MoE layer whose dispatcher holds the un-permutation state
    combined: torch.Tensor
    wait: Callable[[], None]
    attn_stream: torch.Tensor  # A_k
    dropout: Callable[[torch.Tensor], torch.Tensor]

    def finish(self) -> torch.Tensor:
        self.wait()
        routed = self.moe.postprocess(self.combined, None)
        return self.attn_stream + self.dropout(routed)


@dataclasses.dataclass
class FarSkipState:
    """What one layer hands the next: A_k, and o_k (or the pending combine that completes it)."""

    attn_stream: torch.Tensor
    full: Optional[torch.Tensor] = None
    pending: Optional[PendingRouted] = None

    @classmethod
    def single(cls, hidden: torch.Tensor) -> "FarSkipState":
        """One collapsed stream (after a standard or dense layer, or the embedding)."""
        return cls(attn_stream=hidden, full=hidden)

    def full_stream(self) -> torch.Tensor:
        """o_k, waiting for an in-flight combine if there is one."""
        if self.full is None:
            self.full = self.pending.finish()
            self.pending = None
        return self.full
