"""Liveness of a training job: heartbeats through the rendezvous store, so that a stopped, stuck or
failed rank ends the whole job in seconds instead of at the collective timeout. The mechanism
(heartbeats, deadlines, the thread, the store heartbeats) is ``megatron.common.watchdog``; this
module wires it to the training loop and its flags.

Every rank runs a daemon thread (``RankWatchdog``) that, each ``interval_s``:

1. **beats**: writes ``beat/<rank>`` = "<count> <pid> <machine id> <state>" into the job's c10d store
   (torchrun's agent store; the file store in tests). A thread needs the GIL, so a rank that is
   stopped (SIGSTOP), or stuck in native code holding the GIL, stops beating.
2. **watches its ring neighbour** (rank + 1 mod world): when that rank's count has not changed for
   ``heartbeat_timeout_s`` it is declared lost. Watching one neighbour keeps the store traffic
   O(world) per interval; every rank is watched by exactly one other.
3. **watches its own progress**: the training loop calls ``loop_started`` when it enters its
   first step and ``step_done`` after every step; when no step has finished for
   ``step_timeout_s`` the rank is hung: spinning in Python, or waiting in a collective for a rank
   that is. Every thread's stack is dumped. The deadline grows to 5x the slowest step seen, the
   first one included (from the loop's start to its end); until the first step has finished,
   only the startup limit of 10x ``step_timeout_s`` applies, so a job whose steps are slower than
   ``step_timeout_s`` but steady is never killed. Evaluations and checkpoint saves are paused.
4. **reads the job's ``abort`` key**: the first rank to detect a fault (or to fail with an
   exception, ``fail``) writes the reason there, and every rank exits within one interval.

A rank that detects a fault prints one line naming it, writes ``abort``, SIGKILLs a lost
neighbour on the same machine (``megatron.common.process.same_machine``; a stopped process ignores the SIGTERM torchrun would send it and
would hold the job for torchrun's 30 s grace period), and exits with ``EXIT_WATCHDOG`` (3). A
rank that sees ``abort`` waits one more interval before exiting, so that when every rank raises
the same error at once each exits with its own code. ``torchrun --max-restarts N`` then restarts
the job, and ``--save D --load D`` resumes it from D's newest checkpoint. Ranks that exit cleanly (finished, or stopped by a signal after saving)
publish ``done`` first, so a rank finishing early is never mistaken for a lost one.

Detection bounds (defaults): a lost rank ``heartbeat_timeout_s`` + 2 intervals (30 s + 2 s);
a hung step ``max(step_timeout_s, 5 x slowest step)`` + 1 interval (180 s + 1 s; the first
step 10 x ``step_timeout_s``); a rank that
failed with an exception, 2 intervals. A segfault or ``abort()`` ends the process: torchrun sees
it within its ``--monitor-interval`` (0.1 s) and stops the others; ``faulthandler`` prints the
dying rank's Python stack.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import sys
import time
from typing import Callable, Optional

from megatron.common.process import EXIT_WATCHDOG, exit_now, record_failure
from megatron.common.watchdog import Deadline, Heartbeat, StorePeers, Watchdog

__all__ = ["WatchdogConfig", "RankWatchdog", "start_watchdog", "STEP_GROWTH", "STARTUP_FACTOR"]

STEP_GROWTH = 5  # the hung-step deadline grows to this many times the slowest step seen
STARTUP_FACTOR = 10  # the first step may take this many times --step-timeout


@dataclasses.dataclass
class WatchdogConfig:
    heartbeat_timeout_s: float = 30.0  # a rank whose heartbeat is older is lost; 0: not watched
    step_timeout_s: float = 180.0  # no step finished for this long: hung; 0: not watched
    interval_s: float = 1.0  # beat and check period

    def enabled(self) -> bool:
        return self.heartbeat_timeout_s > 0 or self.step_timeout_s > 0


class RankWatchdog:
    """One rank's heartbeat and watchdog thread (module docstring). ``store`` is a c10d store
    shared by all ranks (``set``/``get``/``check``); ``exit`` ends the process (replaced in tests)."""

    def __init__(self, store, rank: int, world_size: int, config: WatchdogConfig, *, prog: str = "train",
                 exit: Callable[[int], None] = exit_now, clock: Callable[[], float] = time.monotonic):
        self.rank = rank
        self.config = config
        self.prog = prog
        self._exit = exit
        self._clock = clock
        self.peers = StorePeers(store, rank, world_size, config.heartbeat_timeout_s, clock=clock)
        self.steps = Heartbeat(clock)  # ticked when a training step finishes
        self.deadline = Deadline(config.step_timeout_s, growth=STEP_GROWTH,
                                 startup_s=STARTUP_FACTOR * config.step_timeout_s)
        self._thread = Watchdog(self._round, config.interval_s, name="train-watchdog")
        self._state = "running"
        self._last_step: Optional[int] = None
        self._store_error_since: Optional[float] = None
        self._abort_seen_at: Optional[float] = None
        self.fired: Optional[str] = None  # the reason, once fired

    # ------------------------------------------------------------------ called by the training loop
    def start(self) -> "RankWatchdog":
        self.peers.beat(self._state)
        self._thread.start()
        return self

    def loop_started(self, iteration: int) -> None:
        """The loop enters its first step (after ``iteration`` steps, those of a resumed run): the
        step deadline is armed, under its startup limit until that step has finished."""
        self._last_step = iteration
        self.steps.tick()

    def step_done(self, iteration: int) -> None:
        self._last_step = iteration
        self.steps.tick()

    def paused(self):
        """No step deadline inside (evaluation, checkpoint saves); the heartbeat goes on."""
        return self.steps.paused()

    def finish(self) -> None:
        """This rank ends cleanly: publish ``done`` so its watcher does not call it lost."""
        self._state = "done"
        self._thread.stop(join_s=5 * self.config.interval_s)
        self._try(lambda: self.peers.beat(self._state))

    def fail(self, reason: str) -> None:
        """This rank is failing with an exception: tell every rank to stop now."""
        self._state = "failed"
        self._thread.stop()
        self._try(lambda: self.peers.abort(f"rank {self.rank} failed: {reason}"))

    # ------------------------------------------------------------------------------- the thread
    @property
    def step_timeout_s(self) -> float:
        """The effective hung-step deadline: the configured one, or 5x the slowest step seen (10x
        the configured one before the first step has finished)."""
        return self.deadline.limit(self.steps.pulse())

    def _round(self) -> bool:
        """One round of the thread; true once it fired. An unreachable store means the job is
        going down: it fires only when that lasts."""
        try:
            self.check()
        except Exception as e:
            now = self._clock()
            self._store_error_since = self._store_error_since or now
            limit = max(self.config.heartbeat_timeout_s, 10 * self.config.interval_s)
            if now - self._store_error_since > limit:
                self._fire(f"rank {self.rank} lost the rendezvous store for {now - self._store_error_since:.0f} s "
                           f"({type(e).__name__}: {e})", publish=False)
                return True
            return False
        self._store_error_since = None
        return self.fired is not None

    def check(self) -> None:
        """One round: beat, read ``abort``, watch the neighbour and this rank's progress."""
        self.peers.beat(self._state)
        reason = self.peers.abort_reason()
        if reason is not None:
            # one interval of grace: when every rank raises the same error at once, each exits
            # with its own code (2 for bad input) rather than as a victim of the first
            now = self._clock()
            self._abort_seen_at = self._abort_seen_at or now
            if self._state == "failed" or now - self._abort_seen_at < self.config.interval_s:
                return
            self.fired = reason
            line = f"{self.prog}: error: {reason}; stopping every rank (exit code {EXIT_WATCHDOG})"
            record_failure(line)
            if self.rank == 0:
                print(line, file=sys.stderr, flush=True)
            self._exit(EXIT_WATCHDOG)
            return
        lost = self.peers.lost()
        if lost is not None:
            timeout = f"--heartbeat-timeout {self.config.heartbeat_timeout_s:g}"
            if lost.pid is None:
                self._fire(f"rank {lost.rank} never sent a heartbeat in {lost.silent_s:.1f} s ({timeout})")
            else:
                self._fire(f"rank {lost.rank} (pid {lost.pid} on {lost.host}) sent no heartbeat for "
                           f"{lost.silent_s:.1f} s: stopped, stuck holding the GIL, or lost ({timeout})",
                           kill=lost)
            return
        pulse = self.steps.pulse()
        if self.deadline.overdue(pulse):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            limit = self.deadline.limit(pulse)
            why = (f"the first step may take {STARTUP_FACTOR} x --step-timeout {self.config.step_timeout_s:g} s"
                   if pulse.intervals == 0 else
                   f"--step-timeout {self.config.step_timeout_s:g} s or {STEP_GROWTH} x the slowest step, "
                   f"{pulse.longest_s:.1f} s")
            self._fire(f"no training step finished on rank {self.rank} for {pulse.age_s:.1f} s after iteration "
                       f"{self._last_step}: it, or a rank it waits for, is hung (limit {limit:g} s: {why}; every "
                       f"thread's stack above)")

    # ------------------------------------------------------------------------------- internals
    def _try(self, fn) -> None:
        try:
            fn()
        except Exception:
            pass

    def _fire(self, reason: str, *, kill=None, publish: bool = True) -> None:
        self.fired = reason
        line = f"{self.prog}: error: {reason}; stopping the job (exit code {EXIT_WATCHDOG})"
        record_failure(line)  # torchrun's closing summary names the reason
        print(line, file=sys.stderr, flush=True)
        if publish:
            self._try(lambda: self.peers.abort(reason))
        if kill is not None:
            self.peers.kill(kill)
        self._exit(EXIT_WATCHDOG)


def start_watchdog(config: WatchdogConfig, *, prog: str) -> Optional[RankWatchdog]:
    """This rank's watchdog on the default process group's store (None when disabled or when
    there is no process group)."""
    import torch.distributed as dist

    from megatron import compat

    if not config.enabled() or not dist.is_initialized():
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = compat.prefixed_default_store(f"watchdog/{attempt}")
    return RankWatchdog(store, dist.get_rank(), dist.get_world_size(), config, prog=prog).start()
