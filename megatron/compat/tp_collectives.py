"""Count the tensor-parallel collectives megatron-core issues, for profiles of served steps.

megatron-core's tensor-parallel layers reduce and gather through ``tensor_parallel/mappings.py``:
``torch.distributed.all_reduce`` (row-parallel outputs, the vocabulary-parallel embedding) and the
module's ``dist_all_gather_func`` / ``dist_reduce_scatter_func`` (bound at import to
``all_gather_into_tensor`` / ``reduce_scatter_tensor``: the output layer's logits). No counter sees
them (the expert all-to-alls have ``moe_variants.common.moe_layer.comm_counters``), so
``GroupCollectives`` wraps those three entry points for as long as it is entered and records, for
calls on one process group, each call's op, tensor bytes, start and end (``perf_counter``): a TP
engine's step spans (``megatron.inference.observability.SpanRecorder``), from which
``tools.profile.serving_compute`` takes what a step's TP collectives send and how long they took
on loopback (not compute). Calls on other groups pass through uncounted. The upstream code it depends on
is pinned in ``sites.TP_COLLECTIVE_SITES``.
"""

from __future__ import annotations

import time

import torch

__all__ = ["GroupCollectives"]


class GroupCollectives:
    """``with GroupCollectives(group) as c: ...``: ``c.calls`` is ``[(op, bytes, start, end)]`` for
    every all-reduce, all-gather and reduce-scatter on ``group`` (bytes of the input tensor; an
    asynchronous call's end is its launch's). ``take()`` returns and clears them."""

    def __init__(self, group):
        self.group = group
        self.calls: list = []
        self._saved: list = []

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls

    def _wrap(self, op: str, fn, tensor_arg: int):
        def call(*args, **kwargs):
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            if group is not self.group:
                return fn(*args, **kwargs)
            tensor = args[tensor_arg]
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls.append((op, tensor.numel() * tensor.element_size(), t0, time.perf_counter()))
        return call

    def __enter__(self) -> GroupCollectives:
        from megatron.core.tensor_parallel import mappings

        for owner, name, op, tensor_arg in ((torch.distributed, "all_reduce", "all_reduce", 0),
                                            (mappings, "dist_all_gather_func", "all_gather", 1),
                                            (mappings, "dist_reduce_scatter_func", "reduce_scatter", 1)):
            fn = getattr(owner, name)
            self._saved.append((owner, name, fn))
            setattr(owner, name, self._wrap(op, fn, tensor_arg))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved = []
