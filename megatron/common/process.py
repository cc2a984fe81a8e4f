"""Process-level facts every long-running command shares: exit codes, ending a process at once,
whether a pid lives, and which machine this is.

Standard library only. The exit codes are the project's contract with launchers and schedulers
(``torchrun --max-restarts``, Slurm requeue): one table, here, for training and serving alike.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import time
from functools import lru_cache

__all__ = ["EXIT_OK", "EXIT_CRASH", "EXIT_USAGE", "EXIT_WATCHDOG", "EXIT_PREEMPTED", "exit_now", "fatal_exit",
           "record_failure", "pid_alive", "machine_id", "same_machine"]

EXIT_OK = 0  # finished (or drained) cleanly
EXIT_CRASH = 1  # an exception on this rank: a bug, a failed collective, a dead peer seen by torch
EXIT_USAGE = 2  # bad input: a flag, a config, a file (one line on stderr)
EXIT_WATCHDOG = 3  # ended by a watchdog: a rank was lost, hung or failed elsewhere, or a step stalled
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by a signal after saving; run the same command again to resume


def record_failure(line: str) -> None:
    """Hand the launcher ``line``, the one-line error this process exits with. Under torchrun
    (``TORCHELASTIC_ERROR_FILE`` set) it goes into the worker's error file, which torchrun's closing
    summary prints as the root cause (``traceback : <line>``): the last lines on the screen, below
    torchrun's own traceback, instead of a link to its documentation. Without a launcher: nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:  # the error is printed anyway; an unwritable error file must not hide it
        pass


def exit_now(code: int) -> None:
    """Flush stdout and stderr and end the process at once (``os._exit``): a thread blocked in a
    collective cannot be joined, so a normal exit could hang."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fatal_exit(code: int, message: str) -> None:
    """Print ``message`` (and hand it to the launcher) and every thread's stack to stderr, then
    :func:`exit_now`."""
    record_failure(message)
    print(message, file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    exit_now(code)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (read from a lock or pid file) still runs on this machine: not
    when it has exited, also while its parent has not reaped it yet (a zombie, state ``Z``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _read(f"/proc/{pid}/stat")
    return not (stat and stat[stat.rindex(")") + 2:].startswith("Z"))  # the name may hold spaces


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@lru_cache(maxsize=1)
def machine_id() -> str:
    """Where a pid means this process's pid: ``<hostname>/<boot id>/<pid namespace>``.

    A pid can be signalled only from the same kernel and the same pid namespace. The kernel's boot
    id tells two machines apart even when their containers share a hostname (``/etc/machine-id``
    does not: images copy it), and the pid namespace tells two containers of one machine apart.
    Only the hostname where neither can be read."""
    host = socket.gethostname()
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return f"{host}/{boot}/{pidns}" if boot and pidns else host


def same_machine(other: str) -> bool:
    """Whether a pid published with ``other`` (another process's :func:`machine_id`) can be
    signalled from here. A bare hostname never matches: it cannot tell two machines apart."""
    return "/" in other and other == machine_id()
