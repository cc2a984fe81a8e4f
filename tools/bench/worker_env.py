"""Helpers every benchmark worker uses: read the spec, join the gloo group the launcher set up.

A worker is ``python -m <module> <spec.json>``; see :mod:`.schema` for the environment contract.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from .schema import WorkerSpec

__all__ = ["read_spec_from_argv", "init_gloo_from_env", "init_from_env", "rank_and_world"]


def read_spec_from_argv(argv: Optional[Sequence[str]] = None) -> WorkerSpec:
    """The :class:`WorkerSpec` whose path is ``argv[1]`` (``sys.argv`` by default)."""
    argv = list(sys.argv if argv is None else argv)
    if len(argv) != 2:
        raise SystemExit(f"usage: python -m <worker module> SPEC.json (got {argv[1:]})")
    return WorkerSpec.read(argv[1])


def rank_and_world() -> tuple[int, int]:
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as e:
        raise SystemExit(f"worker started without {e.args[0]} in the environment (use the launcher)")


def init_gloo_from_env(num_threads: int, timeout_s: float = 300.0):
    """``init_process_group("gloo")`` from the launcher's env; returns the default group."""
    return init_from_env(num_threads, "cpu", timeout_s)


def init_from_env(num_threads: int, device: str = "cpu", timeout_s: float = 300.0):
    """Join the launcher's group: gloo on the CPU, or NCCL on GPU ``LOCAL_RANK`` (``device="cuda"``),
    through the training application's ``init_from_env`` (it selects the rank's GPU before NCCL)."""
    import torch
    import torch.distributed as dist

    from megatron.components.parallel import init_from_env as init_process_group

    torch.set_num_threads(num_threads)
    rank_and_world()  # a clear exit when not started by the launcher
    init_process_group("nccl" if device == "cuda" else "gloo", timeout_minutes=max(1, round(timeout_s / 60)))
    return dist.group.WORLD
