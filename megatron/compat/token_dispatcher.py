"""megatron-core's all-to-all token dispatcher with its host split sizes step public (megatron-core 0.16.1).

``MoEAlltoAllTokenDispatcher`` moves the split sizes of its all-to-alls to the host on a side
CUDA stream, at a point it chooses, in a private step (``_maybe_dtoh_and_synchronize``,
``transformer/moe/token_dispatcher.py:862``) that its own ``dispatch_preprocess``/
``token_dispatch``/``dispatch_postprocess`` call (``:629``, ``:663``, ``:704``, ``:740``). On the
CPU the sizes are host tensors already and there is no stream to synchronise: the step returns
them unchanged. :class:`AlltoAllTokenDispatcher` is upstream's class with that adaptation and
the step under a public name (``synchronize_splits``) for the project's subclass
(``moe_variants/common/dispatcher.py``), which replaces the communication steps that call it.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

__all__ = ["AlltoAllTokenDispatcher"]


class AlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """``MoEAlltoAllTokenDispatcher`` whose split sizes stay on the host on the CPU."""

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        # Upstream moves split sizes to the host on a side CUDA stream (token_dispatcher.py:862-901).
        # On the CPU they are host tensors already; the collectives convert them to lists.
        if torch.cuda.is_available():
            return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
        return tokens_per_expert

    def synchronize_splits(self, point: str, tokens_per_expert=None):
        """Upstream's split-size step at ``point`` (e.g. ``"before_ep_alltoall"``): the tokens per
        expert, on the host where upstream's schedule puts them there."""
        return self._maybe_dtoh_and_synchronize(point, tokens_per_expert)
