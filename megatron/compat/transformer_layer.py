"""The MLP step of megatron-core's transformer layer, wrapped from outside (megatron-core 0.16.1).

``TransformerLayer.forward`` runs attention, then the MLP (or MoE) block through a private step,
``_forward_mlp(hidden_states, inference_context, padding_mask=)`` (``transformer/transformer_layer.py:683``,
called at ``:514``; ``MoETransformerLayer`` overrides it at ``:1334``), which also adds the
residual. Code that must act on that step's output on a built model (Sem-MoE's Algorithm 3
gathers the re-batched tokens back after the MoE, ``moe_variants/semmoe/attention_tp.py``) wraps
it here; the sites are pinned in ``sites.UPSTREAM_COUPLING_SITES``.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["wrap_forward_mlp"]


def wrap_forward_mlp(layer, wrap: Callable[[Callable], Callable]) -> None:
    """Replace ``layer``'s MLP step (residual included) by ``wrap(forward_mlp)``, where
    ``forward_mlp(hidden_states, *args, **kwargs) -> output`` is the step as it was."""
    layer._forward_mlp = wrap(layer._forward_mlp)
