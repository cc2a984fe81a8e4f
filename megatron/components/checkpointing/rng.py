"""The RNG state saved per rank: python's, numpy's, torch's and CUDA's generators and, when it has
any, megatron-core's CUDA RNG tracker states (the tensor/expert-parallel streams dropout under TP/EP
draws from)."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def _tracker_states() -> dict:
    """``{name: state}`` of megatron-core's CUDA RNG tracker (the tensor-parallel, data-parallel and
    expert-parallel streams that dropout inside TP/EP regions draws from). Empty on CPU, where
    ``parallel.set_seed`` installs the inference tracker, which holds none. A graph-safe tracker's
    generators are stored as their state tensors."""
    from megatron.core import tensor_parallel

    states = {}
    for name, value in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        if isinstance(value, torch.Generator):
            value = value.get_state()
        if isinstance(value, torch.Tensor):
            states[name] = value.detach().cpu().clone()
    return states


def _set_tracker_states(saved: dict) -> None:
    """Restore ``_tracker_states`` into the tracker (generators of a graph-safe tracker in place)."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    states = dict(current)
    for name, value in saved.items():
        if isinstance(current.get(name), torch.Generator):
            current[name].set_state(value)
        else:
            states[name] = value
    tracker.set_states(states)


def rng_state() -> dict:
    """This rank's generators' states."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = _tracker_states()
    if tracker:
        state["cuda_tracker"] = tracker
    return state


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state``'s states into this rank's generators."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("cuda_tracker"):
        _set_tracker_states(state["cuda_tracker"])
