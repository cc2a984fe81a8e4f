"""Faults in a running server, and how fast they are seen: SIGSTOP or SIGKILL of one rank of a
``torchrun`` server (``python -m megatron.inference.serve``) while a client waits on a request.

``inject`` starts the server on loopback, checks it answers, starts one long request (64 greedy
prompts filling their context, ``ignore_eos``), signals the chosen rank (found among torchrun's children by its ``RANK``), and
measures from the signal: when ``/health`` first stops answering 200, when the waiting client
gets its answer (status and message), when the launcher exits (and its code). Every process it
started is killed at the end whatever happened. ``scripts/serve_fault_check.py`` prints the
table; ``tests/serving/test_liveness.py`` asserts the bounds docs/serving.md states.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

__all__ = ["FaultResult", "inject", "FAULTS"]

FAULTS = {"SIGSTOP": signal.SIGSTOP, "SIGKILL": signal.SIGKILL}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class FaultResult:
    """Seconds from the signal (None: not within the run's time limit)."""

    fault: str
    rank: int
    health_not_ok_s: Optional[float] = None
    client_answer_s: Optional[float] = None
    client_status: Optional[int] = None
    client_message: str = ""
    launcher_exit_s: Optional[float] = None
    launcher_code: Optional[int] = None
    stall_timeout_s: float = 0.0
    watchdog_timeout_s: float = 0.0
    torchrun_shutdown_timeout_s: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _post(url: str, body: dict, timeout: float) -> tuple:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
    except (OSError, ValueError) as err:  # the connection went away
        return None, {"error": {"message": f"{type(err).__name__}: {err}"}}


def _health(url: str):
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


def _rank_pid(launcher_pid: int, rank: int, timeout: float = 30.0) -> int:
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
    raise RuntimeError(f"no process with RANK={rank} under the launcher")


def inject(ckpt: str, fault: str, work_dir: str, *, rank: int = 1, nproc: int = 2, stall_timeout: float = 2.0,
           watchdog_timeout: float = 5.0, torchrun_shutdown_timeout: int = 5, limit_s: float = 120.0,
           extra: tuple = ()) -> FaultResult:
    """Serve ``ckpt`` on ``nproc`` ranks (EP = nproc), send ``fault`` to ``rank`` while a request
    is in flight, and measure (see the module docstring)."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {', '.join(FAULTS)}, got {fault}")
    os.makedirs(work_dir, exist_ok=True)
    ready = os.path.join(work_dir, f"ready-{fault}-{time.monotonic_ns()}.json")
    log = open(os.path.join(work_dir, f"server-{fault}.log"), "w")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           "--shutdown-timeout", str(torchrun_shutdown_timeout), "-m", "megatron.inference.serve", "--load", ckpt,
           "--port", "0", "--ready-file", ready, "--expert-model-parallel-size", str(nproc),
           "--stall-timeout", str(stall_timeout), "--watchdog-timeout", str(watchdog_timeout), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    result = FaultResult(fault, rank, stall_timeout_s=stall_timeout, watchdog_timeout_s=watchdog_timeout,
                         torchrun_shutdown_timeout_s=torchrun_shutdown_timeout)
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (see {log.name})")
            time.sleep(0.2)
        with open(ready) as f:
            info = json.load(f)
        url = info["url"]
        # long enough to be in flight when the signal comes: 64 prompts filling their context
        budget = min(info["context_length"], info["max_request_tokens"]) - 8
        status, body = _post(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0}, 120)
        if status != 200:
            raise RuntimeError(f"the server does not answer before the fault: {status} {body}")
        pid = _rank_pid(proc.pid, rank)
        answer: dict = {}
        signalled = threading.Event()

        def client():
            out = _post(url + "/v1/completions", {"prompt": ["Hello"] * 64, "max_tokens": budget, "temperature": 0,
                                                  "ignore_eos": True}, limit_s)
            answer["at"] = time.monotonic()
            answer["out"] = out

        waiting = threading.Thread(target=client, daemon=True)
        waiting.start()
        time.sleep(0.5)  # the request is in the engine
        t0 = time.monotonic()
        os.kill(pid, FAULTS[fault])
        signalled.set()
        while time.monotonic() - t0 < limit_s:
            if result.health_not_ok_s is None and _health(url) != 200:
                result.health_not_ok_s = time.monotonic() - t0
            if result.launcher_exit_s is None and proc.poll() is not None:
                result.launcher_exit_s, result.launcher_code = time.monotonic() - t0, proc.returncode
            if result.launcher_exit_s is not None and "at" in answer and result.health_not_ok_s is not None:
                break
            time.sleep(0.05)
        waiting.join(timeout=1)
        if "at" in answer:
            result.client_answer_s = answer["at"] - t0
            result.client_status = answer["out"][0]
            result.client_message = str(answer["out"][1].get("error", {}).get("message", ""))[:300]
        return result
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # ranks the launcher left behind
            except ProcessLookupError:
                pass
        log.close()
