"""``python -m tools.faults serving-cases --load CKPT --mla-load CKPT``: the serving end-to-end cases
as one table, run by one runner (as torchtitan's integration tests: a list of flag sets).

Each run (``TABLE``) is one server with a set of flags: launched as the documented
``python -m megatron.inference.serve --nproc-per-node 2 --max-restarts K`` (the front end in its own
process) or under plain ``torchrun --nproc-per-node 2`` (the front end in rank 0, no restarts); a
fixed ``--port`` (a free one picked here) or ``--port 0``; a layout: EP 2 or TP 2 of ``--load``,
or EP 2 of the MLA checkpoint ``--mla-load``. Its faults come one at a time, each while a long
request is in flight: kill -9 and SIGSTOP from outside, a segfault and an exception in the forward
from inside (``tools.faults.inject``: the server then runs as ``tools.faults.rank serve``), on rank
0 or rank 1; a run may also start with a rank that hangs before it loads anything
(``inject.AT_START``), which ``--startup-timeout`` catches. The table covers every pair of values
of the five factors (launch, port, layout, fault, rank: ``missing_pairs``), not their product:
14 faults in 7 servers.

What each case asserts is what a user expects (``EXPECTED``):

- every fault: ``/health`` stops answering 200 and the request in flight gets a clean 503 (its
  JSON error; a stopped rank named) within ``answer_s``;
- ``back``: then the same URL answers again within ``BACK_S`` with the greedy tokens it gave
  before the first fault (exact);
- ``error``: then the launcher exits non-zero within ``EXIT_S`` (plus torchrun's fixed 30 s for a
  stopped rank);
- ``no restart left``: then the front end exits non-zero saying so;
- ``started``: the server comes up within ``--startup-timeout`` + ``BACK_S``, its log naming the
  rank that did not start;
- ``drained`` (SIGTERM, the end of a run with restarts left): the request in flight completes (200)
  and the front end exits 0.

Prints the table (markdown: ``render_markdown``) and writes JSON (schema ``serving_cases/1``). The
bounds carry slack for a loaded 2-core machine; the seconds measured are in the JSON.
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
from typing import Optional

from tools.bench.launcher import free_port
from tools.faults import inject
from tools.faults.launch import REPO, rank_pid, read
from tools.faults.serving import health_status
from tools.faults.serving_chaos import complete

__all__ = ["Run", "TABLE", "FACTORS", "EXPECTED", "missing_pairs", "run_table", "render_markdown"]

STALL_S = 2.0  # --stall-timeout of every run
WATCHDOG_S = 5.0  # --watchdog-timeout
STARTUP_S = 20.0  # --startup-timeout of a run that starts with a hung rank
SLACK_S = 10.0  # on the answer to the request in flight
BACK_S = 120.0  # from the fault to the server answering again (a restart: two ranks start and load)
EXIT_S = 60.0  # from the fault to the launcher's exit
TORCHRUN_GRACE_S = 30.0  # torchrun's agent waits this long for a stopped rank before SIGKILL
SIGNALS = {"kill9": signal.SIGKILL, "sigstop": signal.SIGSTOP}
IN_RANK = {"segfault": "segfault", "error": "error"}  # inject kinds
FACTORS = {"launch": ("front end", "torchrun"), "port": ("fixed", "0"), "layout": ("EP 2", "TP 2", "MLA EP 2"),
           "fault": ("kill9", "sigstop", "segfault", "error"), "rank": (0, 1)}
EXPECTED = {"back": "503, then the same URL answers with the same greedy tokens",
            "error": "503, then the launcher exits non-zero",
            "no restart left": "503, then the front end exits non-zero: no restart left",
            "started": "up after --startup-timeout and a restart",
            "drained": "the request in flight completes (200), exit 0"}
LAYOUTS = {"EP 2": ("load", ["--expert-model-parallel-size", "2"]),
           "TP 2": ("load", ["--tensor-model-parallel-size", "2"]),
           "MLA EP 2": ("mla_load", ["--expert-model-parallel-size", "2"])}
PROMPT = "First Citizen:"
# what the 503 of a stopped rank names, by who notices it: the front end (rank 0's link silent, or a
# stopped process found below torchrun) or rank 0's watchdog; other faults: any message
STOPPED = {("front end", 0): ("rank 0 of the engine (pid {pid}) sent nothing for",
                              "rank 0 (pid {pid}) of the engine is stopped (SIGSTOP)"),
           ("front end", 1): ("rank 1 (pid {pid}) of the engine is stopped (SIGSTOP)",),
           ("torchrun", 1): ("a rank is stopped, hung or dead",)}


@dataclasses.dataclass(frozen=True)
class Run:
    """One server: its flags (``launch``, ``port``, ``layout``) and its faults, ``(kind, rank)`` in
    order; ``hang_at_start``: a rank that spins before it loads anything (front end runs only)."""

    name: str
    launch: str
    port: str
    layout: str
    faults: tuple
    hang_at_start: Optional[int] = None
    end: Optional[str] = "drain"  # front end runs: SIGTERM, "no restart left" after the last fault, or None

    @property
    def max_restarts(self) -> int:
        needed = len(self.faults) + (self.hang_at_start is not None)
        return needed - 1 if self.end == "no restart left" else needed

    def expected(self, k: int) -> str:
        """What the ``k``-th fault should lead to."""
        if self.launch == "torchrun":
            return "error"
        return "no restart left" if self.end == "no restart left" and k == len(self.faults) - 1 else "back"

    @property
    def num_cases(self) -> int:
        """The cases it records when every one goes as expected."""
        return len(self.faults) + (self.hang_at_start is not None) + (self.launch == "front end" and self.end == "drain")


# every pair of factor values at least once (missing_pairs): 14 faults in 7 servers
TABLE = (
    Run("readme-fixed-port", "front end", "fixed", "EP 2", (("kill9", 1), ("sigstop", 0), ("sigstop", 1))),
    Run("tp-port0", "front end", "0", "TP 2", (("segfault", 0), ("error", 1), ("sigstop", 1), ("kill9", 0)),
        hang_at_start=1, end=None),
    Run("mla-fixed-port", "front end", "fixed", "MLA EP 2", (("error", 0), ("segfault", 1), ("sigstop", 1)),
        end="no restart left"),
    Run("torchrun-ep-error", "torchrun", "0", "EP 2", (("error", 0),)),
    Run("torchrun-mla-kill9", "torchrun", "0", "MLA EP 2", (("kill9", 1),)),
    Run("torchrun-tp-sigstop", "torchrun", "fixed", "TP 2", (("sigstop", 1),)),
    Run("torchrun-ep-segfault", "torchrun", "0", "EP 2", (("segfault", 1),)),
)


def cases_of(table) -> list:
    """Every fault of the table as a dict of its factors."""
    return [{"launch": r.launch, "port": r.port, "layout": r.layout, "fault": kind, "rank": rank}
            for r in table for kind, rank in r.faults]


def missing_pairs(table=TABLE) -> list:
    """The pairs of factor values (``FACTORS``) no case of ``table`` has."""
    cases, names = cases_of(table), list(FACTORS)
    return [(a, va, b, vb) for i, a in enumerate(names) for b in names[i + 1:] for va in FACTORS[a]
            for vb in FACTORS[b] if not any(c[a] == va and c[b] == vb for c in cases)]


class _Server:
    """One run's server, its own session and log under ``out``."""

    def __init__(self, run: Run, ckpt: str, out: str, fault_dir: str):
        self.run = run
        self.ready = os.path.join(out, f"{run.name}.ready.json")
        self.log_path = os.path.join(out, f"{run.name}.log")
        self.port = free_port() if run.port == "fixed" else 0
        in_rank = run.hang_at_start is not None or any(kind in IN_RANK for kind, _ in run.faults)
        module = ["tools.faults.rank", "serve"] if in_rank else ["megatron.inference.serve"]
        flags = ["--load", ckpt, *LAYOUTS[run.layout][1], "--port", str(self.port), "--ready-file", self.ready,
                 "--stall-timeout", str(STALL_S), "--watchdog-timeout", str(WATCHDOG_S), "--shutdown-timeout", "20"]
        if run.hang_at_start is not None:
            flags += ["--startup-timeout", str(STARTUP_S)]
        if run.launch == "front end":
            cmd = [sys.executable, "-m", *module, "--nproc-per-node", "2", "--max-restarts", str(run.max_restarts),
                   *flags]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", *module,
                   *flags]
        self.command = " ".join(["python" if c == sys.executable else c for c in cmd])
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO,
                                                  **{inject.ENV: fault_dir}))
        self.started = time.monotonic()
        self.url = None

    def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        with open(self.ready) as f:
            self.info = json.load(f)
        self.url = self.info["url"]
        return True

    def log(self) -> str:
        return read(self.log_path)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def _greedy(url: str) -> Optional[list]:
    out = complete(url, {"i": 0, "prompt": PROMPT, "max_tokens": 12, "stream": False}, 60)
    return out["tokens"] if out["outcome"] == "ok" else None


def _in_flight(srv: _Server, prompts: int = 64, max_tokens: Optional[int] = None) -> tuple:
    """A request sent now (default long: 64 prompts filling their context); (thread, its answer)."""
    budget = max_tokens or min(srv.info["context_length"], srv.info["max_request_tokens"]) - 8
    answer: dict = {}

    def client():
        answer.update(complete(srv.url, {"i": 0, "prompt": ["Hello"] * prompts, "max_tokens": budget,
                                         "stream": False}, 120))
        answer["at"] = time.monotonic()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    time.sleep(0.5)  # in the engine
    return thread, answer


def _wait(predicate, timeout_s: float) -> Optional[float]:
    """Seconds until ``predicate()`` held (polled every 0.2 s), None past ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


def _fault(srv: _Server, fault_dir: str, kind: str, rank: int) -> Optional[int]:
    """Cause ``kind`` on ``rank`` now; the pid signalled (None for an in-rank fault)."""
    if kind in SIGNALS:
        pid = rank_pid(srv.proc.pid, rank, timeout=30)
        os.kill(pid, SIGNALS[kind])
        return pid
    inject.request(fault_dir, rank, IN_RANK[kind])  # at the rank's next engine step
    return None


def _answer_bound(run: Run, kind: str) -> float:
    if kind != "sigstop":
        return SLACK_S
    return (STALL_S if run.launch == "front end" else WATCHDOG_S) + SLACK_S


def _one_fault(run: Run, srv: _Server, fault_dir: str, k: int, reference) -> dict:
    kind, rank = run.faults[k]
    expected = run.expected(k)
    case = {"run": run.name, "launch": run.launch, "port": run.port, "layout": run.layout, "fault": kind,
            "rank": rank, "expected": expected, "answer_within_s": _answer_bound(run, kind)}
    thread, answer = _in_flight(srv)
    t0 = time.monotonic()
    pid = _fault(srv, fault_dir, kind, rank)
    health: dict = {}
    poller = threading.Thread(target=lambda: health.update(s=_wait(lambda: health_status(srv.url) != 200, 120)),
                              daemon=True)
    poller.start()
    thread.join(120)
    poller.join(120)
    case["health_not_ok_s"] = None if health.get("s") is None else round(health["s"], 2)
    case["answered_s"] = round(answer["at"] - t0, 2) if "at" in answer else None
    case["status"], case["message"] = answer.get("status"), answer.get("message", "")[:300]
    problems = []
    if case["status"] != 503 or not case["message"]:
        problems.append(f"the request in flight got {case['status']} {answer.get('outcome')}, not a clean 503")
    elif case["answered_s"] > case["answer_within_s"]:
        problems.append(f"answered after {case['answered_s']} s > {case['answer_within_s']} s")
    elif kind == "sigstop" and not any(m.format(pid=pid) in case["message"] for m in STOPPED[run.launch, rank]):
        problems.append(f"the 503 does not name the stopped rank: {case['message']!r}")
    if case["health_not_ok_s"] is None or case["health_not_ok_s"] > case["answer_within_s"]:
        problems.append(f"/health still 200 {case['health_not_ok_s']} s after the fault")
    if expected == "back":
        case["back_within_s"] = BACK_S
        back = _wait(lambda: health_status(srv.url) == 200, BACK_S)
        case["back_s"] = None if back is None else round(time.monotonic() - t0, 2)
        tokens = _greedy(srv.url) if back is not None else None
        case["same_tokens"] = tokens == reference
        if back is None:
            problems.append(f"not answering again within {BACK_S:g} s")
        elif not case["same_tokens"]:
            problems.append(f"greedy tokens {tokens} differ from {reference}")
    else:
        grace = TORCHRUN_GRACE_S if kind == "sigstop" and run.launch == "torchrun" else 0.0
        case["exit_within_s"] = EXIT_S + grace
        gone = _wait(lambda: srv.proc.poll() is not None, EXIT_S + grace)
        case["exit_s"] = None if gone is None else round(time.monotonic() - t0, 2)
        case["exit_code"] = srv.proc.returncode
        if gone is None or srv.proc.returncode == 0:
            problems.append(f"the launcher did not exit non-zero within {EXIT_S + grace:g} s ({srv.proc.returncode})")
        elif expected == "no restart left" and "no restart left" not in srv.log():
            problems.append("the front end did not say 'no restart left'")
    if pid is not None and kind == "sigstop":
        try:
            os.kill(pid, signal.SIGCONT)  # whoever did not kill it: let it see its fate
        except ProcessLookupError:
            pass
    case["ok"], case["problems"] = not problems, problems
    return case


def _drain(run: Run, srv: _Server) -> dict:
    """SIGTERM the front end while a request is in flight."""
    case = {"run": run.name, "launch": run.launch, "port": run.port, "layout": run.layout, "fault": "SIGTERM",
            "rank": None, "expected": "drained", "exit_within_s": EXIT_S}
    thread, answer = _in_flight(srv, prompts=4, max_tokens=16)  # done well within --shutdown-timeout
    t0 = time.monotonic()
    os.kill(srv.proc.pid, signal.SIGTERM)
    thread.join(120)
    gone = _wait(lambda: srv.proc.poll() is not None, EXIT_S)
    case.update(status=answer.get("status"), exit_code=srv.proc.returncode,
                exit_s=None if gone is None else round(time.monotonic() - t0, 2))
    problems = [] if answer.get("outcome") == "ok" else [f"the request in flight got {answer.get('status')} "
                                                          f"{answer.get('outcome')}"]
    if srv.proc.returncode != 0:
        problems.append(f"the front end exited {srv.proc.returncode}, not 0")
    case["ok"], case["problems"] = not problems, problems
    return case


def run_one(run: Run, ckpts: dict, out: str, print_line=print) -> dict:
    """One server of the table: its cases and the command it ran."""
    fault_dir = os.path.join(out, f"{run.name}.faults")
    os.makedirs(fault_dir, exist_ok=True)
    if run.hang_at_start is not None:
        inject.request(fault_dir, run.hang_at_start, "spin", inject.AT_START)
    t0 = time.monotonic()
    srv = _Server(run, ckpts[LAYOUTS[run.layout][0]], out, fault_dir)
    cases: list = []
    try:
        limit = 300 + (STARTUP_S + BACK_S if run.hang_at_start is not None else 0)
        if not srv.wait_ready(limit):
            raise RuntimeError(f"{run.name}: the server did not start; see {srv.log_path}")
        if run.hang_at_start is not None:
            named = "did not start serving within" in srv.log()
            cases.append({"run": run.name, "launch": run.launch, "port": run.port, "layout": run.layout,
                          "fault": "hang at start", "rank": run.hang_at_start, "expected": "started",
                          "back_within_s": STARTUP_S + BACK_S, "up_s": round(time.monotonic() - t0, 2),
                          "ok": named, "problems": [] if named else ["the log does not name the start-up stall"]})
        reference = _greedy(srv.url)
        if reference is None:
            raise RuntimeError(f"{run.name}: the server does not answer; see {srv.log_path}")
        for k in range(len(run.faults)):
            case = _one_fault(run, srv, fault_dir, k, reference)
            cases.append(case)
            print_line(_line(case))
            if not case["ok"] or case["expected"] != "back":
                break
        else:
            if run.launch == "front end" and run.end == "drain":
                cases.append(_drain(run, srv))
                print_line(_line(cases[-1]))
    finally:
        srv.stop()
    return {"name": run.name, "command": srv.command, "max_restarts": run.max_restarts if run.launch == "front end"
            else None, "wall_s": round(time.monotonic() - t0, 1), "cases": cases, "log": srv.log_path}


def _line(case: dict) -> str:
    rank = "" if case["rank"] is None else f" rank {case['rank']}"
    verdict = "ok" if case["ok"] else "FAILED: " + "; ".join(case["problems"])
    return f"serving-cases: {case['run']}: {case['fault']}{rank}: {case['expected']}: {verdict}"


def run_table(ckpts: dict, out: str, names=None, print_line=print) -> dict:
    """The runs of ``TABLE`` (those ``names``, default all) on ``ckpts`` (``load``, ``mla_load``);
    the JSON of the run (schema ``serving_cases/1``)."""
    os.makedirs(out, exist_ok=True)
    t0 = time.monotonic()
    load = os.getloadavg()
    runs = [run_one(run, ckpts, out, print_line) for run in TABLE if names is None or run.name in names]
    return {"schema": "serving_cases/1", "bounds_s": {"stall_timeout": STALL_S, "watchdog_timeout": WATCHDOG_S,
                                                      "startup_timeout": STARTUP_S, "answer_slack": SLACK_S,
                                                      "back": BACK_S, "exit": EXIT_S},
            "load_average": {"before": load, "after": os.getloadavg()}, "wall_s": round(time.monotonic() - t0, 1),
            "runs": runs}


def render_markdown(result: dict) -> str:
    """The table of cases, one row per case, for docs/results/faults.md."""
    rows = ["| run | launch | port | layout | fault | rank | expected | outcome |",
            "|---|---|---|---|---|---:|---|---|"]
    for run in result["runs"]:
        for c in run["cases"]:
            rank = "" if c["rank"] is None else str(c["rank"])
            rows.append(f"| {run['name']} | {c['launch']} | {c['port']} | {c['layout']} | {c['fault']} | {rank} | "
                        f"{EXPECTED[c['expected']]} | {'as expected' if c['ok'] else 'FAILED'} |")
    return "\n".join(rows) + "\n"
