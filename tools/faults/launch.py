"""What the fault harnesses share: torchrun launches whose processes are found and cleaned up, and
what torchrun's log says about a job's attempts and failures."""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time
from typing import Optional

__all__ = ["REPO", "Launches", "rank_pid", "descendants", "still_alive", "attempts", "agent_failures", "read"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


class Launches:
    """``torchrun --standalone --nproc_per_node=N [launcher args] -m MODULE ARGS`` from the
    repository root, each with its log file in ``out`` (a file, not a pipe: an orphaned rank must
    never block on it) and its own session; ``close`` kills every launch still running and what it
    left behind."""

    def __init__(self, out: str, *, nproc: int = 2):
        self.out = out
        self.nproc = nproc
        self.started: list = []
        os.makedirs(out, exist_ok=True)

    def command(self, module: list, args, launcher=()) -> list:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}",
                *launcher, "-m", *module, *map(str, args)]

    def start(self, name: str, module: list, args, *, launcher=(), env: Optional[dict] = None):
        """The launcher process and its log's path (``out/<name>.log``)."""
        log_path = os.path.join(self.out, f"{name}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(self.command(module, args, launcher), cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **(env or {})))
        self.started.append(proc)
        return proc, log_path

    def run(self, name: str, module: list, args, *, timeout: float = 900, **kw) -> int:
        """Start and wait; the launcher's exit code (killed, and 124, past ``timeout``)."""
        proc, _ = self.start(name, module, args, **kw)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            return 124

    def kill(self, proc) -> None:
        """SIGKILL a launch's whole session (the launcher and the ranks it left behind)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def close(self) -> None:
        for proc in self.started:
            self.kill(proc)


def rank_pid(launcher_pid: int, rank: int, timeout: float = 60.0) -> int:
    """The pid of the process with ``RANK=rank`` below the launcher (waits for it to start)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher_pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank):
                    return child.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.1)
    raise RuntimeError(f"no process with RANK={rank} under the launcher {launcher_pid}")


def descendants(pid: int) -> list:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def still_alive(pids, grace_s: float = 90.0) -> list:
    """Those of ``pids`` still running after up to ``grace_s`` seconds (zombies count as gone)."""
    import psutil

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + grace_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = [p for p in left if alive(p)]
    return left


def attempts(text: str) -> list:
    """The steps each attempt of a training job logged, in order ("starting at iteration" opens
    an attempt)."""
    out: list = []
    for line in text.splitlines():
        if "starting at iteration" in line:
            out.append([])
        m = re.match(r"iter\s+(\d+)/", line)
        if m and out:
            out[-1].append(int(m[1]))
    return out


def agent_failures(text: str) -> list:
    """Epoch times of torchrun's ``failed (exitcode`` lines: when its agent saw a rank exit."""
    year = datetime.date.today().year
    times = []
    for m in re.finditer(r"^E(\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) .*failed \(exitcode", text, re.M):
        t = datetime.datetime.strptime(f"{year}-{m[1]}-{m[2]} {m[3]}", "%Y-%m-%d %H:%M:%S.%f")
        times.append(t.timestamp())
    return times
