"""Fault injection for the fault and chaos scripts: faults that only the rank itself can cause.

``kill -9`` and ``SIGSTOP`` come from outside (``scripts/fault_check.sh``); a segfault, an
``abort()``, a Python spin loop or a rank stuck in native code holding the GIL need the rank's
own hand. With ``$MEGATRON_FAULT_DIR`` set, the training loop calls ``inject(rank, iteration)``
after each step; a file ``$MEGATRON_FAULT_DIR/rank<R>`` holding ``<kind> [<iteration>]`` is taken
(renamed away, so a restarted job does not repeat it) by rank R at that iteration or later, and
the fault happens. Without the variable the check is one environment lookup per step.

Kinds: ``segfault`` (a read of address 0), ``abort`` (``os.abort()``), ``spin`` (a Python loop
forever), ``gil`` (a native ``sleep`` that keeps the GIL), ``stop`` (SIGSTOP to itself),
``error`` (a RuntimeError on this rank only).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

__all__ = ["KINDS", "ENV", "inject", "request"]

ENV = "MEGATRON_FAULT_DIR"
KINDS = ("segfault", "abort", "spin", "gil", "stop", "error")


def request(directory: str, rank: int, kind: str, iteration: int = 0) -> str:
    """Ask rank ``rank`` for fault ``kind`` at ``iteration`` or later; returns the file written."""
    if kind not in KINDS:
        raise ValueError(f"fault kind {kind!r}: expected one of {', '.join(KINDS)}")
    path = os.path.join(directory, f"rank{rank}")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{kind} {iteration}\n")
    os.replace(tmp, path)
    return path


def _take(rank: int, iteration: int):
    directory = os.environ.get(ENV)
    if not directory:
        return None
    path = os.path.join(directory, f"rank{rank}")
    try:
        with open(path) as f:
            fields = f.read().split()
    except FileNotFoundError:
        return None
    at = int(fields[1]) if len(fields) > 1 else 0
    if iteration < at:
        return None
    try:
        os.replace(path, f"{path}.taken-{os.getpid()}")
    except FileNotFoundError:  # taken by an earlier attempt's process
        return None
    return fields[0]


def inject(rank: int, iteration: int) -> None:
    """Cause the fault requested for this rank, if any (module docstring)."""
    kind = _take(rank, iteration)
    if kind is None:
        return
    print(f"[rank {rank}] injecting fault {kind!r} after iteration {iteration} at {time.time():.3f}", flush=True)
    if kind == "segfault":
        ctypes.string_at(0)
    elif kind == "abort":
        os.abort()
    elif kind == "spin":
        while True:
            pass
    elif kind == "gil":
        ctypes.PyDLL(None).sleep(10**6)  # PyDLL keeps the GIL for the call's whole duration
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(0)
    elif kind == "error":
        raise RuntimeError(f"injected fault on rank {rank} at iteration {iteration}")
    else:
        raise ValueError(f"{os.environ[ENV]}/rank{rank}: unknown fault kind {kind!r}")
