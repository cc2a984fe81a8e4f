"""The seam for changing how a megatron-core local linear multiplies.

``ColumnParallelLinear`` and ``RowParallelLinear`` (``tensor_parallel/layers.py:948-952`` and
``:1239-1243`` in 0.16.1) route their matmul through ``self._forward_impl(input=..., weight=...,
bias=..., gradient_accumulation_fusion=..., allreduce_dgrad=..., sequence_parallel=..., ...)``.
Replacing that one bound method on an instance changes the linear's autograd function and nothing
else: parameters, state dicts, tensor-parallel communication around it stay upstream's.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["wrap_local_linear"]


def wrap_local_linear(linear, make_impl: Callable[[Callable], Callable], tag: str) -> bool:
    """Set ``linear._forward_impl = make_impl(original)`` once per ``tag``.

    Returns False (and changes nothing) for ``None``, a module without a local ``_forward_impl``
    (e.g. Transformer Engine's linears), or one already wrapped under ``tag``.
    """
    if linear is None or not callable(getattr(linear, "_forward_impl", None)):
        return False
    tags = linear.__dict__.setdefault("_compat_linear_wraps", set())
    if tag in tags:
        return False
    linear._forward_impl = make_impl(linear._forward_impl)
    tags.add(tag)
    return True
