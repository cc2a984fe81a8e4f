"""Run a function on N gloo (or NCCL) ranks with a hard timeout: the tests' and profilers' harness.

``run_distributed(fn, world_size)`` starts one process per rank (forked for gloo; spawned for NCCL,
since CUDA cannot be initialised in a forked child: ``fn`` must then be importable by name, a
module-level function), initialises ``torch.distributed``
through a file rendezvous (no port races), calls ``fn(rank, world_size, *args, **kwargs)`` and
returns the per-rank results. A rank that raises fails the call with that rank's traceback; a
hang fails it after ``timeout_s`` seconds with every process killed, so a deadlocked collective
costs a test seconds, not the CI budget.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

from megatron.components.parallel import destroy_parallel

__all__ = ["run_distributed", "start_method", "DistributedTestError"]


class DistributedTestError(RuntimeError):
    """A rank failed or the run timed out."""


def _worker(rank, world_size, backend, init_file, fn, args, kwargs, results, num_threads):
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(num_threads)
    try:
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            out = fn(rank, world_size, *args, **kwargs)
        finally:
            destroy_parallel()
            _stop_children()
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including SystemExit from argparse
        results.put((rank, "error", traceback.format_exc()))


def _stop_children():
    """Stop the helper processes a rank started (dist_checkpointing's writer workers): the rank is
    killed once its result is in, and orphans would otherwise live on, holding memory."""
    for child in mp.active_children():
        child.terminate()
    for child in mp.active_children():
        child.join(timeout=5)


def start_method(backend: str) -> str:
    """``spawn`` for NCCL (a forked child cannot initialise CUDA), ``fork`` for gloo (fast)."""
    return "spawn" if backend == "nccl" else "fork"


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args,
    backend: str = "gloo",
    timeout_s: float = 180.0,
    num_threads: int = 1,
    **kwargs,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes.

    ``fn`` and its arguments must be picklable results-wise (the return value is pickled back).
    Returns the list of per-rank return values, indexed by rank.
    """
    ctx = mp.get_context(start_method(backend))
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="rundist-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, backend, init_file, fn, args, kwargs, results, num_threads),
                daemon=False,  # dist_checkpointing saves through worker processes
            )
            for rank in range(world_size)
        ]
        sys.stdout.flush()  # forked ranks would otherwise re-emit the parent's buffered output
        sys.stderr.flush()
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(outputs) + len(errors) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(outputs) - set(errors))
                    raise DistributedTestError(
                        f"timed out after {timeout_s:.0f}s waiting for ranks {missing}"
                        + _format_errors(errors)
                    )
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
                    dead = [r for r in dead if r not in outputs and r not in errors]
                    if dead:
                        # a rank died without reporting (e.g. a segfault); give others a moment
                        time.sleep(0.5)
                        if results.empty():
                            raise DistributedTestError(
                                f"rank(s) {dead} died with exit codes "
                                f"{[procs[r].exitcode for r in dead]}" + _format_errors(errors)
                            )
                    continue
                if status == "ok":
                    outputs[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
                    # peers of a failed rank usually hang in a collective: stop waiting soon
                    deadline = min(deadline, time.monotonic() + 10.0)
            if errors:
                raise DistributedTestError("rank(s) failed" + _format_errors(errors))
        finally:
            if len(outputs) == world_size:  # all reported: let them exit on their own (children reaped)
                exit_by = time.monotonic() + 10.0
                for p in procs:
                    p.join(timeout=max(0.0, exit_by - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
    return [outputs[r] for r in range(world_size)]


def _format_errors(errors: dict[int, str]) -> str:
    if not errors:
        return ""
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
