"""Helpers every benchmark worker uses: read the spec, join the gloo group the launcher set up.

A worker is ``python -m <module> <spec.json>``; see :mod:`.schema` for the environment contract.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Optional, Sequence

from .schema import WorkerSpec

__all__ = ["read_spec_from_argv", "init_gloo_from_env", "rank_and_world"]


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
    import torch
    import torch.distributed as dist

    torch.set_num_threads(num_threads)
    rank, world = rank_and_world()
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return dist.group.WORLD
