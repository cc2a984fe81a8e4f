"""Liveness of the serving loop: its heartbeat, what ``/health`` reads, and the watchdog thread
that ends a stuck rank. The mechanism is ``megatron.common.watchdog``; this module sets its
serving limits.

The loop ticks its ``Heartbeat`` when an iteration's all-gather completes (every rank arrived;
the idle loop ticks every ``idle_wait_s``) and when an engine step starts and ends. A stopped
(SIGSTOP), hung or deadlocked rank freezes every other rank inside a collective, which cannot be
cancelled. ``/health`` answers 503 once the heartbeat has been still for longer than
``--stall-timeout`` (``health_deadline``); the ``StallWatchdog`` thread calls ``on_stall`` once
it has been still for longer than ``--watchdog-timeout`` (rank 0: fail every in-flight request,
then exit; the other ranks: exit). Both limits grow with the longest interval seen, in practice
the slowest engine step (5x and 10x it: the watchdog keeps waiting twice as long as ``/health``,
as the defaults do), so a model whose steps are slow but steady is neither reported stalled nor
killed, while a step stuck far past its peers still is. The watchdog arms at the first tick:
before it, the ranks may still be loading the model at different speeds.

Exit codes of a server process (``megatron.common.process``, docs/design/serving.md): 0 after a clean
drain, 1 when the engine loop raised (a rank died, a collective failed, a bug), 2 for bad flags or
checkpoints (one line), 3 when the watchdog fired.
"""

from __future__ import annotations

from typing import Callable, Optional

from megatron.common.watchdog import Deadline, Heartbeat, Watchdog

__all__ = ["STALL_GROWTH", "WATCHDOG_GROWTH", "health_deadline", "limit_text", "StallWatchdog"]

STALL_GROWTH = 5  # /health's limit grows to this many times the longest interval seen
WATCHDOG_GROWTH = 10  # the watchdog's


def health_deadline(stall_timeout_s: float) -> Deadline:
    """How long the heartbeat may stay still before ``/health`` answers 503 (stalled)."""
    return Deadline(stall_timeout_s, growth=STALL_GROWTH)


def limit_text(flag: str, deadline: Deadline, pulse) -> str:
    """Where a limit comes from, for the messages: ``limit 75 s: --stall-timeout 30 or 5 x the
    longest step, 15.0 s``."""
    return (f"limit {deadline.limit(pulse):g} s: {flag} {deadline.limit_s:g} or {deadline.growth:g} x the longest "
            f"step, {pulse.longest_s:.1f} s")


class StallWatchdog:
    """Calls ``on_stall(age_s, why)`` once, from a daemon thread, when the heartbeat (armed) has
    been still for longer than ``timeout_s`` grown with the longest interval (``WATCHDOG_GROWTH``);
    ``why`` names the limit. ``timeout_s`` 0: never (``start`` starts no thread)."""

    def __init__(self, heartbeat: Heartbeat, timeout_s: float, on_stall: Callable[[float, str], None]):
        self.heartbeat = heartbeat
        self.deadline = Deadline(timeout_s, growth=WATCHDOG_GROWTH)
        self.on_stall = on_stall
        self._thread: Optional[Watchdog] = None

    def check(self) -> bool:
        """One look at the heartbeat; true when it fired."""
        pulse = self.heartbeat.pulse()
        if not self.deadline.overdue(pulse):
            return False
        self.on_stall(pulse.age_s, limit_text("--watchdog-timeout", self.deadline, pulse))
        return True

    def start(self) -> "StallWatchdog":
        if self.deadline.limit_s > 0:
            self._thread = Watchdog(self.check, min(0.5, self.deadline.limit_s / 10), name="serve-watchdog").start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()
