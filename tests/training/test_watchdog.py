"""The training watchdog and the error boundary (issue 31: hung and crashing ranks, errors).

Unit tests drive ``RankWatchdog.check`` by hand on an in-memory store and a fake clock, so no
timing is asserted; the end-to-end cases run torchrun on 2 CPU ranks of ``tools.faults.rank`` with
a fault injected on rank 1 (``tools.faults.inject``) and check what the job did: its exit code, the
one line naming the fault, and (with ``--max-restarts``) that it resumed from its checkpoint and
finished.
"""

import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from megatron.training.watchdog import RankWatchdog, WatchdogConfig
from megatron.common.process import EXIT_WATCHDOG, machine_id
from megatron.common.watchdog import WINDOW
from megatron.common.cli import UserError, run_cli, user_input
from tests.helpers import SMALL_PRETRAIN_ARGS, read_jsonl, torchrun
from tools.faults import inject
from tools.faults.inject import Injector


class DictStore:
    """The c10d store calls the watchdog makes (set/get/check), in memory."""

    def __init__(self):
        self.data = {}
        self.lock = threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        with self.lock:
            return self.data[key]

    def check(self, keys):
        with self.lock:
            return all(k in self.data for k in keys)


class Clock:
    """A fake clock; ``on_next_read`` runs once, inside the next read (another thread's turn at
    that exact instant)."""

    def __init__(self):
        self.now = 100.0
        self.on_next_read = None

    def __call__(self):
        hook, self.on_next_read = self.on_next_read, None
        if hook is not None:
            hook()
        return self.now


class Exited(Exception):
    pass


def _exit(code):
    raise Exited(code)


def _pair(store, clock, **cfg):
    config = WatchdogConfig(**{"heartbeat_timeout_s": 10.0, "step_timeout_s": 20.0, "interval_s": 1.0, **cfg})
    return [RankWatchdog(store, r, 2, config, exit=_exit, clock=clock) for r in (0, 1)]


def test_a_silent_neighbour_is_lost_after_the_timeout_and_every_rank_stops():
    store, clock = DictStore(), Clock()
    w0, w1 = _pair(store, clock)
    for _ in range(3):  # both beat: nothing happens
        clock.now += 1
        w0.check()
        w1.check()
    w0.check()  # rank 0 sees rank 1's last beat
    clock.now += 9.5  # then rank 1 stops beating; 9.5 s < 10 s
    w0.check()
    assert w0.fired is None
    clock.now += 1
    with pytest.raises(Exited) as e:
        w0.check()
    assert e.value.args == (EXIT_WATCHDOG,)
    assert "rank 1" in w0.fired and "no heartbeat" in w0.fired
    assert "rank 1" in store.get("abort").decode()
    # the abort reaches the other ranks after one interval of grace
    w1.check()
    clock.now += 1.5
    with pytest.raises(Exited):
        w1.check()


def test_a_neighbour_that_finished_is_not_lost():
    store, clock = DictStore(), Clock()
    w0, w1 = _pair(store, clock)
    w1.peers.beat()
    w0.check()
    w1.finish()
    clock.now += 60
    w0.check()
    assert w0.fired is None


def test_hung_step_fires_after_the_deadline_but_not_while_paused_and_grows_with_slow_steps():
    store, clock = DictStore(), Clock()
    w0, w1 = _pair(store, clock, heartbeat_timeout_s=0)
    w0.check()  # not armed (start() arms it): no deadline
    clock.now += 1000
    w0.check()
    w0.loop_started(0)
    clock.now += 2
    w0.step_done(1)
    with w0.paused("evaluation"):  # an evaluation longer than the step deadline, within its own
        clock.now += 50
        w0.check()
    clock.now += 19
    w0.check()
    assert w0.fired is None
    clock.now += 2
    with pytest.raises(Exited):
        w0.check()
    assert "no training step finished on rank 0" in w0.fired and "after iteration 1" in w0.fired
    # a slowest step of 8 s makes the deadline 40 s
    w1.loop_started(0)
    clock.now += 1
    w1.step_done(1)
    clock.now += 8
    w1.step_done(2)
    assert w1.step_timeout_s == 40
    clock.now += 30
    w1.check()
    assert w1.fired is None


def test_slow_steady_steps_are_not_hung_and_the_first_step_has_its_own_limit():
    """``--step-timeout 20`` on a job whose steps take 60 s (the first included): the first step,
    from the loop's start to its end, runs under its own limit (10 x 20 s) and scales only the
    second step's; from then on the deadline is 5 x 60 s, capped at ``--max-step-timeout`` (default
    5 x 20 s = 100 s, here also 1000 s); a step that does not end within it is hung. A first step
    that never ends is caught at its limit."""
    for cap, limit in ((None, 100), (1000, 300)):
        store, clock = DictStore(), Clock()
        w0, _ = _pair(store, clock, heartbeat_timeout_s=0, max_step_timeout_s=cap)
        w0.loop_started(0)
        for iteration in (1, 2, 3):
            for _ in range(6):
                clock.now += 10
                w0.check()
            w0.step_done(iteration)
        assert w0.fired is None and w0.step_timeout_s == limit
        clock.now += limit - 1
        w0.check()
        assert w0.fired is None
        clock.now += 2
        with pytest.raises(Exited):
            w0.check()
        assert "after iteration 3" in w0.fired
        assert ("--max-step-timeout; 5 x the slowest recent step is 300.0 s" in w0.fired) == (cap is None)

    first, _ = _pair(DictStore(), clock, heartbeat_timeout_s=0)
    first.loop_started(0)
    clock.now += 199
    first.check()
    assert first.fired is None
    clock.now += 2
    with pytest.raises(Exited):
        first.check()
    assert "the first step may take 10 x --step-timeout 20 s" in first.fired


def test_one_slow_step_raises_the_deadline_only_while_it_is_recent():
    """A first step of 150 s (one-off costs, under its 200 s limit) and later one step of 80 s
    (``--max-step-timeout 1000``): each raises the deadline only while it is recent. Once the
    window of recent steps (``WINDOW``) holds only 2 s steps, a step stuck for 21 s is hung at the
    configured 20 s, not at 5 x 150 s or 5 x 80 s for the rest of the run."""
    store, clock = DictStore(), Clock()
    w0, _ = _pair(store, clock, heartbeat_timeout_s=0, max_step_timeout_s=1000)
    w0.loop_started(0)
    clock.now += 150
    w0.step_done(1)
    assert w0.step_timeout_s == 750  # the second step only
    iteration = 1
    for step_s in [2] * 3 + [80] + [2] * WINDOW:
        clock.now += step_s
        iteration += 1
        w0.step_done(iteration)
        if step_s == 80:
            assert w0.step_timeout_s == 400
    assert w0.step_timeout_s == 20
    clock.now += 21
    with pytest.raises(Exited):
        w0.check()
    assert "limit 20 s: --step-timeout 20 s or 5 x the slowest recent step, 2.0 s" in w0.fired


def test_start_up_saves_and_evaluations_have_their_own_deadlines():
    """Armed at the start (``start`` arms it; here the heartbeat alone, without the thread), a rank
    that does not reach its first step within ``--startup-timeout`` is hung (loading, or waiting
    for a rank that is); a checkpoint save past ``--save-timeout`` (stuck on I/O) and an
    evaluation past ``--eval-timeout`` are too, each named with its flag."""
    cfg = dict(heartbeat_timeout_s=0, startup_timeout_s=300, save_timeout_s=100, eval_timeout_s=50)
    clock = Clock()
    w0, _ = _pair(DictStore(), clock, **cfg)
    w0.steps.arm()
    clock.now += 299
    w0.check()
    assert w0.fired is None
    clock.now += 2
    with pytest.raises(Exited):
        w0.check()
    assert "rank 0 did not reach its first training step in 301.0 s" in w0.fired
    assert "--startup-timeout 300 s" in w0.fired

    _, w1 = _pair(DictStore(), clock, **cfg)  # a job of its own (w0 wrote its abort key)
    w1.steps.arm()
    w1.loop_started(0)
    clock.now += 2
    w1.step_done(1)
    with w1.paused("evaluation"):
        clock.now += 49
        w1.check()
    with w1.paused("checkpoint save"):
        clock.now += 99
        w1.check()
        assert w1.fired is None
        clock.now += 2
        with pytest.raises(Exited):
            w1.check()
    assert "the checkpoint save on rank 1 has taken 101.0 s after iteration 1: it is stuck" in w1.fired
    assert "--save-timeout 100 s" in w1.fired
    w2, _ = _pair(DictStore(), clock, **cfg)
    w2.loop_started(0)
    with w2.paused("evaluation"), pytest.raises(Exited):
        clock.now += 51
        w2.check()
    assert "the evaluation on rank 0 has taken 51.0 s" in w2.fired and "--eval-timeout 50 s" in w2.fired


def test_leaving_a_long_pause_is_never_seen_as_a_hung_step():
    """The watchdog thread checks at any instant, also while the main thread leaves ``paused()``
    after an evaluation longer than the step deadline. Here its round runs inside the clock read
    that restarts the step clock: it must see the pause still on (or over with the clock
    restarted), never over with the clock of before the evaluation."""
    store, clock = DictStore(), Clock()
    w0, _ = _pair(store, clock, heartbeat_timeout_s=0)
    w0.loop_started(0)
    clock.now += 2
    w0.step_done(1)
    with w0.paused("evaluation"):
        clock.now += 50  # > the 20 s step deadline
        w0.check()
        clock.on_next_read = w0.check  # the thread's round, as the pause ends
    assert w0.fired is None
    clock.now += 19
    w0.check()
    assert w0.fired is None
    clock.now += 2
    with pytest.raises(Exited):
        w0.check()


def test_a_failing_rank_publishes_abort_and_is_not_killed_as_a_victim():
    store, clock = DictStore(), Clock()
    w0, w1 = _pair(store, clock)
    w0.check()
    w1.fail("UserError: bad data")
    assert store.get("abort").decode() == "rank 1 failed: UserError: bad data"
    clock.now += 5
    w1.check()  # its own main thread exits with its own code
    w0.check()
    clock.now += 1.5
    with pytest.raises(Exited):
        w0.check()


def test_a_lost_neighbour_on_this_machine_is_killed(tmp_path):
    """A stopped process ignores SIGTERM: the watchdog SIGKILLs it when it is on the same machine."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        store, clock = DictStore(), Clock()
        w0, _ = _pair(store, clock)
        store.set("beat/1", f"1 {victim.pid} {machine_id()} running")
        w0.check()
        os.kill(victim.pid, signal.SIGSTOP)
        clock.now += 11
        with pytest.raises(Exited):
            w0.check()
        assert victim.wait(timeout=30) == -signal.SIGKILL
    finally:
        victim.kill()


@pytest.mark.parametrize("published", ["hostname", "hostname/other boot id"])
def test_a_lost_neighbour_with_this_hostname_on_another_machine_is_not_killed(monkeypatch, published):
    """Containers on different machines may share a hostname: a neighbour's pid is signalled only
    when the machine id it published (hostname, boot id, pid namespace) is this process's own. A
    beat naming only this hostname, or this hostname with another boot id, is lost all the same
    (the job stops) but nothing is killed here."""
    kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))
    host = socket.gethostname()
    machine = host if published == "hostname" else f"{host}/00000000-0000-0000-0000-000000000000/pid:[1]"
    store, clock = DictStore(), Clock()
    w0, _ = _pair(store, clock)
    store.set("beat/1", f"1 {os.getpid() + 1} {machine} running")
    w0.check()
    clock.now += 11
    with pytest.raises(Exited):
        w0.check()
    assert "rank 1" in w0.fired and f"on {host})" in w0.fired
    assert kills == []


def test_fault_requests_are_taken_once_and_only_from_their_step(tmp_path):
    inject.request(str(tmp_path), 1, "error", 3)
    Injector(str(tmp_path), 0)(5)  # another rank's request
    rank1 = Injector(str(tmp_path), 1)
    rank1(2)  # too early
    with pytest.raises(RuntimeError, match="injected fault on rank 1 at step 3"):
        rank1(3)
    rank1(4)  # taken: a restarted job does not repeat it
    with pytest.raises(ValueError, match="fault kind"):
        inject.request(str(tmp_path), 0, "meteor")


def test_the_fault_rank_injects_through_the_loops_step_end_event(tmp_path, monkeypatch):
    """``tools.faults.rank pretrain_gpt ARGS`` is pretrain_gpt with an injector subscribed to the
    training loop's ``STEP_END``: an ``error`` requested for step 2 is raised after step 2 (one
    gloo rank, in-process)."""
    from tests.training.test_reliability import main_in_rank
    from tools.spawn import DistributedTestError, run_distributed

    inject.request(str(tmp_path), 0, "error", 2)
    monkeypatch.setenv(inject.ENV, str(tmp_path))
    argv = ["pretrain_gpt", *map(str, SMALL_PRETRAIN_ARGS), "--train-iters", "4", "--eval-iters", "0",
            "--data-cache-path", str(tmp_path / "cache")]
    with pytest.raises(DistributedTestError, match="RuntimeError: injected fault on rank 0 at step 2"):
        run_distributed(main_in_rank, 1, "tools.faults.rank", argv, timeout_s=240)


def test_only_user_errors_are_one_line(capsys):
    def bad_flag():
        with user_input():
            raise ValueError("--lr must be >= 0, got -1")

    assert run_cli("prog", bad_flag, user_errors=(UserError,)) == 2
    assert capsys.readouterr().err.strip() == "prog: error: --lr must be >= 0, got -1"

    def deep_bug():
        raise ValueError("shape mismatch deep inside a step")

    with pytest.raises(ValueError, match="shape mismatch"):  # keeps its traceback
        run_cli("prog", deep_bug, user_errors=(UserError,))

    def missing():
        with user_input():
            open("/nonexistent/file")

    assert run_cli("prog", missing, user_errors=(UserError,)) == 2
    assert "No such file" in capsys.readouterr().err


# --------------------------------------------------------------------------- end to end (torchrun)


def _train(tmp_path, kind, extra=(), launcher=()):
    fault_dir = tmp_path / "faults"
    fault_dir.mkdir(exist_ok=True)
    inject.request(str(fault_dir), 1, kind, 3)
    args = SMALL_PRETRAIN_ARGS + ["--train-iters", 8, "--expert-model-parallel-size", 2, "--save", tmp_path / "run",
                                  "--data-cache-path", tmp_path / "cache", "--eval-iters", 0,
                                  "--heartbeat-timeout", 5, "--step-timeout", 8, *extra]
    return torchrun("tools.faults.rank", ["pretrain_gpt", *args], env={inject.ENV: str(fault_dir)}, timeout=240,
                    launcher_args=list(launcher))


@pytest.mark.slow
@pytest.mark.parametrize("kind, needle", [
    ("stop", "sent no heartbeat"),  # SIGSTOP: the thread stops too
    ("gil", "sent no heartbeat"),  # native code holding the GIL: the thread cannot run
    ("spin", "no training step finished"),  # a Python loop: the thread beats, the steps stop
])
def test_stalled_rank_ends_the_job_with_the_watchdog_code(tmp_path, kind, needle):
    result = _train(tmp_path, kind)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert needle in out, out[-3000:]
    assert f"exitcode  : {EXIT_WATCHDOG}" in out, out[-3000:]


@pytest.mark.slow
def test_a_save_stuck_on_io_ends_the_job_and_keeps_the_checkpoints_before(tmp_path):
    """From step 3 on, every ``fsync`` of rank 1 blocks as on a hung file system
    (``tools.faults.inject`` ``stuck-io``), so the save at step 4 never completes while both ranks'
    heartbeats go on. ``--save-timeout 5`` ends the job with the watchdog's code and one line naming
    the save and the flag, instead of hanging it; the checkpoint of step 2 stays the newest
    complete one (the latest pointer names it, its manifest verifies) and step 4's is never
    published."""
    from megatron.components.checkpointing import find_latest_checkpoint, verify_checkpoint

    result = _train(tmp_path, "stuck-io", extra=["--save-interval", 2, "--save-timeout", 5])
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert "checkpoint save on rank" in out and "it is stuck" in out and "--save-timeout 5 s" in out, out[-3000:]
    assert f"exitcode  : {EXIT_WATCHDOG}" in out, out[-3000:]
    newest = find_latest_checkpoint(str(tmp_path / "run"))
    assert os.path.basename(newest) == "iter_0000002"
    verify_checkpoint(newest)
    assert not (tmp_path / "run" / "iter_0000004").exists()


@pytest.mark.slow
def test_torchrun_restarts_resume_from_the_checkpoint(tmp_path):
    """``--max-restarts 1`` with ``--save D --load D``: a stopped rank ends the first attempt; the
    second resumes from D's checkpoint (saved every step) and finishes all 8 steps."""
    run = tmp_path / "run"
    result = _train(tmp_path, "stop", extra=["--load", run, "--save-interval", 1], launcher=["--max-restarts=1"])
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "sent no heartbeat" in out
    starts = [int(line.rsplit("starting at iteration ", 1)[1].split(";")[0].split()[0])
              for line in out.splitlines() if "starting at iteration" in line]
    assert starts[0] == 0 and starts[-1] >= 2, starts  # the second attempt resumed from a checkpoint
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "event" not in r]
    assert steps[-1] == 8 and set(steps) == set(range(1, 9))


@pytest.mark.slow
def test_async_save_in_the_training_loop_resumes_exactly(tmp_path):
    """``--async-save`` through pretrain_gpt: the checkpoints complete (one in flight at a time,
    finished at the next save and at the end), and a run resumed from the async checkpoint at step
    3 logs the same losses for steps 4-6 as the uninterrupted run (exact up to 1e-6: the same
    weights, optimizer, data position and RNG are restored; summation order is fixed on CPU)."""
    common = SMALL_PRETRAIN_ARGS + ["--expert-model-parallel-size", 2, "--data-cache-path", tmp_path / "cache",
                                    "--eval-iters", 0, "--save-interval", 3, "--async-save", "--lr-decay-iters", 6]
    full = tmp_path / "full"
    result = torchrun("megatron.training.pretrain_gpt", common + ["--train-iters", 6, "--save", full])
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in full.glob("iter_*")) == ["iter_0000003", "iter_0000006"]
    part = tmp_path / "part"
    result = torchrun("megatron.training.pretrain_gpt", common + ["--train-iters", 3, "--save", part])
    assert result.returncode == 0, result.stderr[-3000:]
    result = torchrun("megatron.training.pretrain_gpt",
                      common + ["--train-iters", 6, "--save", part, "--load", part])
    assert result.returncode == 0, result.stderr[-3000:]
    want = {r["step"]: r["lm_loss"] for r in read_jsonl(full / "metrics.jsonl") if "event" not in r}
    got = {r["step"]: r["lm_loss"] for r in read_jsonl(part / "metrics.jsonl") if "event" not in r}
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], abs=1e-6), step
