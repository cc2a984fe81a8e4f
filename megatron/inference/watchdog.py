"""Liveness of the serving loop: a heartbeat the loop ticks and a watchdog thread that ends a
stuck rank.

Every loop iteration ends an all-gather over all ranks, so a completed iteration proves every
rank arrived: the heartbeat is the time of this rank's last completed iteration (the idle loop
ticks too, every ``idle_wait_s``). A stopped (SIGSTOP), hung or deadlocked rank freezes every
other rank inside a collective, which cannot be cancelled; the ``Watchdog`` thread sees the
heartbeat stop moving and, after ``timeout_s``, calls ``on_stall`` once (rank 0: fail every
in-flight request, then exit; the other ranks: exit). It arms at the first tick: before it, the
ranks may still be loading the model at different speeds.

Exit codes of a server process (``megatron.common.process``, docs/serving.md): 0 after a clean
drain, 1 when the engine loop raised (a rank died, a collective failed, a bug), 2 for bad flags or
checkpoints (one line), 3 when the watchdog fired.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

__all__ = ["Heartbeat", "Watchdog"]


class Heartbeat:
    """Time (monotonic) and count of the loop's last completed iteration; None before the first."""

    def __init__(self):
        self.at: Optional[float] = None
        self.count = 0

    def tick(self) -> None:
        self.at = time.monotonic()
        self.count += 1

    def age(self) -> Optional[float]:
        """Seconds since the last completed iteration (None before the first)."""
        at = self.at
        return None if at is None else time.monotonic() - at


class Watchdog:
    """A daemon thread that calls ``on_stall(age_s)`` once when ``heartbeat`` has been armed and
    then not ticked for ``timeout_s`` seconds. ``timeout_s`` 0 disables it."""

    def __init__(self, heartbeat: Heartbeat, timeout_s: float, on_stall: Callable[[float], None]):
        self.heartbeat = heartbeat
        self.timeout_s = float(timeout_s)
        self.on_stall = on_stall
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Watchdog":
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._run, name="serve-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        poll = min(0.5, self.timeout_s / 10)
        while not self._stop.wait(poll):
            age = self.heartbeat.age()
            if age is not None and age > self.timeout_s:
                self.fired.set()
                self.on_stall(age)
                return

