"""End to end under torchrun (2 CPU ranks): ranks and launchers killed with SIGKILL (issue 22).

A rank killed with -9 leaves no process behind (the checkpoint writer runs inside the rank: no
Manager server, resource tracker or forked writer to orphan); a launcher killed with -9 does not
leave its ranks training unattended: they get SIGTERM from the kernel (``PR_SET_PDEATHSIG``),
save and exit, releasing the save directory's lock. Nothing asserts on timing; waits are bounded
generously and every process started is killed at the end.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import SMALL_PRETRAIN_ARGS, read_jsonl

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE = "megatron.training.pretrain_gpt"


def _launch(tmp_path, save):
    args = SMALL_PRETRAIN_ARGS + ["--train-iters", 1000, "--expert-model-parallel-size", 2, "--save-interval", 1,
                                  "--save", save, "--data-cache-path", tmp_path / "cache", "--eval-iters", 0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "-m", MODULE, *map(str, args)]
    log = open(tmp_path / "torchrun.log", "w")  # a file, not a pipe: orphaned ranks must never block on it
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO),
                            stdout=log, stderr=subprocess.STDOUT)


def _wait_for_saves(save, count=2, timeout=150):
    """Until ``count`` checkpoints are recorded, then (best effort) until a save is in progress."""
    metrics = save / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and sum(r.get("event") == "checkpoint" for r in read_jsonl(metrics)) >= count:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the run recorded no checkpoints")
    until = time.time() + 10
    while time.time() < until:
        if any(n.startswith(".tmp-iter_") for n in os.listdir(save)):
            return True
        time.sleep(0.02)
    return False


def _reap(procs):
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def test_sigkill_of_a_rank_leaves_no_orphan_and_no_half_checkpoint(tmp_path):
    from megatron.components.checkpointing import find_latest_checkpoint, read_manifest

    save = tmp_path / "run"
    launcher = _launch(tmp_path, save)
    ranks, family = [], []
    try:
        _wait_for_saves(save)
        ranks = psutil.Process(launcher.pid).children()
        assert len(ranks) == 2
        family = ranks + [c for r in ranks for c in r.children(recursive=True)]
        helpers = [c.pid for c in family if c not in ranks]
        ranks[1].send_signal(signal.SIGKILL)
        launcher.wait(timeout=120)
        gone, alive = psutil.wait_procs(family, timeout=60)
        assert not alive, f"still running after their rank died: {[(p.pid, p.cmdline()[:3]) for p in alive]}"
        assert helpers == []  # nothing was started besides the ranks themselves
    finally:
        _reap(family)
        if launcher.poll() is None:
            launcher.kill()
    newest = find_latest_checkpoint(str(save))  # the newest iter_N is complete (a killed save left only .tmp-)
    read_manifest(newest, verify=True)


def test_sigkill_of_the_launcher_stops_its_ranks_with_a_checkpoint(tmp_path):
    save = tmp_path / "run"
    launcher = _launch(tmp_path, save)
    ranks = []
    try:
        _wait_for_saves(save)
        ranks = psutil.Process(launcher.pid).children()
        assert len(ranks) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        gone, alive = psutil.wait_procs(ranks, timeout=90)
        assert not alive, "ranks kept training after their launcher died"
    finally:
        _reap(ranks)
    records = read_jsonl(save / "metrics.jsonl")
    summary = [r for r in records if r.get("event") == "summary"]
    assert summary and summary[-1]["interrupted"] is True and summary[-1]["signal"] == "SIGTERM"
    step = summary[-1]["iteration"]
    assert [r for r in records if r.get("event") == "checkpoint"][-1]["step"] == step
    assert (save / f"iter_{step:07d}" / "manifest.json").exists()
    assert not (save / "writer.lock").exists()  # released: a restarted run is not refused
