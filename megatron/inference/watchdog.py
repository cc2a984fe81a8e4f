"""Liveness of the serving loop: its heartbeat, what ``/health`` reads, and the watchdog thread
that ends a stuck rank. The mechanism is ``megatron.common.watchdog``; this module sets its
serving limits.

Every loop iteration ends an all-gather over all ranks, so a completed iteration proves every
rank arrived: the loop ticks its ``Heartbeat`` there (the idle loop ticks too, every
``idle_wait_s``). A stopped (SIGSTOP), hung or deadlocked rank freezes every other rank inside a
collective, which cannot be cancelled. ``/health`` answers 503 once the heartbeat is older than
``--stall-timeout`` (``health_deadline``); the watchdog thread (``start_watchdog``) calls
``on_stall`` once it is older than ``--watchdog-timeout`` (rank 0: fail every in-flight request,
then exit; the other ranks: exit). It arms at the first tick: before it, the ranks may still be
loading the model at different speeds.

Exit codes of a server process (``megatron.common.process``, docs/serving.md): 0 after a clean
drain, 1 when the engine loop raised (a rank died, a collective failed, a bug), 2 for bad flags or
checkpoints (one line), 3 when the watchdog fired.
"""

from __future__ import annotations

from typing import Callable, Optional

from megatron.common.watchdog import Deadline, Heartbeat, Watchdog

__all__ = ["health_deadline", "start_watchdog"]


def health_deadline(stall_timeout_s: float) -> Deadline:
    """How long the heartbeat may stay still before ``/health`` answers 503 (stalled)."""
    return Deadline(stall_timeout_s)


def start_watchdog(heartbeat: Heartbeat, timeout_s: float, on_stall: Callable[[float], None]) -> Optional[Watchdog]:
    """A thread that calls ``on_stall(age_s)`` once the heartbeat, armed, has not ticked for
    ``timeout_s`` seconds (None when ``timeout_s`` is 0)."""
    if timeout_s <= 0:
        return None
    deadline = Deadline(timeout_s)

    def check() -> bool:
        pulse = heartbeat.pulse()
        if not deadline.overdue(pulse):
            return False
        on_stall(pulse.age_s)
        return True

    return Watchdog(check, min(0.5, timeout_s / 10), name="serve-watchdog").start()
