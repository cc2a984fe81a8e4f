"""Preemption: SIGTERM/SIGINT end a run at a step boundary with a checkpoint and a distinct exit code.

A signal only sets a flag; the training loop checks it between steps with one all-reduce, so every
rank agrees to stop after the same step, saves (``checkpointing.save_checkpoint`` writes in the
rank's own process, so the signal that torchrun sends to each rank's whole process group cannot
kill a writer) and exits with ``megatron.common.process.EXIT_PREEMPTED`` (75). A second SIGINT raises ``KeyboardInterrupt``
(an impatient Ctrl-C still works).

Under torchrun each rank also asks the kernel for SIGTERM when its launcher dies
(``PR_SET_PDEATHSIG``): a launcher killed with SIGKILL, which cannot forward anything, still stops
its ranks the same way instead of leaving them training with nobody to collect them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Optional

import torch

from megatron.common import collectives

__all__ = ["StopFlag", "stop_with_launcher"]

_PR_SET_PDEATHSIG = 1


class StopFlag:
    """Set by SIGTERM/SIGINT; checked (and agreed on by all ranks) between steps."""

    def __init__(self):
        self.requested = False
        self.signal: Optional[int] = None
        self._previous = {}

    def install(self) -> "StopFlag":
        def handler(signum, frame):
            if self.requested and signum == signal.SIGINT and self.signal == signal.SIGINT:
                raise KeyboardInterrupt
            self.requested = True
            self.signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, handler)
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "a signal"

    def agreed(self, group=None) -> bool:
        """True on every rank when any rank has been signalled (collective)."""
        flag = torch.tensor([1.0 if self.requested else 0.0])
        collectives.all_reduce(flag, op=collectives.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)


def stop_with_launcher() -> bool:
    """Under torchrun, have the kernel send this rank SIGTERM when its launcher dies (Linux).
    Returns whether it was arranged."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
    return True
