"""Count device-to-host synchronisations: on the CPU by the calls that would sync on a GPU, on a
GPU with CUDA's own sync debug mode.

A GPU step that waits for the device (``.item()``, a split size read on the host, an op whose
output size depends on the data) stalls the launch queue; counting them per MoE layer is how the
expert path is held to its budget (``tests/experts/test_host_syncs.py``, the GPU benchmark).

- ``HostSyncCounter`` (any device) is a ``TorchFunctionMode`` that records every call a GPU would
  have to wait for: reading values on the host (``item``, ``tolist``, ``numpy``, ``cpu``,
  ``.to("cpu")``, ``bool``/``int``/``float``/``index`` of a tensor) and ops whose output size
  depends on the values (``nonzero``, ``argwhere``, ``masked_select``, ``unique``,
  ``unique_consecutive``, ``bincount``, one-argument ``where``, ``repeat_interleave`` by a tensor
  without ``output_size``, indexing or assigning with a boolean mask). It sees Python-level torch
  calls (ours and megatron-core's), not those inside C++ kernels or autograd formulas, and only
  on the thread that entered it (the CPU runs the backward there). ``.to(device)`` with a device
  object is taken as a device-generic move (host to device on a GPU) and not counted.
- ``count_cuda_syncs`` runs a function under ``torch.cuda.set_sync_debug_mode("warn")`` and counts
  the warnings CUDA's runtime checks raise: every real synchronisation, wherever it comes from.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostSyncCounter", "count_cuda_syncs"]

_T = torch.Tensor
_READS = {_T.item: "item", _T.tolist: "tolist", _T.numpy: "numpy", _T.cpu: "cpu", _T.__bool__: "bool",
          _T.__int__: "int", _T.__float__: "float", _T.__index__: "index"}
_SIZED_BY_DATA = {torch.nonzero: "nonzero", _T.nonzero: "nonzero", torch.argwhere: "argwhere",
                  _T.argwhere: "argwhere", torch.masked_select: "masked_select", _T.masked_select: "masked_select",
                  torch.unique: "unique", _T.unique: "unique", torch.unique_consecutive: "unique_consecutive",
                  _T.unique_consecutive: "unique_consecutive", torch.bincount: "bincount", _T.bincount: "bincount"}
_TORCH_DIR = os.path.dirname(torch.__file__)


def _is_cpu_target(value) -> bool:
    return isinstance(value, str) and value.split(":")[0] == "cpu"


def _has_bool_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _reason(func, args, kwargs):
    """The name of the sync ``func(*args, **kwargs)`` would cause on a GPU, or None."""
    if func in _READS:
        return _READS[func]
    if func in _SIZED_BY_DATA:
        return _SIZED_BY_DATA[func]
    if func is _T.to:
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return "to(cpu)" if _is_cpu_target(target) else None
    if func in (_T.__getitem__, _T.__setitem__) and len(args) > 1 and _has_bool_mask(args[1]):
        return "boolean-mask indexing"
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "where(condition)"
    if func in (torch.repeat_interleave, _T.repeat_interleave) and kwargs.get("output_size") is None:
        repeats = kwargs.get("repeats", args[1] if len(args) > 1 else args[0])
        return "repeat_interleave" if torch.is_tensor(repeats) else None
    return None


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as syncs: ...`` records ``syncs.calls``: ``(what, file:line)`` of
    every call that would wait for a GPU (module docstring); ``syncs.count`` is their number."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _reason(func, args, kwargs)
        if what is not None:
            self.calls.append((what, _caller()))
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        return len(self.calls)


def count_cuda_syncs(fn: Callable[[], object]) -> tuple[int, list[str]]:
    """Run ``fn`` under CUDA's sync debug mode; ``(number of synchronising CUDA calls, their
    messages)``. The autograd engine replays its worker threads' warnings on the caller, so a
    backward inside ``fn`` is counted too."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    # one warning per synchronising call ("called a synchronizing CUDA operation"); enabling the
    # mode itself warns that it is a prototype, which is not a sync
    messages = [str(w.message).splitlines()[0] for w in caught
                if "synchroniz" in str(w.message) and "prototype" not in str(w.message)]
    return len(messages), messages
