"""A row-parallel projection's tensor-parallel reduction, deferred or asynchronous.

With TP > 1 a ``RowParallelLinear`` (the attention's output projection, an MLP's second linear)
reduces its partial sums over the tensor-parallel group: a reduce-scatter along the sequence under
sequence parallelism, an all-reduce otherwise. A layer that does not need the reduced output at
once can take the partial sum instead and reduce it later: FarSkip flies the attention's reduction
behind the MoE (paper §4.2), Sem-MoE's attention-TP reduces once per layer where the tokens go.

``unreduced(linear)`` makes the projection return its partial sum through upstream's own switch
(``explicit_expert_comm``, ``tensor_parallel/layers.py:1286``: the path expert layers use to
reduce themselves); ``PendingReduction`` runs the same collective with ``async_op`` and returns the
same tensor on ``wait()``. Forward only (inference): the layer refuses it when gradients are on.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron.common import collectives

__all__ = ["unreduced", "PendingReduction"]


@contextlib.contextmanager
def unreduced(linear):
    """Within the block, ``linear`` (a ``RowParallelLinear`` with ``skip_bias_add``) returns its
    un-reduced partial sum [s, b, h]."""
    if not linear.skip_bias_add:
        raise ValueError("an unreduced projection needs its bias added outside it (skip_bias_add)")
    previous = linear.explicit_expert_comm
    linear.explicit_expert_comm = True
    try:
        yield
    finally:
        linear.explicit_expert_comm = previous


class PendingReduction:
    """The TP reduction of a partial sum, in flight: ``wait()`` returns what ``RowParallelLinear``
    would have returned (``[s / tp, b, h]`` under sequence parallelism, ``[s, b, h]`` otherwise)."""

    def __init__(self, partial: torch.Tensor, group, sequence_parallel: bool):
        partial = partial.contiguous()
        if sequence_parallel:
            size = dist.get_world_size(group)
            self.output = partial.new_empty((partial.size(0) // size,) + tuple(partial.shape[1:]))
            self.work = collectives.reduce_scatter_tensor(self.output, partial, group=group, async_op=True)
        else:
            self.output = partial
            self.work = collectives.all_reduce_async(partial, group=group)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        output, self.output, self.work = self.output, None, None
        return output
