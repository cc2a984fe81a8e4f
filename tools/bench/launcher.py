"""Start one process per rank (inside its namespace), bound their run time, collect results.

Each rank runs ``[ip netns exec <ns>] <this python> <argv>`` in its own session (process group),
with the repository on ``PYTHONPATH`` and the ``torch.distributed`` environment (``MASTER_ADDR`` =
rank 0's address, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``GLOO_SOCKET_IFNAME``) set, so ``init_process_group("gloo")`` with the default ``env://``
rendezvous works across namespaces. stdout/stderr go to ``<log prefix><r>.log`` in the run
directory. ``launch`` runs a benchmark worker (``-m <worker module> <spec.json>``) to completion
and collects its results; ``start_ranks`` starts any module (the serving benchmark's server ranks
and load client) and returns a :class:`RankProcesses` handle to wait on, check or stop. A rank
that fails, or a wait that outlives ``timeout_s``, kills every rank's process group (SIGTERM,
then SIGKILL) and raises with the tail of the failing ranks' logs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

from megatron.common.cli import UserError
from tools import repo_root

from .schema import WorkerSpec

__all__ = ["LaunchError", "LaunchTimeout", "RankProcesses", "launch", "start_ranks", "free_port"]

_KILL_GRACE_S = 3.0
_FAILURE_GRACE_S = 5.0  # after one rank fails, how long the others may take to exit on their own
_LOG_TAIL_CHARS = 4000


class LaunchError(RuntimeError):
    """A worker rank failed (non-zero exit, or no valid result file)."""


class LaunchTimeout(LaunchError):
    """The launch outlived its wall-clock limit; every rank was killed."""


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port 0 and outgoing connections (Linux's default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port free on loopback right now (for the loopback fallback; namespaces need none),
    chosen below the kernel's ephemeral range: a port from ``bind(0)`` is one the kernel also hands
    to every other process's ``bind(0)`` and outgoing connection (gloo opens many), so on a busy
    machine another process could take it before our server binds it (EADDRINUSE). Below the range
    only a process that names the port itself can."""
    low = min(_ephemeral_range()[0], 32768)
    rng = random.SystemRandom()
    for _ in range(64 if low > 2048 else 0):  # a range starting this low leaves nothing below: bind(0)
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = _LOG_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return "<no log>"


def _kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every rank's process group, then SIGKILL what is left after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + _KILL_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
    for p in procs:
        try:
            p.wait(timeout=_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass


class RankProcesses:
    """The processes ``start_ranks`` started, one per endpoint, each in its own process group.

    ``wait`` blocks until every one exited 0 (``LaunchError`` when one fails, ``LaunchTimeout``
    past the limit: both kill the rest first); ``check`` raises the same way without blocking;
    ``signal`` sends a signal to every group still running; ``kill`` ends them all (SIGTERM, then
    SIGKILL). As a context manager it kills whatever is still running on exit.
    """

    def __init__(self, procs: list, logs: list, ranks: list):
        self.procs = procs
        self.logs = logs
        self.ranks = ranks

    def __enter__(self) -> "RankProcesses":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.kill()

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def check(self) -> None:
        """Raise ``LaunchError`` (after killing the others) if a process exited non-zero."""
        failed = [i for i, p in enumerate(self.procs) if p.poll() not in (0, None)]
        if failed:
            self.kill()
            raise LaunchError(self._failure(failed))

    def wait(self, timeout_s: float) -> None:
        _wait(self.procs, self.logs, timeout_s, self.ranks)

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def kill(self) -> None:
        _kill_all(self.procs)

    def log_tail(self, i: int) -> str:
        return _tail(self.logs[i])

    def _failure(self, failed: list) -> str:
        details = _failure_details(self.procs, self.logs, self.ranks, failed)
        return f"worker rank(s) {[self.ranks[i] for i in failed]} failed\n{details}"


def start_ranks(
    network,
    argv: Sequence[str],
    run_dir: str,
    *,
    master_port: Optional[int] = None,
    extra_env: Optional[dict] = None,
    num_threads: int = 1,
    endpoints: Optional[Sequence] = None,
    log_prefix: str = "rank",
) -> RankProcesses:
    """Start ``<this python> <argv>`` once per endpoint of ``network`` (all of them by default),
    inside its namespace, with the rendezvous environment of the module docstring; logs go to
    ``run_dir/<log_prefix><rank>.log``. ``endpoints`` picks a subset (e.g. a load client run in
    rank 0's namespace)."""
    os.makedirs(run_dir, exist_ok=True)
    if master_port is None:
        # Inside private namespaces every port is free; on loopback we must find one.
        master_port = 29500 if network.shaped else free_port()
    root = repo_root()
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, base_env.get("PYTHONPATH", "")) if p)
    base_env.update(
        MASTER_ADDR=network.endpoints[0].addr,
        MASTER_PORT=str(master_port),
        WORLD_SIZE=str(network.num_ranks),
        OMP_NUM_THREADS=str(num_threads),
        PYTHONUNBUFFERED="1",
    )
    base_env.update(extra_env or {})
    endpoints = list(network.endpoints if endpoints is None else endpoints)
    procs: list[subprocess.Popen] = []
    logs: list[str] = []
    try:
        for ep in endpoints:
            env = dict(base_env, RANK=str(ep.rank), LOCAL_RANK=str(ep.rank), GLOO_SOCKET_IFNAME=ep.ifname)
            log_path = os.path.join(run_dir, f"{log_prefix}{ep.rank}.log")
            logs.append(log_path)
            with open(log_path, "wb") as log_file:
                procs.append(
                    subprocess.Popen(
                        [*ep.command_prefix(), sys.executable, *argv],
                        env=env,
                        cwd=root,
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # own process group: killpg reaches all of it
                    )
                )
    except BaseException:
        _kill_all(procs)
        raise
    return RankProcesses(procs, logs, [ep.rank for ep in endpoints])


def launch(
    network,
    worker_module: str,
    spec: WorkerSpec,
    run_dir: str,
    timeout_s: float,
    master_port: Optional[int] = None,
    extra_env: Optional[dict] = None,
) -> list[dict]:
    """Run ``worker_module`` on every rank of ``network`` and return the per-rank result dicts.

    ``network`` is a :class:`~.netns.ShapedNetwork` or :class:`~.netns.LoopbackNetwork` that is
    already set up. ``spec.output_dir`` is where the ranks write ``rank<r>.json``; the spec itself
    is written to ``run_dir/spec.json``. Returns the parsed result JSON of ranks 0..R-1.
    """
    if timeout_s <= 0:
        raise UserError(f"--timeout-s must be > 0, got {timeout_s}")
    os.makedirs(run_dir, exist_ok=True)
    os.makedirs(spec.output_dir, exist_ok=True)
    for r in range(network.num_ranks):
        if os.path.exists(spec.result_path(r)):
            raise LaunchError(f"result file {spec.result_path(r)} already exists; use a fresh directory")
    spec_path = os.path.join(run_dir, "spec.json")
    spec.write(spec_path)
    with start_ranks(network, ["-m", worker_module, spec_path], run_dir, master_port=master_port,
                     extra_env=extra_env, num_threads=spec.num_threads) as ranks:
        ranks.wait(timeout_s)  # on errors/signals the context kills every rank

    results = []
    for r in range(network.num_ranks):
        path = spec.result_path(r)
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise LaunchError(f"rank {r} exited 0 but left no valid result ({e})\n{_tail(ranks.logs[r])}") from e
    return results


def _failure_details(procs, logs, ranks, failed) -> str:
    return "\n".join(
        f"--- rank {ranks[i]} (exit {procs[i].returncode}), last lines of {logs[i]}:\n{_tail(logs[i])}"
        for i in failed
    )


def _wait(procs: list[subprocess.Popen], logs: list[str], timeout_s: float,
          ranks: Optional[Sequence[int]] = None) -> None:
    ranks = list(range(len(procs))) if ranks is None else list(ranks)
    deadline = time.monotonic() + timeout_s
    first_failure: Optional[float] = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return
        failed = [i for i, c in enumerate(codes) if c not in (0, None)]
        now = time.monotonic()
        if failed and first_failure is None:
            first_failure = now
        if failed and (all(c is not None for c in codes) or now - first_failure > _FAILURE_GRACE_S):
            _kill_all(procs)
            details = _failure_details(procs, logs, ranks, failed)
            raise LaunchError(f"worker rank(s) {[ranks[i] for i in failed]} failed\n{details}")
        if now > deadline:
            running = [i for i, c in enumerate(codes) if c is None]
            _kill_all(procs)
            details = "\n".join(f"--- rank {ranks[i]}, last lines of {logs[i]}:\n{_tail(logs[i])}" for i in running)
            raise LaunchTimeout(
                f"timed out after {timeout_s:.0f}s (--timeout-s); killed ranks {[ranks[i] for i in running]}\n{details}"
            )
        time.sleep(0.05)
