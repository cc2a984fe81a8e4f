"""Deferred expert weight gradients: fill the backward all-to-alls' windows.

In an expert-parallel backward the routed experts' backward sits between two gradient
all-to-alls: the combine's gradient must arrive before it runs, and the dispatch's gradient can
be sent only when it is done. Only its *input* gradient is on that path; its *weight* gradient
is needed by the optimizer alone. With deferral the expert linears return the input gradient at
once and queue the weight gradient (so does the output layer, whose backward runs before the
first gradient all-to-all: its weight gradient then fills that collective's window). The queue
runs while a later gradient all-to-all is in flight (``run_while``, called by the all-to-all's
wait hook before it blocks), and whatever is left runs when the backward pass ends (an autograd
engine callback), before gradient synchronisation and the optimizer. Work queued by a backward
that raised is dropped when the next backward queues, never added to its gradients. The same idea
as megatron-core's ``delay_wgrad_compute`` for Transformer Engine's grouped GEMM and DeepSeek's
DualPipe, for the project's expert modules: the local ``SequentialMLP`` linears (wrapped here) and
``GroupedExperts`` (``experts.py``), whose grouped GEMM queues its weight gradient ``dy^T x`` per
expert through ``queue`` when its ``defer_wgrad`` is on.

Gradients are the same values as without deferral (the same matmul, accumulated into
``main_grad`` as megatron-core's DDP hook would, or into ``.grad`` without DDP); only when they
are computed changes. With ``gradient_accumulation_fusion`` the deferred gradient is accumulated
into ``main_grad`` too (what the fused kernel does, unfused).

Not compatible with megatron-core DDP's ``overlap_grad_reduce``: its backward hook
(``distributed/distributed_data_parallel.py:433-446``) asserts the weight's gradient exists when
the hook fires and starts a bucket's reduction once every parameter of the bucket has fired, so a
deferred weight gradient would arrive after its bucket was reduced (or, without a gradient, the
bucket is never launched: ``param_and_grad_buffer.py:531``). ``disable(model)`` turns the deferral
off for a model (the training loop does, with a warning, when that overlap is on).
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

import torch

from megatron.compat.autograd import current_graph_task_id, queue_engine_callback

from megatron.compat.linear import wrap_local_linear

__all__ = ["accumulate", "defer_expert_wgrad", "defer_wgrad", "disable", "flush", "is_deferred", "pending", "queue",
           "run_while"]

DEFERRED = "deferred-wgrad"
_EAGER = "_deferred_wgrad_off"  # attribute set on the weight of a linear whose deferral is disabled

_QUEUE: collections.deque = collections.deque()
_GRAPH_TASK: Optional[int] = None  # the backward pass whose end flushes the queue


def pending() -> int:
    """Weight gradients queued and not yet computed."""
    return len(_QUEUE)


def queue(task: Callable[[], None]) -> None:
    """Queue a weight-gradient computation from inside a backward pass (it runs in a later
    collective's window or when this backward ends)."""
    global _GRAPH_TASK
    current = current_graph_task_id()
    if current != _GRAPH_TASK:  # the first of this backward pass: make sure it ends with a flush
        _QUEUE.clear()  # left by a backward that raised before its end: not this pass's gradients
        queue_engine_callback(flush)
        _GRAPH_TASK = current
    _QUEUE.append(task)


def run_while(busy: Callable[[], bool]) -> None:
    """Compute queued weight gradients, oldest first, while ``busy()`` (a collective in flight)."""
    while _QUEUE and busy():
        _QUEUE.popleft()()


def flush() -> None:
    """Compute every queued weight gradient (the end-of-backward callback)."""
    global _GRAPH_TASK
    while _QUEUE:
        _QUEUE.popleft()()
    _GRAPH_TASK = None


def accumulate(weight: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Add a weight gradient where autograd or megatron-core DDP's hook would have put it."""
    if getattr(weight, "main_grad", None) is not None:  # megatron-core DDP's buffer
        weight.main_grad.add_(grad)
    elif weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad


class _DeferredWgradLinear(torch.autograd.Function):
    """``input @ weight.t()`` (megatron-core's local linear, TP = 1, no bias) whose backward
    returns the input gradient and queues the weight gradient."""

    @staticmethod
    def forward(ctx, inp, weight):
        ctx.save_for_backward(inp, weight)
        return torch.matmul(inp, weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)

        def wgrad():
            g = grad_output.reshape(-1, grad_output.shape[-1])
            x = inp.reshape(-1, inp.shape[-1])
            accumulate(weight, g.t().matmul(x))

        queue(wgrad)
        return grad_input, None


def _deferred_forward_impl(original):
    def forward_impl(input, weight, *args, bias=None, allreduce_dgrad=False, sequence_parallel=False,
                     gradient_accumulation_fusion=False, **kwargs):
        if (not weight.requires_grad or bias is not None or allreduce_dgrad or sequence_parallel
                or args or kwargs.get("grad_output_buffer") is not None or getattr(weight, _EAGER, False)):
            return original(input, weight, *args, bias=bias, allreduce_dgrad=allreduce_dgrad,
                            sequence_parallel=sequence_parallel,
                            gradient_accumulation_fusion=gradient_accumulation_fusion, **kwargs)
        return _DeferredWgradLinear.apply(input, weight)

    return forward_impl


def defer_wgrad(linear) -> bool:
    """Make one megatron-core local linear (``ColumnParallelLinear``/``RowParallelLinear``) defer
    its weight gradient; False if it has no local forward to wrap or already defers."""
    return wrap_local_linear(linear, _deferred_forward_impl, DEFERRED)


def is_deferred(module) -> bool:
    """True if ``module`` defers its weight gradients: a wrapped local linear (not disabled), or
    grouped-GEMM experts with ``defer_wgrad`` on."""
    if hasattr(module, "defer_wgrad"):
        return bool(module.defer_wgrad)
    return DEFERRED in getattr(module, "_compat_linear_wraps", ()) and not getattr(module.weight, _EAGER, False)


def disable(model) -> int:
    """Compute the weight gradients of every deferring module of ``model`` in the backward again;
    returns how many were deferring."""
    count = 0
    for module in model.modules():
        if is_deferred(module):
            if hasattr(module, "defer_wgrad"):
                module.defer_wgrad = False
            else:
                setattr(module.weight, _EAGER, True)
            count += 1
    return count


def defer_expert_wgrad(moe_layer) -> int:
    """Make the routed experts of ``moe_layer`` (a megatron-core ``MoELayer``) defer their weight
    gradients; returns how many modules were switched: the ``GroupedExperts`` module (one for all
    experts), or each local linear of ``SequentialMLP`` experts.

    Linears that need tensor-parallel communication, a bias or fused accumulation keep
    megatron-core's path (per call, so nothing changes for them). Transformer Engine's grouped
    experts are left alone: they have no local ``_forward_impl``, and megatron-core's own
    ``delay_wgrad_compute`` for them (TE's ``GroupedLinear.backward_dw``) is accepted by its config
    only together with ``overlap_moe_expert_parallel_comm`` (``transformer_config.py:1909-1912``,
    its combined 1F1B schedule), and it would apply to every TE linear sharing the config. So on
    the TE path the expert weight gradients are computed in the backward as usual.
    """
    experts = getattr(moe_layer, "experts", None)
    if hasattr(experts, "defer_wgrad"):
        if experts.defer_wgrad:
            return 0
        experts.defer_wgrad = True
        return 1
    switched = 0
    for expert in getattr(experts, "local_experts", []):
        for name in ("linear_fc1", "linear_fc2"):
            switched += defer_wgrad(getattr(expert, name, None))
    return switched
