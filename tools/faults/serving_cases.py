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

- every fault: ``/health`` stops answering 200 within ``answer_s``;
- ``held`` (the front end with a restart left, a non-streamed request in flight: a greedy one and
  one sampled with a seed): the requests are held and answered 200 by the restarted engine with the
  tokens they gave before the first fault (exact), each sent to it again (``/metrics``); then as
  ``back``;
- ``back`` (the front end with a restart left, a streamed request in flight, the fault once its
  stream has started): the stream ends with an error event (a stopped rank named) within
  ``answer_s``; then the same URL answers again within ``BACK_S`` with the greedy tokens it gave
  before the first fault (exact);
- ``error``: the request in flight gets a clean 503 (its JSON error; a stopped rank named) within
  ``answer_s``, then the launcher exits non-zero within ``EXIT_S`` (plus torchrun's fixed 30 s for a
  stopped rank);
- ``no restart left``: the 503, then the front end exits non-zero saying so;
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
from tools.faults.serving_chaos import complete, resubmitted

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
EXPECTED = {"held": "the request in flight held, then answered with its fault-free tokens; the same URL "
                    "answers with the same greedy tokens",
            "back": "an error event in the started stream, then the same URL answers with the same greedy tokens",
            "error": "503, then the launcher exits non-zero",
            "no restart left": "503, then the front end exits non-zero: no restart left",
            "started": "up after --startup-timeout and a restart",
            "drained": "the request in flight completes (200), exit 0"}
LAYOUTS = {"EP 2": ("load", ["--expert-model-parallel-size", "2"]),
           "TP 2": ("load", ["--tensor-model-parallel-size", "2"]),
           "MLA EP 2": ("mla_load", ["--expert-model-parallel-size", "2"])}
PROMPT = "First Citizen:"
SEEDED = {"temperature": 1.5, "seed": 7}  # the sampled request held across a restart
# what the 503 of a stopped rank names, by who notices it: the front end (rank 0's link silent, or a
# stopped process found below torchrun) or rank 0's watchdog; other faults: any message
STOPPED = {("front end", 0): ("rank 0 of the engine (pid {pid}) sent nothing for",
                              "rank 0 (pid {pid}) of the engine is stopped (SIGSTOP)"),
           ("front end", 1): ("rank 1 (pid {pid}) of the engine is stopped (SIGSTOP)",),
           ("torchrun", 1): ("a rank is stopped, hung or dead",)}


@dataclasses.dataclass(frozen=True)
class Run:
    """One server: its flags (``launch``, ``port``, ``layout``) and its faults, ``(kind, rank)`` in
    order; ``hang_at_start``: a rank that spins before it loads anything (front end runs only);
    ``held``: the faults (indices) at which non-streamed requests are in flight, to be held."""

    name: str
    launch: str
    port: str
    layout: str
    faults: tuple
    hang_at_start: Optional[int] = None
    end: Optional[str] = "drain"  # front end runs: SIGTERM, "no restart left" after the last fault, or None
    held: tuple = ()

    @property
    def max_restarts(self) -> int:
        needed = len(self.faults) + (self.hang_at_start is not None)
        return needed - 1 if self.end == "no restart left" else needed

    def expected(self, k: int) -> str:
        """What the ``k``-th fault should lead to."""
        if self.launch == "torchrun":
            return "error"
        if self.end == "no restart left" and k == len(self.faults) - 1:
            return "no restart left"
        return "held" if k in self.held else "back"

    @property
    def num_cases(self) -> int:
        """The cases it records when every one goes as expected."""
        return len(self.faults) + (self.hang_at_start is not None) + (self.launch == "front end" and self.end == "drain")


# every pair of factor values at least once (missing_pairs): 14 faults in 7 servers
TABLE = (
    Run("readme-fixed-port", "front end", "fixed", "EP 2", (("kill9", 1), ("sigstop", 0), ("sigstop", 1)),
        held=(0,)),
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


def _requests(srv: _Server, expected: str, prompts: int = 64, max_tokens: Optional[int] = None) -> list:
    """What is in flight at a fault expected to end as ``expected``: long requests (default 64
    prompts filling their context); for ``held`` a greedy and a seeded sampled one (non-streamed);
    for ``back`` a stream."""
    budget = max_tokens or min(srv.info["context_length"], srv.info["max_request_tokens"]) - 8
    if expected == "held":
        return [{"i": 0, "prompt": PROMPT, "max_tokens": budget, "stream": False},
                {"i": 1, "prompt": PROMPT, "max_tokens": budget, "stream": False, "sampling": SEEDED}]
    if expected == "back":
        return [{"i": 0, "prompt": ["Hello"] * 4, "max_tokens": budget, "stream": True}]
    return [{"i": 0, "prompt": ["Hello"] * prompts, "max_tokens": budget, "stream": False}]


class _Client(threading.Thread):
    """One request sent now; ``answer`` is ``complete``'s, with ``at`` (monotonic) when it ended."""

    def __init__(self, url: str, req: dict):
        super().__init__(daemon=True)
        self.url, self.req = url, req
        self.answer: dict = {}
        self.started = threading.Event()  # a stream's first event arrived
        self.start()

    def run(self):
        self.answer.update(complete(self.url, self.req, 120, self.started))
        self.answer["at"] = time.monotonic()


def _in_flight(srv: _Server, expected: str, **kw) -> list:
    """The requests ``_requests`` gives, in the engine: a stream once it has started, the others
    after 0.5 s."""
    clients = [_Client(srv.url, req) for req in _requests(srv, expected, **kw)]
    if expected == "back":
        clients[0].started.wait(60)
    else:
        time.sleep(0.5)
    return clients


def _answers(srv: _Server, expected: str) -> list:
    clients = [_Client(srv.url, req) for req in _requests(srv, expected)]
    for client in clients:
        client.join(120)
    return [client.answer for client in clients]


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


def _answer_bound(run: Run, kind: str, expected: str) -> float:
    if expected == "held":
        return BACK_S + SLACK_S  # answered by the restarted engine
    if kind != "sigstop":
        return SLACK_S
    return (STALL_S if run.launch == "front end" else WATCHDOG_S) + SLACK_S


def _watch_health(url: str, out: dict, back: bool) -> None:
    """``out["down"]``, then (``back``) ``out["up"]``: when ``/health`` stopped answering 200, and
    answered 200 again (monotonic)."""
    if _wait(lambda: health_status(url) != 200, 120) is None:
        return
    out["down"] = time.monotonic()
    if back and _wait(lambda: health_status(url) == 200, BACK_S) is not None:
        out["up"] = time.monotonic()


def _one_fault(run: Run, srv: _Server, fault_dir: str, k: int, reference: dict) -> dict:
    kind, rank = run.faults[k]
    expected = run.expected(k)
    back = expected in ("held", "back")
    case = {"run": run.name, "launch": run.launch, "port": run.port, "layout": run.layout, "fault": kind,
            "rank": rank, "expected": expected, "answer_within_s": _answer_bound(run, kind, expected)}
    before = resubmitted(srv.url) if expected == "held" else None
    clients = _in_flight(srv, expected)
    t0 = time.monotonic()
    pid = _fault(srv, fault_dir, kind, rank)
    health: dict = {}
    poller = threading.Thread(target=_watch_health, args=(srv.url, health, back), daemon=True)
    poller.start()
    for client in clients:
        client.join(BACK_S + 120)
    poller.join(BACK_S + 120)
    answers = [client.answer for client in clients]
    case["health_not_ok_s"] = round(health["down"] - t0, 2) if "down" in health else None
    case["answered_s"] = round(max(a["at"] for a in answers) - t0, 2) if all("at" in a for a in answers) else None
    case["status"], case["message"] = answers[0].get("status"), answers[0].get("message", "")[:300]
    got = ", ".join(f"{a.get('status')} {a.get('outcome')}" for a in answers)
    problems = []
    if expected == "held":
        case["in_flight_same_tokens"] = [a.get("tokens") == r for a, r in zip(answers, reference["held"])]
        case["resubmitted"] = (resubmitted(srv.url) or 0) - (before or 0)
        if any(a.get("outcome") != "ok" for a in answers):
            problems.append(f"the requests in flight got {got}, not 200")
        elif not all(case["in_flight_same_tokens"]):
            problems.append("the requests in flight were answered with other tokens than before the fault")
        if case["resubmitted"] < len(answers):
            problems.append(f"{case['resubmitted']} engine requests resubmitted, not {len(answers)}")
    elif expected == "back" and not (case["status"] == 200 and answers[0].get("outcome") == "error"
                                     and case["message"]):
        problems.append(f"the started stream got {got}, not an error event")
    elif expected != "back" and (case["status"] != 503 or not case["message"]):
        problems.append(f"the request in flight got {got}, not a clean 503")
    if not problems and case["answered_s"] > case["answer_within_s"]:
        problems.append(f"answered after {case['answered_s']} s > {case['answer_within_s']} s")
    # a stopped rank is named in the error the client got, or, for a held request, in the front end's log
    said = srv.log() if expected == "held" else case["message"]
    if not problems and kind == "sigstop" and not any(m.format(pid=pid) in said for m in STOPPED[run.launch, rank]):
        problems.append(f"the stopped rank is not named: {said[-300:]!r}")
    if case["health_not_ok_s"] is None or case["health_not_ok_s"] > _answer_bound(run, kind, "error"):
        problems.append(f"/health still 200 {case['health_not_ok_s']} s after the fault")
    if back:
        case["back_within_s"] = BACK_S
        case["back_s"] = round(health["up"] - t0, 2) if "up" in health else None
        tokens = _greedy(srv.url) if case["back_s"] is not None else None
        case["same_tokens"] = tokens == reference["greedy"]
        if case["back_s"] is None:
            problems.append(f"not answering again within {BACK_S:g} s")
        elif not case["same_tokens"]:
            problems.append(f"greedy tokens {tokens} differ from {reference['greedy']}")
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
    client, = _in_flight(srv, "drained", prompts=4, max_tokens=16)  # done well within --shutdown-timeout
    answer = client.answer
    t0 = time.monotonic()
    os.kill(srv.proc.pid, signal.SIGTERM)
    client.join(120)
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
        reference = {"greedy": _greedy(srv.url)}
        if reference["greedy"] is None:
            raise RuntimeError(f"{run.name}: the server does not answer; see {srv.log_path}")
        if run.held:  # what the requests held across a restart must be answered with
            answers = _answers(srv, "held")
            if any(a["outcome"] != "ok" for a in answers):
                raise RuntimeError(f"{run.name}: the server does not answer; see {srv.log_path}")
            reference["held"] = [a["tokens"] for a in answers]
        for k in range(len(run.faults)):
            case = _one_fault(run, srv, fault_dir, k, reference)
            cases.append(case)
            print_line(_line(case))
            if not case["ok"] or case["expected"] not in ("held", "back"):
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
