"""What a failed engine tells its clients and its log: which rank failed, and why, in our words.

When a rank dies (``kill -9``, a segfault, the out-of-memory killer) or raises, its peers learn it
from a collective that fails: gloo's ``Connection closed by peer`` on whichever rank was waiting
for it, which is usually rank 0, the rank that answers the clients. That error names rank 0, a
socket and the build path of torch's CI, not the rank that failed. So every rank of the engine
writes ``rank/<r>`` = "<pid> <machine id>" into the job's c10d store at start (under torchrun the
agent's store, which outlives any rank), and a rank that fails on its own (an exception of its
own, not a collective's) writes ``failed/<r>`` = its one-line cause before it exits. A rank whose
collective failed (``is_peer_failure``) then names the culprit (``RankRoster.culprit``): the first
rank that reported its own failure, else a rank on this machine whose process is gone; "a peer
rank" when neither shows within a short wait (a rank on another machine killed outright leaves
no trace this rank can read).

``describe(rank, err, roster)`` gives the report: the reason the clients get (the stream's error
event, the 503 body, ``/health``) and the lines for the log. A peer's failure is one line naming
it, and the raw collective error one more, without a traceback (the traceback is the collective
this rank was waiting in, which says nothing about the failure); a failure of this rank's own
keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Optional

from megatron.common.cli import one_line
from megatron.common.process import machine_id, pid_alive, same_machine

__all__ = ["RankRoster", "FailureReport", "describe", "is_peer_failure", "roster_for_job"]

# what gloo and NCCL say when the peer at the other end of a collective is gone (or hung)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/transport",
              "NCCL communicator was aborted", "ncclRemoteError", "collective operation timeout")
CULPRIT_WAIT_S = 2.0  # how long a rank whose collective failed looks for the rank that failed


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because a peer rank went away, rather than a
    failure of this rank's own."""
    import torch.distributed as dist

    return isinstance(err, dist.DistNetworkError) or any(marker in str(err) for marker in _PEER_GONE)


class RankRoster:
    """The ranks' pids and their own failures, in a store every rank reaches (module docstring).
    ``store`` needs ``set``, ``get`` and ``check``; ``alive(pid)`` says whether a process of this
    machine still runs (a zombie does not)."""

    def __init__(self, store, rank: int, world_size: int, *, alive: Callable[[int], bool] = pid_alive,
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.rank, self.world_size = store, rank, world_size
        self._alive, self._clock = alive, clock

    def register(self) -> "RankRoster":
        self.store.set(f"rank/{self.rank}", f"{os.getpid()} {machine_id()}")
        return self

    def report(self, cause: str) -> None:
        """This rank failed on its own with ``cause`` (one line): its peers name it."""
        self.store.set(f"failed/{self.rank}", cause)

    def _read(self, key: str) -> Optional[str]:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _find(self) -> Optional[str]:
        peers = [r for r in range(self.world_size) if r != self.rank]
        for r in peers:
            cause = self._read(f"failed/{r}")
            if cause is not None:
                return f"rank {r} of the engine failed ({cause})"
        for r in peers:
            entry = self._read(f"rank/{r}")
            if entry is None:
                continue
            pid, machine = entry.split(" ", 1)
            if same_machine(machine) and not self._alive(int(pid)):
                return f"rank {r} of the engine exited (pid {pid}: killed or crashed)"
        return None

    def culprit(self, wait_s: float = CULPRIT_WAIT_S) -> Optional[str]:
        """Which peer failed, in words (``rank 1 of the engine exited (pid 17222: killed or
        crashed)``), looking for up to ``wait_s``; None when no peer shows (another machine's rank
        killed outright)."""
        deadline = self._clock() + wait_s
        while True:
            try:
                found = self._find()
            except Exception:  # the store went away with the job: nothing more to learn
                return None
            if found is not None or self._clock() >= deadline:
                return found
            time.sleep(0.05)


def roster_for_job(rank: int, world_size: int) -> Optional[RankRoster]:
    """This rank's registered roster on the default process group's store, per torchrun attempt;
    None in a world of one or when the store cannot be reached."""
    if world_size < 2:
        return None
    from megatron import compat

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        return RankRoster(compat.prefixed_default_store(f"serve/{attempt}"), rank, world_size).register()
    except Exception:  # no store: reports then say "a peer rank"
        return None


@dataclasses.dataclass(frozen=True)
class FailureReport:
    reason: str  # for the clients and /health: which rank failed and why, one line
    log: list  # lines for this rank's stderr
    traceback: bool  # whether the traceback belongs in the log too (this rank's own failure)


def describe(rank: int, err: BaseException, roster: Optional[RankRoster],
             wait_s: float = CULPRIT_WAIT_S) -> FailureReport:
    """The report of this rank's engine loop failing with ``err`` (module docstring). A failure
    of this rank's own is reported to ``roster`` first, so that its peers can name it."""
    cause = f"{type(err).__name__}: {one_line(err)}"
    if not is_peer_failure(err):
        if roster is not None:
            try:
                roster.report(cause)
            except Exception:
                pass
        reason = f"the engine loop failed on rank {rank} ({cause})"
        return FailureReport(reason, [f"rank {rank}: the engine loop failed ({cause})"], traceback=True)
    found = roster.culprit(wait_s) if roster is not None else None
    reason = found or f"rank {rank} lost its connection to a peer rank of the engine (killed, crashed or unreachable)"
    return FailureReport(reason, [f"rank {rank}: the engine stopped: {reason}",
                                  f"rank {rank}: the collective error: {cause}"], traceback=False)
