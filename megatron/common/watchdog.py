"""Liveness of a long-running loop: is it still moving, and is every peer still alive? One
mechanism with two uses: training (``megatron.training.watchdog``) and serving
(``megatron.inference.watchdog``).

- ``Heartbeat``: the loop ticks it where it proves progress (a training step finished; a serving
  iteration's all-gather completed). The time between two ticks is an interval. ``arm()`` starts
  its clock before the first tick (at process start), so that start-up has a deadline too.
  ``paused(what, limit_s)`` marks work with a deadline of its own (a checkpoint save, an
  evaluation; none with ``limit_s`` 0); the heartbeat's clock restarts when it ends.
- ``Deadline``: how long a heartbeat may stay still, by phase: from arming to the first tick a
  start-up limit; the first interval (one-off costs: memory allocation, kernel compilation, lazily
  created communicators) its own limit; then a configured limit, grown to ``growth`` times the
  longest of the last ``WINDOW`` intervals (so that a slow but steady loop is not taken for a hung
  one) and capped at a stated maximum (so that one slow interval cannot stretch the limit without
  bound). The first interval stays out of that window; it scales only the second's limit, while
  no other interval has completed.
- ``Watchdog``: a daemon thread that runs a check every interval until the check fires. A
  thread needs the GIL, so a process stopped (SIGSTOP) or stuck in native code holding the GIL
  stops checking too: only a peer can see that (``StorePeers``).
- ``StorePeers``: heartbeats through a key-value store every rank reaches (a c10d store: under
  torchrun the launcher's, which outlives any one rank). Each rank publishes its own and
  watches its ring neighbour's (rank + 1 mod world: O(world) store traffic, every rank watched
  by exactly one other); an ``abort`` key tells every rank that the job is going down.

Ending the process (every thread's stack, then an exit code) is ``megatron.common.process``.
Standard library only; ``clock`` arguments take a fake clock in tests.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import threading
import time
from contextlib import contextmanager, suppress
from typing import Callable, Optional

from megatron.common.process import machine_id, same_machine

__all__ = ["WINDOW", "Pulse", "Heartbeat", "Deadline", "Watchdog", "LostPeer", "StorePeers"]


WINDOW = 32  # the recent intervals a grown limit is taken from


@dataclasses.dataclass(frozen=True)
class Pulse:
    """A heartbeat read at one instant."""

    age_s: Optional[float]  # since the last tick, the arming or the start of a bounded pause; None
    # before arming and in a pause without a deadline
    recent_s: float  # the longest of the recent intervals (the first one only while no other completed)
    intervals: int  # completed intervals (pauses and unrecorded ticks excluded)
    started: bool = True  # false from arming to the first tick (start-up)
    pause: Optional[str] = None  # what a pause with a deadline in progress is doing
    pause_limit_s: float = 0.0  # its deadline


class Heartbeat:
    """Ticks of a loop that must keep moving (module docstring). The loop ticks; a watchdog thread
    and ``/health`` read ``pulse()``, which may come at any instant: the state changes under a
    lock, so a reader sees a pause either still on or over with its clock restarted, never over
    with the old clock (a rank reported hung right after a long evaluation). The clock is read
    outside the lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, window: int = WINDOW):
        self._clock = clock
        self._lock = threading.Lock()
        self._at: Optional[float] = None  # the last tick, the arming, or the end of the last pause
        self._ticks = 0
        self._intervals = 0
        self._first_s: Optional[float] = None  # the first recorded interval
        self._recent: collections.deque = collections.deque(maxlen=window)  # the later ones
        self._paused = 0  # pause depth
        self._pause: Optional[tuple] = None  # (what, limit_s, since) of the outermost pause

    def arm(self, at: Optional[float] = None) -> None:
        """Start the clock before the first tick (``at``: an earlier instant of this clock, e.g.
        the process start): the start-up phase, judged by ``Deadline.startup_s``."""
        now = self._clock() if at is None else at
        with self._lock:
            if self._at is None:
                self._at = now

    def tick(self, record: bool = True) -> None:
        """Progress. ``record`` false: the interval it ends says nothing about how long work takes
        (a loop that waited for work): it restarts the clock but stays out of the window."""
        now = self._clock()
        with self._lock:
            if self._ticks and not self._paused and record:
                if self._first_s is None:
                    self._first_s = now - self._at
                else:
                    self._recent.append(now - self._at)
                self._intervals += 1
            self._at = now
            self._ticks += 1

    @contextmanager
    def paused(self, what: Optional[str] = None, limit_s: float = 0.0):
        """Work with a deadline of its own inside (``limit_s`` seconds; 0: none); the interval in
        progress restarts when the last pause ends."""
        since = self._clock()
        with self._lock:
            self._paused += 1
            if self._paused == 1:
                self._pause = (what, limit_s, since)
        try:
            yield
        finally:
            now = self._clock()
            with self._lock:
                if self._at is not None:
                    self._at = now
                self._paused -= 1
                if not self._paused:
                    self._pause = None

    def pulse(self) -> Pulse:
        now = self._clock()
        with self._lock:
            recent = max(self._recent) if self._recent else (self._first_s or 0.0)
            started = self._ticks > 0
            if self._pause is not None and self._pause[1] > 0:
                what, limit_s, since = self._pause
                return Pulse(max(now - since, 0.0), recent, self._intervals, started, what or "paused", limit_s)
            age = None if self._at is None or self._paused else max(now - self._at, 0.0)
            return Pulse(age, recent, self._intervals, started)


@dataclasses.dataclass(frozen=True)
class Deadline:
    """How long a heartbeat may stay still (module docstring): ``startup_s`` from arming to the
    first tick (0: none); then ``limit_s`` (0: no deadline), for the first interval
    ``first_s`` when that is longer, and later grown to ``growth`` x the longest recent interval
    (0: fixed), at most ``max_s`` (0: no cap; never below ``limit_s``). A pause with a deadline
    has its own (``Pulse.pause_limit_s``)."""

    limit_s: float
    growth: float = 0.0
    max_s: float = 0.0
    first_s: float = 0.0
    startup_s: float = 0.0

    def limit(self, pulse: Pulse) -> float:
        """The limit in force (0: none)."""
        if pulse.pause is not None:
            return pulse.pause_limit_s
        if not pulse.started:
            return self.startup_s
        if self.limit_s <= 0:
            return 0.0
        if pulse.intervals == 0:
            return max(self.limit_s, self.first_s)
        grown = max(self.limit_s, self.growth * pulse.recent_s)
        return min(grown, max(self.max_s, self.limit_s)) if self.max_s > 0 else grown

    def capped(self, pulse: Pulse) -> bool:
        """Whether the grown limit in force is the cap."""
        return (pulse.pause is None and pulse.started and pulse.intervals > 0 and self.max_s > 0
                and self.growth * pulse.recent_s > max(self.max_s, self.limit_s))

    def overdue(self, pulse: Pulse) -> bool:
        """Whether the heartbeat has been still for longer than the limit in force."""
        limit = self.limit(pulse)
        return limit > 0 and pulse.age_s is not None and pulse.age_s > limit


class Watchdog:
    """A daemon thread that runs ``check()`` every ``interval_s`` seconds until ``check`` returns
    true (it fired) or ``stop()``."""

    def __init__(self, check: Callable[[], bool], interval_s: float, *, name: str):
        self.check = check
        self.interval_s = interval_s
        self.name = name
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, join_s: float = 0.0) -> None:
        self._stop.set()
        if join_s and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=join_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.check():
                return


@dataclasses.dataclass(frozen=True)
class LostPeer:
    """A neighbour whose heartbeat stopped: ``pid`` and ``machine`` (its
    ``megatron.common.process.machine_id``) None when it never beat."""

    rank: int
    silent_s: float
    pid: Optional[int] = None
    machine: Optional[str] = None

    @property
    def host(self) -> Optional[str]:
        return self.machine.split("/")[0] if self.machine else None


class StorePeers:
    """This rank's heartbeat in a store shared by every rank, and its ring neighbour's.

    ``beat(state)`` publishes ``beat/<rank>`` = "<count> <pid> <machine id> <state>" (state
    ``running``, ``done`` or ``failed``: a neighbour that is not running is not watched);
    ``lost()`` reads the neighbour and returns it once its count has not moved for
    ``timeout_s``; ``abort(reason)`` writes the job's ``abort`` key (the first reason wins) and
    ``abort_reason()`` reads it. ``store`` needs ``set``, ``get`` and ``check``."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, *,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._clock = clock
        self._count = 0
        self._machine = machine_id()
        self.neighbour = (rank + 1) % world_size
        self._seen: Optional[str] = None  # the neighbour's last count
        self._changed = clock()  # when it changed

    def beat(self, state: str = "running") -> None:
        self._count += 1
        self.store.set(f"beat/{self.rank}", f"{self._count} {os.getpid()} {self._machine} {state}")

    def lost(self) -> Optional[LostPeer]:
        """The neighbour, when it has not beaten for ``timeout_s`` (never with one rank)."""
        if self.timeout_s <= 0 or self.world_size < 2:
            return None
        now = self._clock()
        key = f"beat/{self.neighbour}"
        fields = self.store.get(key).decode().split() if self.store.check([key]) else []
        if fields and fields[3] != "running":
            self._changed = now  # done or failed: nothing to watch
        elif fields and fields[0] != self._seen:
            self._seen, self._changed = fields[0], now
        elif now - self._changed > self.timeout_s:
            if not fields:
                return LostPeer(self.neighbour, now - self._changed)
            return LostPeer(self.neighbour, now - self._changed, int(fields[1]), fields[2])
        return None

    def kill(self, peer: LostPeer) -> bool:
        """SIGKILL a lost peer whose pid can be signalled from here (a stopped process ignores the
        SIGTERM a launcher sends); returns whether a signal was sent. Containers on different
        machines may share a hostname: only the same machine id (hostname, boot id, pid
        namespace) makes the published pid this machine's."""
        if peer.pid is None or not same_machine(peer.machine) or peer.pid == os.getpid():
            return False
        with suppress(OSError):
            os.kill(peer.pid, signal.SIGKILL)
            return True
        return False

    def abort(self, reason: str) -> None:
        if not self.store.check(["abort"]):
            self.store.set("abort", reason)

    def abort_reason(self) -> Optional[str]:
        return self.store.get("abort").decode() if self.store.check(["abort"]) else None
