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
3. **watches its own progress**: the heartbeat is armed when the trainer starts; the training loop
   calls ``loop_started`` when it enters its first step and ``step_done`` after every step. Until
   the loop starts (building the model, loading the checkpoint and the data, after every restart
   too) ``startup_timeout_s`` applies; the first step (its one-off costs) may take 10x
   ``step_timeout_s``; from then on no step may take longer than ``step_timeout_s``, grown to 5x
   the slowest of the recent steps (``megatron.common.watchdog.WINDOW``; the first step counts only
   for the second) and capped at ``max_step_timeout_s`` (default 5x ``step_timeout_s``), so a job
   whose steps are slower than ``step_timeout_s`` but steady is not killed, and one slow step
   raises the limit only while it is recent. A checkpoint save (an async save's completion
   included) has ``save_timeout_s``, an evaluation ``eval_timeout_s``. Past any of them the rank
   is hung: spinning in Python, stuck in I/O, or waiting in a collective for a rank that is. Every
   thread's stack is dumped.
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
a hung step ``min(max(step_timeout_s, 5 x the slowest recent step), max_step_timeout_s)`` + 1
interval (180 s to 900 s, + 1 s; the first step 10 x ``step_timeout_s``); a rank hung while
starting ``startup_timeout_s`` (600 s), in a save ``save_timeout_s`` and in an evaluation
``eval_timeout_s`` (1800 s each), + 1 interval; a rank that failed with an exception, 2 intervals. A segfault or ``abort()`` ends the process: torchrun sees
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

__all__ = ["WatchdogConfig", "RankWatchdog", "start_watchdog", "STEP_GROWTH", "FIRST_STEP_FACTOR", "PAUSES"]

STEP_GROWTH = 5  # the hung-step deadline grows to this many times the slowest recent step
FIRST_STEP_FACTOR = 10  # the first step may take this many times --step-timeout
PAUSES = {"checkpoint save": ("save_timeout_s", "--save-timeout"),  # work with a deadline of its own
          "evaluation": ("eval_timeout_s", "--eval-timeout")}


@dataclasses.dataclass
class WatchdogConfig:
    heartbeat_timeout_s: float = 30.0  # a rank whose heartbeat is older is lost; 0: not watched
    step_timeout_s: float = 180.0  # no step finished for this long: hung; 0: not watched
    interval_s: float = 1.0  # beat and check period
    max_step_timeout_s: Optional[float] = None  # the grown step deadline's cap; None: STEP_GROWTH x step_timeout_s
    startup_timeout_s: float = 600.0  # from the start to the loop's first step; 0: not watched
    save_timeout_s: float = 1800.0  # one checkpoint save; 0: not watched
    eval_timeout_s: float = 1800.0  # one evaluation; 0: not watched

    @classmethod
    def of(cls, training) -> "WatchdogConfig":
        """From the training flags (``TrainingConfig``)."""
        return cls(training.heartbeat_timeout, training.step_timeout, max_step_timeout_s=training.max_step_timeout,
                   startup_timeout_s=training.startup_timeout, save_timeout_s=training.save_timeout,
                   eval_timeout_s=training.eval_timeout)

    def enabled(self) -> bool:
        return any(t > 0 for t in (self.heartbeat_timeout_s, self.step_timeout_s, self.startup_timeout_s,
                                   self.save_timeout_s, self.eval_timeout_s))


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
        cap = STEP_GROWTH * config.step_timeout_s if config.max_step_timeout_s is None else config.max_step_timeout_s
        self.deadline = Deadline(config.step_timeout_s, growth=STEP_GROWTH, max_s=cap,
                                 first_s=FIRST_STEP_FACTOR * config.step_timeout_s,
                                 startup_s=config.startup_timeout_s)
        self._thread = Watchdog(self._round, config.interval_s, name="train-watchdog")
        self._state = "running"
        self._last_step: Optional[int] = None
        self._store_error_since: Optional[float] = None
        self._abort_seen_at: Optional[float] = None
        self.fired: Optional[str] = None  # the reason, once fired

    # ------------------------------------------------------------------ called by the training loop
    def start(self, armed_at: Optional[float] = None) -> "RankWatchdog":
        """Beat, and arm the start-up deadline (from ``armed_at``, an instant of ``clock``: the
        process start; default now)."""
        self.steps.arm(armed_at)
        self.peers.beat(self._state)
        self._thread.start()
        return self

    def loop_started(self, iteration: int) -> None:
        """The loop enters its first step (after ``iteration`` steps, those of a resumed run): the
        start-up is over; that step has the first step's limit."""
        self._last_step = iteration
        self.steps.tick()

    def step_done(self, iteration: int) -> None:
        self._last_step = iteration
        self.steps.tick()

    def paused(self, what: str):
        """Work with its own deadline instead of the step's (``PAUSES``: a checkpoint save, an
        evaluation); the heartbeat goes on."""
        field, _ = PAUSES[what]
        return self.steps.paused(what, getattr(self.config, field))

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
        """The deadline in force: the start-up's, the first step's (10x the configured one), the
        configured one grown to 5x the slowest recent step (at most the cap), or a pause's."""
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
            self._fire(self._hung(pulse))

    def _hung(self, pulse) -> str:
        """The line of a deadline that passed, naming the phase and its limit."""
        limit, age, step = self.deadline.limit(pulse), pulse.age_s, self.config.step_timeout_s
        stacks = "every thread's stack above"
        if pulse.pause is not None:
            return (f"the {pulse.pause} on rank {self.rank} has taken {age:.1f} s after iteration {self._last_step}: "
                    f"it is stuck (I/O that does not return, or a collective waiting for a rank that is hung) "
                    f"(limit {PAUSES[pulse.pause][1]} {limit:g} s; {stacks})")
        if not pulse.started:
            return (f"rank {self.rank} did not reach its first training step in {age:.1f} s: building the model, "
                    f"loading the checkpoint or the data hung, here or on a rank it waits for (limit "
                    f"--startup-timeout {limit:g} s; {stacks})")
        if pulse.intervals == 0:
            why = f"the first step may take {FIRST_STEP_FACTOR} x --step-timeout {step:g} s"
        elif self.deadline.capped(pulse):
            why = f"--max-step-timeout; {STEP_GROWTH} x the slowest recent step is {STEP_GROWTH * pulse.recent_s:.1f} s"
        else:
            why = f"--step-timeout {step:g} s or {STEP_GROWTH} x the slowest recent step, {pulse.recent_s:.1f} s"
        return (f"no training step finished on rank {self.rank} for {age:.1f} s after iteration {self._last_step}: "
                f"it, or a rank it waits for, is hung (limit {limit:g} s: {why}; {stacks})")

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


def start_watchdog(config: WatchdogConfig, *, prog: str, armed_at: Optional[float] = None) -> Optional[RankWatchdog]:
    """This rank's watchdog on the default process group's store (None when disabled or when
    there is no process group); its start-up deadline counts from ``armed_at`` (``time.monotonic``;
    default now)."""
    import torch.distributed as dist

    from megatron import compat

    if not config.enabled() or not dist.is_initialized():
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = compat.prefixed_default_store(f"watchdog/{attempt}")
    return RankWatchdog(store, dist.get_rank(), dist.get_world_size(), config, prog=prog).start(armed_at)
