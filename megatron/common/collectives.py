"""torch.distributed collectives that put tensors on the process group's device.

NCCL takes CUDA tensors only and gloo CPU tensors (CUDA for a few ops), so a collective on a host
tensor (a loss, a count, a flag) raises on a GPU cluster's NCCL default group, and one on a CUDA
tensor is slow or unsupported over gloo. Every collective a project module issues goes through
this module (``tests/architecture/test_collectives.py`` fails on any other call): a tensor that is
not on its group's device is copied there for the collective and the result copied back into it,
so call sites keep torch's in-place semantics and never move tensors by hand. A tensor already on
the right device (the model's activations on the hot path) is used as it is, at no cost.

``barrier`` is wrapped too: on NCCL it passes the current device (torch otherwise guesses one from
the rank and warns). Object collectives (``all_gather_object``, ``broadcast_object_list``,
``gather_object``) pick their device inside torch; they are forwarded here so that the rule "no
direct torch.distributed collective" has no exceptions.

``agreed(fn)`` runs a step that can fail on one rank alone (rank 0 writing the outputs, a check of
a rank's own files) and agrees on its outcome before any rank goes on: a failing rank never leaves
the others waiting in a later collective, to die with the transport's "connection closed by
peer" instead of the real error.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "group_device",
    "all_reduce",
    "all_reduce_async",
    "all_reduce_autograd",
    "all_gather",
    "all_gather_cat",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "barrier",
    "observe_all_to_all_single",
    "agreed",
    "PeerFailed",
    "ReduceOp",
    "gather",
]

ReduceOp = dist.ReduceOp


def group_device(group=None) -> Optional[torch.device]:
    """The device ``group``'s collectives take tensors on: the current CUDA device for NCCL, the
    CPU for gloo; ``None`` for a group with a backend per device type (``cpu:gloo,cuda:nccl``),
    which takes tensors where they are."""
    backend = str(dist.get_backend(group)).lower()
    if "," in backend or ":" in backend:
        return None
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_group(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` itself if it is on the group's device, else a contiguous copy there."""
    device = group_device(group)
    if device is None or tensor.device == device:
        return tensor
    return tensor.to(device)


def _check_async(moved: bool, name: str, async_op: bool) -> None:
    if async_op and moved:
        raise ValueError(f"{name}: async_op needs tensors on the group's device (no copy-back after the wait)")


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` (any device); returns ``tensor``."""
    moved = _to_group(tensor, group)
    dist.all_reduce(moved, op=op, group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_reduce_async(tensor: torch.Tensor, op=ReduceOp.SUM, group=None):
    """Start an in-place all-reduce of ``tensor`` (already on the group's device); returns the work."""
    _check_async(_to_group(tensor, group) is not tensor, "all_reduce_async", True)
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


def all_reduce_autograd(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """Differentiable all-reduce (``torch.distributed.nn.functional.all_reduce``: the backward
    all-reduces the gradient); returns a new tensor on ``tensor``'s device."""
    from torch.distributed.nn import functional as dist_nn

    moved = _to_group(tensor, group)
    out = dist_nn.all_reduce(moved, op=op, group=group)
    return out if moved is tensor else out.to(tensor.device)


def all_gather(tensor_list: list, tensor: torch.Tensor, group=None) -> list:
    """``tensor_list[r] = tensor of rank r`` (shapes equal on every rank); returns ``tensor_list``."""
    moved = _to_group(tensor, group).contiguous()
    parts = [t if t.device == moved.device and t.is_contiguous() else torch.empty_like(moved) for t in tensor_list]
    dist.all_gather(parts, moved, group=group)
    for dst, src in zip(tensor_list, parts):
        if dst is not src:
            dst.copy_(src)
    return tensor_list


def all_gather_cat(tensor: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order (same shapes everywhere)."""
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world)]
    all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    """``output`` [world * n, ...] = ranks' ``tensor`` [n, ...] stacked along dim 0."""
    out = _to_group(output, group)
    inp = _to_group(tensor, group)
    _check_async(out is not output or inp is not tensor, "all_gather_into_tensor", async_op)
    work = dist.all_gather_into_tensor(out, inp.contiguous(), group=group, async_op=async_op)
    if out is not output:
        output.copy_(out)
    return work


def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """``output`` [n, ...] = this rank's slice of the sum over ranks of ``tensor`` [world * n, ...]."""
    out = _to_group(output, group)
    inp = _to_group(tensor, group)
    _check_async(out is not output or inp is not tensor, "reduce_scatter_tensor", async_op)
    work = dist.reduce_scatter_tensor(out, inp.contiguous(), op=op, group=group, async_op=async_op)
    if out is not output:
        output.copy_(out)
    return work


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None, async_op: bool = False):
    """``torch.distributed.all_to_all_single``; with ``async_op`` both tensors must already be on
    the group's device (the expert-parallel path: activations live there)."""
    out = _to_group(output, group)
    inp = _to_group(tensor, group)
    _check_async(out is not output or inp is not tensor, "all_to_all_single", async_op)
    work = dist.all_to_all_single(
        out, inp, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
        group=group, async_op=async_op,
    )
    if out is not output:
        output.copy_(out)
    return work


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In-place broadcast from global rank ``src``; returns ``tensor``."""
    moved = _to_group(tensor, group)
    dist.broadcast(moved, src=src, group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def gather(tensor: torch.Tensor, gather_list: Optional[list] = None, dst: int = 0, group=None) -> Optional[list]:
    """On global rank ``dst``, ``gather_list[r]`` = rank r's ``tensor`` (same shapes everywhere;
    ``gather_list`` None elsewhere); returns ``gather_list``."""
    moved = _to_group(tensor, group).contiguous()
    parts = None
    if gather_list is not None:
        parts = [t if t.device == moved.device and t.is_contiguous() else torch.empty_like(moved) for t in gather_list]
    dist.gather(moved, parts, dst=dst, group=group)
    if gather_list is not None:
        for out, src in zip(gather_list, parts):
            if out is not src:
                out.copy_(src)
    return gather_list


def all_gather_object(object_list: list, obj: Any, group=None) -> list:
    """``object_list[r]`` = rank r's picklable ``obj``; returns ``object_list``."""
    dist.all_gather_object(object_list, obj, group=group)
    return object_list


def broadcast_object_list(object_list: list, src: int = 0, group=None) -> list:
    """Fill ``object_list`` on every rank with global rank ``src``'s entries; returns it."""
    dist.broadcast_object_list(object_list, src=src, group=group)
    return object_list


def gather_object(obj: Any, object_gather_list: Optional[list] = None, dst: int = 0, group=None):
    """On global rank ``dst``, ``object_gather_list[r]`` = rank r's ``obj`` (None elsewhere)."""
    dist.gather_object(obj, object_gather_list, dst=dst, group=group)
    return object_gather_list


def barrier(group=None) -> None:
    """Block until every rank of ``group`` arrives (on NCCL, on the current device)."""
    if group_device(group) is not None and group_device(group).type == "cuda":
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


class PeerFailed(RuntimeError):
    """Another rank failed in a step the ranks agreed on (``agreed``): not bad input, a bug there,
    whose traceback is in that rank's output."""


def agreed(fn: Callable[[], Any], *, src: Optional[int] = None, group=None) -> Any:
    """``fn()`` on every rank of ``group`` (on its rank ``src`` only, when given), its outcome agreed
    before any rank goes on (collective). Returns the rank's own result (with ``src``: rank
    ``src``'s, which must be picklable). A ``UserError`` on any rank is a ``UserError`` on every
    rank, the lowest failing rank's (its rank named when it is not rank 0), so that the command's
    one ``error:`` line, which rank 0 prints (``cli.run_cli``), is never lost. Any other exception
    keeps its traceback on the rank that raised it; the others raise ``PeerFailed`` naming it."""
    from megatron.common.cli import UserError, one_line

    rank = dist.get_rank(group)
    result, error, outcome = None, None, ("ok", None)
    if src is None or rank == src:
        try:
            result = fn()
            outcome = ("ok", result if src is not None else None)
        except UserError as e:
            error, outcome = e, ("user", one_line(e))
        except Exception as e:  # a bug: its traceback stays here
            error, outcome = e, ("bug", f"{type(e).__name__}: {one_line(e)}")
    every = all_gather_object([None] * dist.get_world_size(group), outcome, group=group)
    if error is not None:
        if isinstance(error, UserError):
            error.agreed = True  # rank 0 raises it too and reports it
        raise error
    bugs = [(r, text) for r, (status, text) in enumerate(every) if status == "bug"]
    if bugs:
        r, text = bugs[0]
        raise PeerFailed(f"rank {r} failed ({text}); its traceback is in its output")
    users = [(r, text) for r, (status, text) in enumerate(every) if status == "user"]
    if users:
        r, text = users[0]
        shared = UserError(text if r == 0 else f"{text} (rank {r})")
        shared.agreed = True
        raise shared
    return result if src is None else every[src][1]



def observe_all_to_all_single(callback: Callable[[torch.Tensor, Optional[Sequence[int]], Any], None]):
    """Call ``callback(input, input_split_sizes, group)`` before every ``torch.distributed.all_to_all_single``
    of this process, third-party code's included (megatron-core's own token dispatcher, which does not
    come through this module: the EP benchmark counts the bytes of its upstream peers with it).
    Returns a function that removes the observer."""
    original = dist.all_to_all_single

    def observed(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        callback(input, input_split_sizes, group)
        return original(output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                        group=group, async_op=async_op)  # fmt: skip

    dist.all_to_all_single = observed

    def remove() -> None:
        dist.all_to_all_single = original

    return remove
