"""``python -m tools.faults training [--out DIR] [--cases all|ranks]``: faults in training, end to
end on the tiny default (``examples/tiny_moe_cpu.yaml``, 2 CPU ranks under torchrun), one line per
case:

    <case> | survived|FAILED | lost steps: N | <what happened / the error line>

Cases: kill -9 a rank during a save; kill -9 the launcher during a save; SIGTERM the launcher; a
corrupt newest checkpoint; a reused ``--save`` directory; a crafted ``.metadata``; then (``--cases
ranks`` runs only these) a rank that is stopped (SIGSTOP from here), stuck in native code holding
the GIL, spinning in Python, segfaults, aborts or raises (``tools.faults.inject``, through
``tools.faults.rank``), each under ``torchrun --max-restarts=1``: the job must notice, restart
and finish. "lost steps" is the number of trained steps not in the checkpoint the next run
resumes from. A case survives when no process outlived the run, nothing was half-written where a
run would load it, the resumed run (if any) finished, and every refusal was one line. A few
minutes on 2 cores; the runs and their logs stay in ``--out`` (default: a new temporary
directory).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import pickle
import re
import signal
import subprocess
import time

from tools.faults import inject
from tools.faults.launch import Launches, agent_failures, attempts, descendants, rank_pid, read, still_alive

__all__ = ["Case", "run_cases", "RANK_FAULTS"]

PRETRAIN = ["megatron.training.pretrain_gpt"]
FAULT_RANK = ["tools.faults.rank", "pretrain_gpt"]
TRAIN = ["--config", "examples/tiny_moe_cpu.yaml", "--log-interval", 1, "--eval-interval", 1000, "--eval-iters", 1]
WATCH = ["--heartbeat-timeout", 10, "--step-timeout", 20]
RANK_FAULTS = ("stop", "gil", "spin", "segfault", "abort", "error")  # stop: SIGSTOP from here
FAULT_AT = 4  # the step after which rank 1 takes its fault
RANK_FAULT_ITERS = 30


@dataclasses.dataclass
class Case:
    name: str
    ok: bool
    lost: int
    note: str

    def line(self) -> str:
        return f"{self.name} | {'survived' if self.ok else 'FAILED'} | lost steps: {self.lost} | {self.note}"


class Runs(Launches):
    """Training launches into ``out/<name>`` with the shared flags and data cache."""

    def train_args(self, save: str, *args) -> list:
        return [*TRAIN, "--data-cache-path", os.path.join(self.out, "data_cache"), "--save", save, *args]

    def save_dir(self, name: str) -> str:
        return os.path.join(self.out, name)


def _metrics(save: str) -> list:
    path = os.path.join(save, "metrics.jsonl")
    return [json.loads(line) for line in read(path).splitlines() if line.strip()]


def checkpoints(save: str) -> int:
    """Checkpoint events in the run's metrics."""
    return sum(r.get("event") == "checkpoint" for r in _metrics(save))


def wait_for_checkpoints(save: str, count: int = 2, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while checkpoints(save) < count and time.monotonic() < deadline:
        time.sleep(0.1)


def wait_for_save(save: str) -> str:
    """After two checkpoints, until a save is in progress (best effort): "during a save" when one
    was caught, else "between saves"."""
    wait_for_checkpoints(save)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if glob.glob(os.path.join(save, ".tmp-iter_*")):
            return "during a save"
        time.sleep(0.02)
    return "between saves"


def state(save: str) -> tuple:
    """(last trained step, newest complete checkpoint's iteration or -1)."""
    import logging

    from megatron.components.checkpointing import CheckpointError, find_latest_checkpoint, read_manifest

    steps = [r["step"] for r in _metrics(save) if "event" not in r]
    logging.disable(logging.WARNING)
    try:
        path = find_latest_checkpoint(save)
        saved = read_manifest(path, verify=True)["iteration"] if path else -1
    except CheckpointError:
        saved = -1
    finally:
        logging.disable(logging.NOTSET)
    return max(steps, default=0), saved


def error_line(log: str) -> str:
    """The run's one-line error, or "(none)"."""
    m = re.search(r"^(?:\[rank\d+\]: )?(pretrain_gpt: error: .*)$", read(log), re.M)
    return m[1] if m else "(none)"


def _resume(runs: Runs, name: str, save: str, saved: int) -> tuple:
    """Two more steps from ``save``'s newest checkpoint: (ok, the resume's log)."""
    code = runs.run(f"{name}.resume", PRETRAIN, runs.train_args(save, "--load", save, "--train-iters", saved + 2))
    log = os.path.join(runs.out, f"{name}.resume.log")
    return code == 0, log


# ---------------------------------------------------------------------------------- kill -9 a rank
def kill_rank(runs: Runs) -> Case:
    save = runs.save_dir("kill_rank")
    proc, _ = runs.start("kill_rank", PRETRAIN, runs.train_args(save, "--train-iters", 400, "--save-interval", 3))
    during = wait_for_save(save)
    family = descendants(proc.pid)
    os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)
    proc.wait()
    left = still_alive(family)
    last, saved = state(save)
    note = f"rank killed {during} at step {last}; resumed from iter {saved}"
    ok = not left and saved >= 0
    if left:
        note += f"; processes left: {left}"
    resumed, log = _resume(runs, "kill_rank", save, saved)
    if not resumed:
        ok, note = False, note + f"; resume failed: {error_line(log)}"
    return Case("kill -9 a rank during a save", ok, last - saved, note)


# ------------------------------------------------------------------------------ kill -9 the launcher
def kill_launcher(runs: Runs) -> Case:
    save = runs.save_dir("kill_launcher")
    proc, _ = runs.start("kill_launcher", PRETRAIN,
                         runs.train_args(save, "--train-iters", 400, "--save-interval", 3))
    during = wait_for_save(save)
    ranks = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = still_alive(ranks)
    last, saved = state(save)
    note = f"launcher killed {during}; its ranks stopped on the kernel's SIGTERM and saved iter {saved}"
    ok = not left
    if left:
        note = f"ranks still training: {left}"
    if os.path.exists(os.path.join(save, "writer.lock")):
        ok, note = False, note + "; writer.lock left"
    resumed, log = _resume(runs, "kill_launcher", save, saved)
    if not resumed:
        ok, note = False, note + f"; resume failed: {error_line(log)}"
    return Case("kill -9 the launcher during a save", ok, last - saved, note)


# ------------------------------------------------------------------------------- SIGTERM the launcher
def sigterm(runs: Runs) -> Case:
    save = runs.save_dir("sigterm")
    proc, log = runs.start("sigterm", PRETRAIN, runs.train_args(save, "--train-iters", 400, "--save-interval", 3))
    during = wait_for_save(save)
    ranks = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait()
    left = still_alive(ranks)
    last, saved = state(save)
    text = read(log)
    closing = re.search(r"stopped by SIGTERM at iteration \d+.*exit code \d+\)", text)
    ok = closing is not None
    note = f"{during}: " + re.sub(r"; metrics.*resume", "; resume", closing[0]) if closing else "no closing line"
    if "BrokenPipeError" in text:
        ok, note = False, note + "; BrokenPipeError"
    if left:
        ok, note = False, note + f"; processes left: {left}"
    resumed, _ = _resume(runs, "sigterm", save, saved)
    if not resumed:
        ok, note = False, note + "; resume failed"
    return Case("SIGTERM the launcher", ok, last - saved, note)


# ------------------------------------------------------------------------- corrupt newest checkpoint
def corrupt(runs: Runs) -> Case:
    save = runs.save_dir("corrupt")
    ok = runs.run("corrupt", PRETRAIN, runs.train_args(save, "--train-iters", 6, "--save-interval", 3)) == 0
    newest = sorted(glob.glob(os.path.join(save, "iter_*")))[-1]
    shard = sorted(glob.glob(os.path.join(newest, "*.distcp")))[0]
    os.truncate(shard, os.path.getsize(shard) // 2)
    if runs.run("corrupt.resume", PRETRAIN, runs.train_args(save, "--load", save, "--train-iters", 8)) == 0:
        ok = False
    err = error_line(os.path.join(runs.out, "corrupt.resume.log"))
    name = os.path.basename(newest)
    ok = ok and f"{name} is corrupt" in err
    fallback = runs.train_args(save, "--load", save, "--train-iters", 8, "--load-fallback")
    ok = runs.run("corrupt.fallback", PRETRAIN, fallback) == 0 and ok
    ok = ok and bool(glob.glob(newest + ".corrupt-*"))  # moved aside, not deleted
    m = re.search(r"starting at iteration (\d+)", read(os.path.join(runs.out, "corrupt.fallback.log")))
    start = int(m[1]) if m else -1
    return Case("corrupt newest checkpoint", ok, int(name.removeprefix("iter_")) - start,
                f"{err}; --load-fallback resumed from iter {start}, {name} moved aside")


# ---------------------------------------------------------------------------------- reuse a save dir
def _listing(directory: str) -> list:
    return sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(directory))


def reuse(runs: Runs) -> Case:
    save = runs.save_dir("reuse")
    ok = runs.run("reuse", PRETRAIN, runs.train_args(save, "--train-iters", 3)) == 0
    before = _listing(save)
    if runs.run("reuse.again", PRETRAIN, runs.train_args(save, "--train-iters", 3, "--num-layers", 2)) == 0:
        ok = False
    log = os.path.join(runs.out, "reuse.again.log")
    err = error_line(log)
    ok = ok and before == _listing(save) and "--overwrite-save" in err
    ok = ok and not re.search(r"^iter ", read(log), re.M)  # refused before training
    return Case("reuse a save dir", ok, 0, err)


# ----------------------------------------------------------------------------------- crafted .metadata
class _Payload:
    """Unpickling it runs a shell command (what a crafted checkpoint would do)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def crafted(runs: Runs) -> Case:
    save = runs.save_dir("crafted")
    marker = os.path.join(runs.out, "crafted.PWNED")
    if os.path.exists(marker):
        os.remove(marker)
    ok = runs.run("crafted", PRETRAIN, runs.train_args(save, "--train-iters", 3)) == 0
    ckpt = os.path.join(save, "iter_0000003")
    data = pickle.dumps(_Payload(f"touch {marker}"))
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        f.write(data)
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    if runs.run("crafted.resume", PRETRAIN, runs.train_args(save, "--load", save, "--train-iters", 5)) == 0:
        ok = False
    err = error_line(os.path.join(runs.out, "crafted.resume.log"))
    ok = ok and not os.path.exists(marker) and "unsafe checkpoint" in err
    if os.path.exists(marker):
        err += " (the payload RAN)"
    return Case("crafted .metadata", ok, 0, err)


# ---------------------------------------------------- stopped, stuck, crashing ranks (the watchdog)
def rank_fault(runs: Runs, kind: str) -> Case:
    """torchrun --max-restarts=1 with --save D --load D: the fault ends the first attempt, the
    second resumes from D's newest checkpoint and finishes. "detected" is the time from the fault
    (the injecting rank's clock, or this process's SIGSTOP) to torchrun seeing the first rank exit."""
    save = runs.save_dir(f"fault_{kind}")
    fault_dir = save + ".faults"
    os.makedirs(fault_dir, exist_ok=True)
    if kind != "stop":
        inject.request(fault_dir, 1, kind, FAULT_AT)
    args = runs.train_args(save, *WATCH, "--load", save, "--train-iters", RANK_FAULT_ITERS, "--save-interval", 2)
    proc, log = runs.start(f"fault_{kind}", FAULT_RANK, args, launcher=["--max-restarts=1"],
                           env={inject.ENV: fault_dir})
    at = None
    if kind == "stop":
        wait_for_checkpoints(save)
        os.kill(rank_pid(proc.pid, 1), signal.SIGSTOP)
        at = time.time()
    try:
        code = proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        runs.kill(proc)
        code = 124
    text = read(log)
    if at is None:
        m = re.search(rf"injecting fault '{kind}' after step \d+ at ([\d.]+)", text)
        at = float(m[1]) if m else None
    failed = agent_failures(text)
    last, _ = state(save)
    ok = code == 0 and last == RANK_FAULT_ITERS
    note = "" if code == 0 else f"exit code {code}; "
    if at is not None and failed:
        detected = f"{failed[0] - at:.1f}"
    else:
        ok, detected, note = False, "?", note + "no fault or no failure seen; "
    why = re.search(r"sent no heartbeat for [\d.]+ s|no training step finished on rank \d+ for [\d.]+ s|"
                    r"Fatal Python error: [A-Za-z ]+|RuntimeError: injected fault on rank \d+", text)
    logged = attempts(text)
    start = re.findall(r"starting at iteration (\d+)", text)
    note += (f"detected in {detected} s ({why[0] if why else 'no reason found'}); restarted from iter "
             f"{start[-1] if start else '?'}, finished at {last}")
    before = logged[0][-1] if logged and logged[0] else 0  # the last step the first attempt logged
    return Case(f"rank fault: {kind}", ok, before - int(start[-1] if start else 0), note)


SAVE_CASES = (kill_rank, kill_launcher, sigterm, corrupt, reuse, crafted)


def run_cases(out: str, *, ranks_only: bool = False, print_line=print) -> list:
    """Every case in order (``ranks_only``: the rank faults), each line printed as it completes."""
    runs = Runs(out)
    cases = []
    try:
        for case in () if ranks_only else SAVE_CASES:
            cases.append(case(runs))
            print_line(cases[-1].line())
        for kind in RANK_FAULTS:
            cases.append(rank_fault(runs, kind))
            print_line(cases[-1].line())
    finally:
        runs.close()
    return cases
