"""Faults that only a rank itself can cause, requested through files: a segfault, an
``abort()``, a Python spin loop, native code holding the GIL, a SIGSTOP to itself, an exception,
and I/O that never returns (every later ``os.fsync``, a checkpoint save's, blocks as on a hung
file system). (``kill -9`` and a SIGSTOP at any instant come from outside: ``tools.faults.launch``.)

``request(directory, rank, kind, at)`` writes ``directory/rank<R>`` holding ``<kind> <at>``; a
rank started through ``tools.faults.rank`` with ``$MEGATRON_FAULT_DIR=directory`` looks for its
file after every step (the loops' ``STEP_END`` events), takes it (renamed away, so that a
restarted job does not repeat it) once its step count reaches ``at``, and the fault happens. A
request ``at=AT_START`` is taken when the rank starts, before it loads anything.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

__all__ = ["KINDS", "ENV", "AT_START", "request", "take", "cause", "Injector"]

ENV = "MEGATRON_FAULT_DIR"
KINDS = ("segfault", "abort", "spin", "gil", "stop", "error", "stuck-io")
AT_START = -1  # the step count of a rank that is starting (``tools.faults.rank``)


def request(directory: str, rank: int, kind: str, at: int = 0) -> str:
    """Ask rank ``rank`` for fault ``kind`` after step ``at`` or later; returns the file written."""
    if kind not in KINDS:
        raise ValueError(f"fault kind {kind!r}: expected one of {', '.join(KINDS)}")
    path = os.path.join(directory, f"rank{rank}")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{kind} {at}\n")
    os.replace(tmp, path)
    return path


def take(directory: str, rank: int, step: int):
    """The fault kind requested for ``rank`` at ``step`` or earlier, taken (None: none)."""
    path = os.path.join(directory, f"rank{rank}")
    try:
        with open(path) as f:
            fields = f.read().split()
    except FileNotFoundError:
        return None
    at = int(fields[1]) if len(fields) > 1 else 0
    if step < at:
        return None
    try:
        os.replace(path, f"{path}.taken-{os.getpid()}")
    except FileNotFoundError:  # taken by an earlier attempt's process
        return None
    return fields[0]


def cause(kind: str, where: str) -> None:
    """Make fault ``kind`` happen in this process (``where`` names it in the exception)."""
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
        raise RuntimeError(f"injected fault on {where}")
    elif kind == "stuck-io":
        def stuck(fd):  # never returns, the GIL released: the watchdog thread goes on
            threading.Event().wait()

        os.fsync = stuck
    else:
        raise ValueError(f"unknown fault kind {kind!r}: expected one of {', '.join(KINDS)}")


class Injector:
    """The ``STEP_END`` subscriber of one rank: after step ``step``, cause the fault requested
    for this rank in ``directory``, if any (module docstring)."""

    def __init__(self, directory: str, rank: int):
        self.directory = directory
        self.rank = rank

    def __call__(self, step: int) -> None:
        kind = take(self.directory, self.rank, step)
        if kind is None:
            return
        print(f"[rank {self.rank}] injecting fault {kind!r} after step {step} at {time.time():.3f}", flush=True)
        cause(kind, f"rank {self.rank} at step {step}")
