"""Torch LayerNorm/RMSNorm for megatron-core local specs, with sequence parallelism.

megatron-core's ``WrappedTorchNorm`` (used when apex is absent) refuses ``sequence_parallel``
(``transformer/torch_norm.py:32``) because it does not tag its weights. Under sequence parallelism
each TP rank normalises a different slice of the sequence, so the norm weights get partial
gradients that megatron-core all-reduces over TP for every parameter tagged
``sequence_parallel=True`` (``distributed/finalize_model_grads.py``), exactly as apex's and Transformer
Engine's norms are tagged. This class does that tagging and nothing else.
"""

from __future__ import annotations

import torch


class TorchNorm:
    """Factory with ``WrappedTorchNorm``'s signature returning a tagged torch norm module."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm=False,
                zero_centered_gamma=False, normalization: str = "LayerNorm"):
        if config.normalization == "LayerNorm":
            module = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            module = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"--normalization {config.normalization!r}: use LayerNorm or RMSNorm")
        for param in module.parameters():
            param.sequence_parallel = config.sequence_parallel
        return module
