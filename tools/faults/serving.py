"""``python -m tools.faults serving --load CKPT``: faults in a running server, and how fast they are
seen. A fresh two-rank expert-parallel server (``torchrun``, EP = 2, loopback) per fault and
repeat, one long request in flight (64 greedy prompts filling their context, ``ignore_eos``),
then the fault on rank 1: a signal from here (``SIGSTOP``, ``SIGKILL``), or one the rank causes
itself after its next engine step (``tools.faults.inject``'s kinds: the server then runs under
``tools.faults.rank serve``). Measured from the fault (for a rank's own fault, from its request):
when ``/health`` first stops answering 200, when the waiting client gets its answer (status and
message), when the launcher exits (and its code). Every process it started is killed at the end
whatever happened. Prints a table (medians and ranges over the repeats) and writes JSON;
``tests/serving/test_liveness.py`` runs it (SIGKILL) against the bounds docs/results/serving.md states.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

from tools.faults import inject
from tools.faults.launch import Launches, rank_pid

__all__ = ["FaultResult", "inject_fault", "health_status", "summarize", "SIGNALS", "FAULTS"]

SIGNALS = {"SIGSTOP": signal.SIGSTOP, "SIGKILL": signal.SIGKILL}
# stop: SIGSTOP at a step's end; stuck-io: a server writes no files
FAULTS = (*SIGNALS, *(k for k in inject.KINDS if k not in ("stop", "stuck-io")))


@dataclasses.dataclass
class FaultResult:
    """Seconds from the fault (None: not within the run's time limit)."""

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


def health_status(url: str):
    """The HTTP status of ``/health`` (None: no answer)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


def inject_fault(ckpt: str, fault: str, work_dir: str, *, rank: int = 1, nproc: int = 2, stall_timeout: float = 2.0,
                 watchdog_timeout: float = 5.0, torchrun_shutdown_timeout: int = 5, limit_s: float = 120.0,
                 extra: tuple = ()) -> FaultResult:
    """Serve ``ckpt`` on ``nproc`` ranks (EP = nproc), cause ``fault`` on ``rank`` while a request
    is in flight, and measure (see the module docstring)."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {', '.join(FAULTS)}, got {fault}")
    os.makedirs(work_dir, exist_ok=True)
    tag = f"{fault}-{time.monotonic_ns()}"
    ready = os.path.join(work_dir, f"ready-{tag}.json")
    fault_dir = os.path.join(work_dir, f"faults-{tag}")
    os.makedirs(fault_dir)
    module = ["megatron.inference.serve"] if fault in SIGNALS else ["tools.faults.rank", "serve"]
    args = ["--load", ckpt, "--port", 0, "--ready-file", ready, "--expert-model-parallel-size", nproc,
            "--stall-timeout", stall_timeout, "--watchdog-timeout", watchdog_timeout, *extra]
    launches = Launches(work_dir, nproc=nproc)
    proc, log = launches.start(f"server-{tag}", module, args, env={inject.ENV: fault_dir},
                               launcher=["--shutdown-timeout", str(torchrun_shutdown_timeout)])
    result = FaultResult(fault, rank, stall_timeout_s=stall_timeout, watchdog_timeout_s=watchdog_timeout,
                         torchrun_shutdown_timeout_s=torchrun_shutdown_timeout)
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (see {log})")
            time.sleep(0.2)
        with open(ready) as f:
            info = json.load(f)
        url = info["url"]
        # long enough to be in flight when the fault comes: 64 prompts filling their context
        budget = min(info["context_length"], info["max_request_tokens"]) - 8
        status, body = _post(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0}, 120)
        if status != 200:
            raise RuntimeError(f"the server does not answer before the fault: {status} {body}")
        pid = rank_pid(proc.pid, rank)
        answer: dict = {}

        def client():
            out = _post(url + "/v1/completions", {"prompt": ["Hello"] * 64, "max_tokens": budget, "temperature": 0,
                                                  "ignore_eos": True}, limit_s)
            answer["at"] = time.monotonic()
            answer["out"] = out

        waiting = threading.Thread(target=client, daemon=True)
        waiting.start()
        time.sleep(0.5)  # the request is in the engine
        t0 = time.monotonic()
        if fault in SIGNALS:
            os.kill(pid, SIGNALS[fault])
        else:
            inject.request(fault_dir, rank, fault)
        while time.monotonic() - t0 < limit_s:
            if result.health_not_ok_s is None and health_status(url) != 200:
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
        launches.close()


def summarize(runs: list, faults: list) -> list:
    """Per fault: medians of the measured seconds, the client statuses and launcher codes seen;
    prints the table."""
    rows = []
    print(f"\n{'fault':8} {'/health not 200 (s)':>22} {'client answered (s)':>22} {'launcher exit (s)':>20} "
          f"{'status':>7} {'exit':>5}")
    for fault in faults:
        mine = [r for r in runs if r["fault"] == fault]

        def span(key):
            vals = [r[key] for r in mine if r[key] is not None]
            if len(vals) < len(mine):
                return None, "missing"
            return statistics.median(vals), f"{statistics.median(vals):.2f} [{min(vals):.2f}, {max(vals):.2f}]"

        cells = {k: span(k) for k in ("health_not_ok_s", "client_answer_s", "launcher_exit_s")}
        statuses = sorted({str(r["client_status"]) for r in mine})
        codes = sorted({str(r["launcher_code"]) for r in mine})
        rows.append({"fault": fault, **{k: v[0] for k, v in cells.items()}, "client_status": statuses,
                     "launcher_code": codes})
        print(f"{fault:8} {cells['health_not_ok_s'][1]:>22} {cells['client_answer_s'][1]:>22} "
              f"{cells['launcher_exit_s'][1]:>20} {','.join(statuses):>7} {','.join(codes):>5}")
    return rows


def run_faults(ckpt: str, faults: list, repeats: int, **timeouts) -> list:
    """Every fault ``repeats`` times, each on a fresh server; the results as dicts."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="serve-faults-") as work:
        for fault in faults:
            for _ in range(repeats):
                r = inject_fault(ckpt, fault, work, **timeouts)
                runs.append(r.as_dict())
                print(f"{fault}: health {r.health_not_ok_s}, client {r.client_status} at {r.client_answer_s}, "
                      f"launcher exit {r.launcher_code} at {r.launcher_exit_s}", flush=True)
    return runs
