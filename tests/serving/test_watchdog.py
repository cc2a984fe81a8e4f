"""The serving loop's liveness with a fake clock: the real ``serve_loop`` on a one-rank gloo group
drives an engine whose steps advance the clock, and ``/health`` (``Frontend.health``) and the
watchdog (``StallWatchdog.check``) are read in the middle of each step. Nothing waits on real
time, so nothing here depends on the machine's speed."""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from megatron.common.watchdog import WINDOW, Heartbeat
from megatron.inference import protocol
from megatron.inference.engine import STAT_FIELDS, TokenUpdate
from megatron.inference.frontend import Commands, Frontend, FrontendConfig, Submit
from megatron.inference.loop import serve_loop
from megatron.inference.sampling import RequestSampling
from megatron.inference.watchdog import StallWatchdog
from megatron.components.parallel import single_process_group


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class TimedEngine:
    """The calls ``serve_loop`` makes on a rank engine, for one request whose engine steps take
    ``step_s`` (fake) seconds each; ``probe(step)`` runs 1 s before each step ends."""

    activations = None

    def __init__(self, clock: Clock, step_s: list, probe):
        self.clock, self.step_s, self.probe = clock, step_s, probe
        self.steps = self.dummy_steps = 0
        self.work = 0
        self.controller = types.SimpleNamespace(tokenizer=types.SimpleNamespace(eod=0))

    def local_work(self):
        return self.work

    def stats(self):
        return dict.fromkeys(STAT_FIELDS, 0)

    def add(self, request_id, prompt, **kwargs):
        self.request_id, self.work = request_id, 1

    def step(self):
        self.clock.now += self.step_s[self.steps] - 1
        self.probe(self.steps)
        self.clock.now += 1
        self.steps += 1
        done = self.steps == len(self.step_s)
        self.work = 0 if done else 1
        return [TokenUpdate(self.request_id, [7], finished=done)], True

    def dummy_step(self):
        self.dummy_steps += 1

    def cancel(self, request_id):
        return None


class OneRequest:
    """Rank 0's frontend as the loop sees it: one request, then stop."""

    def __init__(self):
        self.sent = False

    def take_commands(self, wait_s):
        if self.sent:
            return Commands(stop=True)
        self.sent = True
        return Commands(submits=[Submit(0, [1, 2], 8, RequestSampling())])

    def assigned(self, placed):
        pass

    def publish(self, updates, stats):
        pass


def _serve(step_s, *, stall_timeout=30.0, watchdog_timeout=60.0, **caps):
    """Serve one request whose steps take ``step_s``; (health status, watchdog fired) during each
    step, and the watchdog's reasons. ``caps``: ``max_stall_timeout``, ``max_watchdog_timeout``."""
    clock = Clock()
    heartbeat = Heartbeat(clock)
    limits = protocol.Limits(context=64, vocab_size=16)
    health = Frontend(tokenizer=None, chat_render=None, heartbeat=heartbeat,
                      config=FrontendConfig(served_model="m", limits=limits, stall_timeout=stall_timeout,
                                            max_stall_timeout=caps.get("max_stall_timeout")))
    reasons = []
    watchdog = StallWatchdog(heartbeat, watchdog_timeout, lambda age, why: reasons.append((age, why)),
                             max_timeout_s=caps.get("max_watchdog_timeout"))
    seen = []

    def probe(step):
        seen.append((health.health()[0], watchdog.check()))

    with single_process_group():
        world = dist.group.WORLD
        pgc = types.SimpleNamespace(dp=world, tp=world, ep=world)
        serve_loop(TimedEngine(clock, step_s, probe), pgc, frontend=OneRequest(), heartbeat=heartbeat)
    return seen, reasons


def test_a_slow_step_after_slow_steps_is_not_a_stall():
    """Steps of 15 s, then one of 70 s: longer than --stall-timeout 30 and --watchdog-timeout 60,
    shorter than what the 15 s steps grew them to (5 x 15 = 75 s, 10 x 15 = 150 s): /health stays
    200 and the watchdog does not fire."""
    seen, reasons = _serve([15, 15, 15, 70])
    assert seen == [(200, False)] * 4 and reasons == []


def test_the_grown_limits_are_capped():
    """After steps of up to 70 s the limits would grow to 350 s (/health) and 700 s (watchdog); they
    stop at their caps, 5 x --stall-timeout and 10 x --watchdog-timeout by default (150 s and 600
    s), or the --max-* flags: a step still running at 799 s (or 299 s) is reported stalled and fires
    the watchdog, whose reason names the cap."""
    seen, reasons = _serve([15, 70, 800])
    assert seen[:2] == [(200, False)] * 2 and seen[2] == (503, True)
    (age, why), = reasons
    assert age == pytest.approx(799)
    assert why == "limit 600 s: --max-watchdog-timeout (10 x the longest recent step is 700.0 s)"

    seen, reasons = _serve([15, 70, 300], max_stall_timeout=100, max_watchdog_timeout=200)
    assert seen == [(200, False), (200, False), (503, True)]
    assert reasons[0][1] == "limit 200 s: --max-watchdog-timeout (10 x the longest recent step is 700.0 s)"


def test_a_slow_step_raises_the_limits_only_while_it_is_recent():
    """One 70 s step, then enough 1 s steps to push it out of the window of recent intervals
    (``WINDOW``; each step is three intervals: all-gather, step start, step end): the limits are the
    configured ones again, and a step stuck for 99 s is caught by the 60 s watchdog instead of the
    700 s that the one slow step would have left for the life of the process."""
    seen, reasons = _serve([15, 70] + [1] * WINDOW + [100])
    assert seen[:-1] == [(200, False)] * (len(seen) - 1) and seen[-1] == (503, True)
    (age, why), = reasons
    assert age == pytest.approx(99) and why == "limit 60 s: --watchdog-timeout 60 or 10 x the longest recent step, 1.0 s"


def test_a_first_step_past_the_configured_limits_is_caught():
    """With no slower step seen, the configured limits hold."""
    seen, reasons = _serve([62])
    assert seen == [(503, True)] and len(reasons) == 1


def test_start_up_has_its_own_deadline():
    """A heartbeat armed at process start and never ticked (a rank loading, or waiting for a rank
    that is stopped while loading): /health says ``starting`` throughout, and the watchdog fires
    once ``--startup-timeout`` has passed, naming it; with 0 it never does. After the first tick
    the configured limits apply."""
    clock = Clock()
    heartbeat = Heartbeat(clock)
    heartbeat.arm()
    health = Frontend(tokenizer=None, chat_render=None, heartbeat=heartbeat,
                      config=FrontendConfig(served_model="m", limits=protocol.Limits(context=64, vocab_size=16)))
    reasons = []
    watchdog = StallWatchdog(heartbeat, 60, lambda age, why: reasons.append((age, why)), startup_timeout_s=600)
    never = StallWatchdog(heartbeat, 60, lambda age, why: reasons.append(("never", why)), startup_timeout_s=0)
    clock.now += 599
    assert not watchdog.check() and not never.check() and health.health()[1] == {"status": "starting"}
    clock.now += 2
    assert watchdog.check() and not never.check() and health.health()[1] == {"status": "starting"}
    assert reasons == [(pytest.approx(601), "limit 600 s: --startup-timeout")]
    heartbeat.tick()
    clock.now += 59
    assert not watchdog.check() and health.health()[0] == 503  # 59 s > --stall-timeout 30
    clock.now += 2
    assert watchdog.check()


def test_intervals_that_waited_for_work_stay_out_of_the_window():
    """The serving loop ticks after an idle iteration without recording the interval: an hour
    without requests does not stretch the limits."""
    clock = Clock()
    heartbeat = Heartbeat(clock)
    heartbeat.tick()
    for _ in range(3):
        clock.now += 2
        heartbeat.tick()
    clock.now += 3600
    heartbeat.tick(record=False)
    pulse = heartbeat.pulse()
    assert pulse.recent_s == 2 and pulse.intervals == 3 and pulse.age_s == 0


@pytest.mark.parametrize("argv,message", [
    (["--max-watchdog-timeout", "10"], "--max-watchdog-timeout must be >= --watchdog-timeout 60, got 10"),
    (["--stall-timeout", "5", "--max-stall-timeout", "4"], "--max-stall-timeout must be >= --stall-timeout 5, got 4"),
    (["--startup-timeout", "-1"], "--startup-timeout must be >= 0, got -1.0"),
])
def test_bad_limits_are_refused_in_one_line(argv, message, serve_ckpts, capsys):
    from megatron.inference.serve import main

    assert main(["--load", serve_ckpts["standard"], "--port", "0", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"megatron.inference.serve: error: {message}"
