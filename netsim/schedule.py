"""Two-lane greedy schedule of one decode step (paper §3.3, dual-batch overlap).

A decode step is a chain of ops, each on the compute lane or the communication lane. With
dual-batch overlap (DBO) the batch is split into two micro-batches that run the same chain; every
op starts as soon as its predecessor in the same micro-batch is done and its lane is free (the
earlier-ready op first; ties go to the op earlier in the chain, then to micro-batch 0). The step
time is when the last op finishes; exposed communication is that minus the compute lane's busy time.

``hidden`` models FarSkip-style overlap: an op with ``hidden = f`` holds its lane for its whole
duration but releases its successor after ``(1 - f)`` of it (the successor overlaps the rest).

Two implementations:
* :func:`greedy_schedule_reference`: event-driven list scheduling, scalar, obviously the greedy rule;
* :func:`greedy_schedule`: vectorised over any number of instances. It relies on the chain
  alternating lanes (compute, comm, compute, ...), for which the greedy rule serves each lane in
  the fixed order (mb0, op i), (mb1, op i), (mb0, op i'), ... ; tests check it against the reference.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

__all__ = ["COMPUTE", "COMM", "greedy_schedule", "greedy_schedule_reference", "check_alternating"]

COMPUTE, COMM = 0, 1


def check_alternating(lanes: Sequence[int]) -> None:
    lanes = list(lanes)
    if any(lane not in (COMPUTE, COMM) for lane in lanes):
        raise ValueError("lanes must be COMPUTE (0) or COMM (1)")
    if any(a == b for a, b in zip(lanes, lanes[1:])):
        raise ValueError("the op chain must alternate between the compute and communication lanes "
                         "(merge consecutive ops on the same lane)")  # fmt: skip


def greedy_schedule(
    lanes: Sequence[int],
    durations: Sequence[np.ndarray],
    num_microbatches: int,
    hidden: Sequence[float] | None = None,
) -> np.ndarray:
    """Makespan of ``num_microbatches`` (1 or 2) copies of the chain; vectorised.

    lanes:      ``[n_ops]`` lane of each op (must alternate).
    durations:  ``n_ops`` arrays of one common shape ``S``: each op's time per micro-batch.
    hidden:     ``[n_ops]`` fraction of each op its successor may overlap (default 0).
    Returns the step time, shape ``S``.
    """
    check_alternating(lanes)
    if num_microbatches not in (1, 2):
        raise ValueError(f"num_microbatches must be 1 or 2, got {num_microbatches}")
    hidden = [0.0] * len(lanes) if hidden is None else list(hidden)
    if len(durations) != len(lanes) or len(hidden) != len(lanes):
        raise ValueError("lanes, durations and hidden must have one entry per op")
    shape = np.broadcast_shapes(*(np.shape(d) for d in durations))
    ready = [np.zeros(shape) for _ in range(num_microbatches)]
    free = [np.zeros(shape), np.zeros(shape)]
    end = np.zeros(shape)
    for lane, d, h in zip(lanes, durations, hidden):
        for mb in range(num_microbatches):
            start = np.maximum(ready[mb], free[lane])
            fin = start + d
            free[lane] = fin
            ready[mb] = start + d * (1 - h) if h else fin
            np.maximum(end, fin, out=end)
    return end


def greedy_schedule_reference(
    lanes: Sequence[int], durations: Sequence[float], num_microbatches: int, hidden: Sequence[float] | None = None
) -> float:
    """Scalar event-driven greedy list scheduling of the same problem (any lane pattern)."""
    n = len(lanes)
    hidden = [0.0] * n if hidden is None else list(hidden)
    ptr = [0] * num_microbatches
    ready = [0.0] * num_microbatches
    free = {COMPUTE: 0.0, COMM: 0.0}
    end = 0.0
    while True:
        cands = []
        for mb in range(num_microbatches):
            i = ptr[mb]
            if i < n:
                heapq.heappush(cands, (max(ready[mb], free[lanes[i]]), i, mb))
        if not cands:
            return end
        start, i, mb = cands[0]
        fin = start + float(durations[i])
        free[lanes[i]] = fin
        ready[mb] = start + float(durations[i]) * (1 - hidden[i])
        ptr[mb] += 1
        end = max(end, fin)
