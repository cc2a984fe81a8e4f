"""Run megatron-core's CUDA-only code paths on CPU by redirecting CUDA devices to the CPU.

megatron-core 0.16.1 allocates with ``device="cuda"`` / ``torch.cuda.current_device()``, calls
``.cuda()``, creates ``torch.cuda.Stream``/``Event`` objects and validates parameters by type
string (``'torch.cuda.FloatTensor'``) across its DDP, optimizers, schedules, tensor-parallel
mappings, RoPE and memory buffers (every site is listed in ``megatron/compat/sites.py``). Patching
each site would mean forking dozens of functions; instead one ``TorchFunctionMode`` rewrites those
requests to the CPU and a handful of ``torch.cuda`` entry points get CPU stand-ins. This is only
installed when CUDA is unavailable: on GPU machines the real CUDA code runs untouched.

What the mode does, and only this:
- a ``device=`` keyword (or ``Tensor.to`` positional device) naming CUDA or a bare device index
  becomes ``cpu``; ``pin_memory=True`` becomes ``False`` (pinning needs CUDA);
- ``Tensor.cuda()``, ``Tensor.pin_memory()`` return the tensor; ``Tensor.record_stream`` is a no-op;
- ``Tensor.type()`` without arguments reports ``torch.cuda.<T>`` for CPU tensors, because
  megatron-core's optimizers accept only those strings (``optimizer.py:671-699``,
  ``distrib_optimizer.py:361-435``, ``clip_grads.py:167``); ``Tensor.type('torch.cuda.<T>')`` converts
  to ``torch.<T>``.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_CPU = torch.device("cpu")


class CpuDeviceMode(TorchFunctionMode):
    """Redirects CUDA device requests to the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type:
            return _tensor_type(args, kwargs)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=_CPU)
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _tensor_type(args, kwargs):
    tensor = args[0]
    dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
    if dtype is None:
        name = torch.Tensor.type(tensor)
        if tensor.device.type == "cpu" and name.startswith("torch."):
            return "torch.cuda." + name[len("torch.") :]
        return name
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = "torch." + dtype[len("torch.cuda.") :]
    return torch.Tensor.type(tensor, dtype, *args[2:], **{k: v for k, v in kwargs.items() if k != "dtype"})


class CpuStream:
    """Stand-in for ``torch.cuda.Stream``: CPU work is already ordered on the calling thread."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else CpuEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class CpuEvent:
    """Stand-in for ``torch.cuda.Event``: completes immediately. ``record`` takes a host timestamp
    so that ``elapsed_time`` works (megatron-core's inference engines time their steps with
    ``start.elapsed_time(end)``, ``dynamic_engine.py:1199``, ``text_generation_controller.py:1361``);
    CPU work is synchronous, so the host clock is the device clock."""

    def __init__(self, *args, **kwargs):
        self._time_s = None

    def record(self, stream=None):
        self._time_s = time.perf_counter()

    def elapsed_time(self, end_event) -> float:
        """Milliseconds from this event's ``record`` to ``end_event``'s (CUDA's unit)."""
        if self._time_s is None or end_event._time_s is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end_event._time_s - self._time_s) * 1e3

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_DEFAULT_STREAM = CpuStream()


def _cuda_shims() -> dict:
    """``torch.cuda`` attributes replaced on CPU-only machines (name -> replacement)."""
    return {
        # a device, not an index: the backward pass runs with the mode switched off (a mode is
        # inactive while its handler executes ``Tensor.backward``), and megatron-core's backward
        # functions allocate with ``device=torch.cuda.current_device()``
        "current_device": lambda: _CPU,
        "set_device": lambda device: None,
        "Stream": CpuStream,
        "Event": CpuEvent,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
    }


def _nvtx_shims() -> dict:
    """``torch.cuda.nvtx`` functions replaced on CPU-only machines: a CPU build of torch raises
    "NVTX functions not installed" on every call, and megatron-core's inference engine and request
    serialisation mark their ranges with them (``inference_request.py:26``, ``:221``)."""
    return {
        "range_push": lambda msg: None,
        "range_pop": lambda: None,
        "range": lambda msg, *args, **kwargs: contextlib.nullcontext(),
        "mark": lambda msg: None,
    }


_lock = threading.Lock()
_state: dict = {"mode": None, "saved": None}


def install() -> bool:
    """Install the mode and ``torch.cuda`` stand-ins for this process. Idempotent.

    Returns True if installed now, False if already installed.
    """
    with _lock:
        if _state["mode"] is not None:
            return False
        if torch.cuda.is_available():
            raise RuntimeError("the CPU device redirect must not be installed when CUDA is available")
        shims = _cuda_shims()
        nvtx = _nvtx_shims()
        _state["saved"] = {name: getattr(torch.cuda, name) for name in shims}
        _state["saved_nvtx"] = {name: getattr(torch.cuda.nvtx, name) for name in nvtx}
        for name, value in shims.items():
            setattr(torch.cuda, name, value)
        for name, value in nvtx.items():
            setattr(torch.cuda.nvtx, name, value)
        mode = CpuDeviceMode()
        mode.__enter__()
        _state["mode"] = mode
        return True


def is_installed() -> bool:
    return _state["mode"] is not None
