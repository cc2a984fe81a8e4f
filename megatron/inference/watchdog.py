"""Liveness of the serving loop: its heartbeat, what ``/health`` reads, and the watchdog thread
that ends a stuck rank. The mechanism is ``megatron.common.watchdog``; this module sets its
serving limits.

Each rank arms its ``Heartbeat`` at process start; the loop ticks it when an iteration's
all-gather completes (every rank arrived; the idle loop ticks every ``idle_wait_s``, an interval
that waited for work stays out of the window) and when an engine step starts and ends. A stopped
(SIGSTOP), hung or deadlocked rank freezes every other rank inside a collective, which cannot be
cancelled. ``/health`` answers 503 once the heartbeat has been still for longer than
``--stall-timeout`` (``health_deadline``); the ``StallWatchdog`` thread calls ``on_stall`` once
it has been still for longer than ``--watchdog-timeout`` (rank 0: fail every in-flight request,
then exit; the other ranks: exit). Both limits grow with the longest of the last ``WINDOW``
intervals, in practice the slowest recent engine step (5x and 10x it: the watchdog keeps waiting
twice as long as ``/health``, as the defaults do), at most to ``--max-stall-timeout`` and
``--max-watchdog-timeout`` (5x and 10x the configured limits by default), so a model whose steps
are slow but steady is neither reported stalled nor killed, while one slow step raises the limits
only while it is recent. Before the first tick (loading the model, building the engine, waiting
for the other ranks or the front end, after every restart too) the watchdog applies
``--startup-timeout``: a rank stopped or hung while starting is caught then, not at the process
group's timeout.

Exit codes of a server process (``megatron.common.process``, docs/design/serving.md): 0 after a clean
drain, 1 when the engine loop raised (a rank died, a collective failed, a bug), 2 for bad flags or
checkpoints (one line), 3 when the watchdog fired.
"""

from __future__ import annotations

from typing import Callable, Optional

from megatron.common.watchdog import Deadline, Heartbeat, Watchdog

__all__ = ["STALL_GROWTH", "WATCHDOG_GROWTH", "health_deadline", "watchdog_deadline", "limit_text",
           "StallWatchdog"]

STALL_GROWTH = 5  # /health's limit grows to this many times the longest recent interval
WATCHDOG_GROWTH = 10  # the watchdog's


def health_deadline(stall_timeout_s: float, max_stall_timeout_s: Optional[float] = None) -> Deadline:
    """How long the heartbeat may stay still before ``/health`` answers 503 (stalled); the cap
    defaults to ``STALL_GROWTH`` x the stall timeout."""
    cap = STALL_GROWTH * stall_timeout_s if max_stall_timeout_s is None else max_stall_timeout_s
    return Deadline(stall_timeout_s, growth=STALL_GROWTH, max_s=cap)


def watchdog_deadline(timeout_s: float, max_timeout_s: Optional[float] = None, startup_s: float = 0.0) -> Deadline:
    """The watchdog's: ``--watchdog-timeout`` grown at most to ``--max-watchdog-timeout`` (default
    ``WATCHDOG_GROWTH`` x it), ``--startup-timeout`` before the first tick."""
    cap = WATCHDOG_GROWTH * timeout_s if max_timeout_s is None else max_timeout_s
    return Deadline(timeout_s, growth=WATCHDOG_GROWTH, max_s=cap, startup_s=startup_s)


def limit_text(flag: str, deadline: Deadline, pulse, max_flag: str = "") -> str:
    """Where a limit comes from, for the messages: ``limit 75 s: --stall-timeout 30 or 5 x the
    longest recent step, 15.0 s``; at the cap ``limit 150 s: --max-stall-timeout``; before the
    first tick ``limit 600 s: --startup-timeout``."""
    limit = deadline.limit(pulse)
    if not pulse.started:
        return f"limit {limit:g} s: --startup-timeout"
    if deadline.capped(pulse):
        return f"limit {limit:g} s: {max_flag or 'the cap'} ({deadline.growth:g} x the longest recent step is " \
               f"{deadline.growth * pulse.recent_s:.1f} s)"
    return (f"limit {limit:g} s: {flag} {deadline.limit_s:g} or {deadline.growth:g} x the longest recent step, "
            f"{pulse.recent_s:.1f} s")


class StallWatchdog:
    """Calls ``on_stall(age_s, why)`` once, from a daemon thread, when the heartbeat has been
    still for longer than ``watchdog_deadline`` allows (``--startup-timeout`` before its first
    tick, when the heartbeat was armed); ``why`` names the limit. No thread when both
    ``timeout_s`` and ``startup_timeout_s`` are 0."""

    def __init__(self, heartbeat: Heartbeat, timeout_s: float, on_stall: Callable[[float, str], None], *,
                 max_timeout_s: Optional[float] = None, startup_timeout_s: float = 0.0):
        self.heartbeat = heartbeat
        self.deadline = watchdog_deadline(timeout_s, max_timeout_s, startup_timeout_s)
        self.on_stall = on_stall
        self._thread: Optional[Watchdog] = None

    def check(self) -> bool:
        """One look at the heartbeat; true when it fired."""
        pulse = self.heartbeat.pulse()
        if not self.deadline.overdue(pulse):
            return False
        self.on_stall(pulse.age_s, limit_text("--watchdog-timeout", self.deadline, pulse, "--max-watchdog-timeout"))
        return True

    def start(self) -> "StallWatchdog":
        limits = [s for s in (self.deadline.limit_s, self.deadline.startup_s) if s > 0]
        if limits:
            self._thread = Watchdog(self.check, min(0.5, min(limits) / 10), name="serve-watchdog").start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()
