"""The private autograd-engine APIs the project relies on, in one place.

The deferred weight gradients (``moe_variants/common/wgrad.py``) tie their queue to the running
backward pass (its graph-task id) and flush it with an engine callback at the pass's end. Both are
private torch APIs (``sites.TORCH_PRIVATE_APIS``; tests/compat/test_staleness.py checks they exist).
The backward reordering uses megatron-core's own ``set_tensor_grad_fn_sequence_sr``
(``transformer/moe/shared_experts.py:281``), which wraps ``Node._set_sequence_nr``.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["current_graph_task_id", "queue_engine_callback"]


def current_graph_task_id() -> int:
    """Id of the backward pass running on this thread (-1 outside a backward)."""
    return torch._C._current_graph_task_id()


def queue_engine_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass finishes (inside a backward only)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)
