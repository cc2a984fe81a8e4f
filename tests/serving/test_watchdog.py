"""The serving loop's liveness with a fake clock: the real ``serve_loop`` on a one-rank gloo group
drives an engine whose steps advance the clock, and ``/health`` (``Frontend.health``) and the
watchdog (``StallWatchdog.check``) are read in the middle of each step. Nothing waits on real
time, so nothing here depends on the machine's speed."""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from megatron.common.watchdog import Heartbeat
from megatron.inference import protocol
from megatron.inference.engine import STAT_FIELDS, TokenUpdate
from megatron.inference.frontend import Commands, Frontend, FrontendConfig, Submit
from megatron.inference.loop import serve_loop
from megatron.inference.sampling import RequestSampling
from megatron.inference.watchdog import StallWatchdog
from megatron.training.parallel import single_process_group


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


def _serve(step_s, *, stall_timeout=30.0, watchdog_timeout=60.0):
    """Serve one request whose steps take ``step_s``; (health status, watchdog fired) during each
    step, and the watchdog's reasons."""
    clock = Clock()
    heartbeat = Heartbeat(clock)
    limits = protocol.Limits(context=64, vocab_size=16)
    health = Frontend(tokenizer=None, chat_render=None, heartbeat=heartbeat,
                      config=FrontendConfig(served_model="m", limits=limits, stall_timeout=stall_timeout))
    reasons = []
    watchdog = StallWatchdog(heartbeat, watchdog_timeout, lambda age, why: reasons.append((age, why)))
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


def test_a_step_stuck_past_the_grown_limits_is_caught():
    """After steps of up to 70 s the limits are 350 s (/health) and 700 s (watchdog): a step still
    running at 799 s is reported stalled and fires the watchdog, whose reason names the limit."""
    seen, reasons = _serve([15, 70, 800])
    assert seen[:2] == [(200, False)] * 2 and seen[2] == (503, True)
    (age, why), = reasons
    assert age == pytest.approx(799) and why == "limit 700 s: --watchdog-timeout 60 or 10 x the longest step, 70.0 s"


def test_a_first_step_past_the_configured_limits_is_caught():
    """With no slower step seen, the configured limits hold."""
    seen, reasons = _serve([62])
    assert seen == [(503, True)] and len(reasons) == 1
