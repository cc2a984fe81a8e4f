"""The GPU timing backend's arithmetic, on CPU: ``EventClock`` with events whose device times the
test records (a scripted device timeline in place of ``torch.cuda.Event``), driving the same
``PendingComm``/``CommCounters``/``SpanTimer``/deferral code the GPU runs. Times are exact binary
fractions of a millisecond, so equalities are exact up to the ms -> s division (1e-12 tolerance).
The real CUDA events run in the GPU tier (tests/gpu/).
"""

from __future__ import annotations

import pytest
import torch

from moe_variants.common import comm, timing, wgrad
from moe_variants.common.comm import CommCounters, PendingComm


class FakeDevice:
    """A device timeline: ``now_ms`` is how far the device has got; events take their time from
    ``schedule`` (ms, in record order) and have happened once ``now_ms`` reaches it."""

    def __init__(self, schedule):
        self.schedule = list(schedule)
        self.now_ms = 0.0
        self.records = []  # (time, stream) in record order
        self.waits = []  # (event time, stream)

    def event(self):
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device):
        self.device = device
        self.t = None

    def record(self, stream=None):
        self.t = self.device.schedule.pop(0)
        self.device.records.append((self.t, stream))

    def query(self):
        return self.t is not None and self.device.now_ms >= self.t

    def synchronize(self):
        self.device.now_ms = max(self.device.now_ms, self.t)

    def wait(self, stream=None):
        self.device.waits.append((self.t, stream))

    def elapsed_time(self, other):
        assert self.query() and other.query(), "CUDA raises for an event that has not happened"
        return other.t - self.t


def _clock(device):
    clock = timing.EventClock(device.event, current_stream=lambda: "compute",
                              communication_stream=lambda: "comm")
    clock.base_s = 100.0  # the host offset; only differences matter
    return clock


def test_event_stamps_are_lazy_and_relative_to_the_base():
    dev = FakeDevice([0.0, 250.0])
    clock = _clock(dev)
    stamp = clock.stamp()
    assert dev.records[-1] == (250.0, "compute")
    assert not stamp.ready()  # the device has not got there
    assert stamp.seconds() == pytest.approx(100.25, abs=1e-12)  # blocks: the device reaches it
    assert stamp.ready()


def test_pending_comm_books_event_times_when_read():
    """start 1 ms, done 5 ms on the communication stream; compute starts waiting at 3 ms:
    2 ms of the 4 ms in flight are exposed. Nothing is booked until the counters are read."""
    dev = FakeDevice([0.0, 1.0, 5.0, 3.0])
    clock = _clock(dev)
    counters = CommCounters()
    start, done = clock.stamp("comm"), clock.stamp("comm")
    out = torch.zeros(2)
    pending = PendingComm(None, out, counters, False, "dispatch", clock=clock, start=start, done=done)
    dev.now_ms = 4.0
    assert pending.in_flight()  # the done event has not happened
    assert pending.wait() is out
    assert dev.records[-1] == (3.0, "compute") and dev.waits == [(5.0, "compute")]
    assert counters.time_fwd_s == 0.0  # not read yet: no blocking inside the step
    got = counters.as_dict()
    assert got["time_fwd_s"] == pytest.approx(0.004, abs=1e-12)
    assert got["exposed_fwd_s"] == pytest.approx(0.002, abs=1e-12)
    assert not pending.in_flight()


@pytest.mark.parametrize("wait_ms,exposed_ms", [(6.0, 0.0), (0.5, 4.0), (2.0, 3.0)])
def test_exposed_time_arithmetic(wait_ms, exposed_ms):
    """Waiting after completion exposes nothing; waiting from before the start exposes it all."""
    dev = FakeDevice([0.0, 1.0, 5.0, wait_ms])
    clock = _clock(dev)
    counters = CommCounters()
    PendingComm(None, None, counters, True, "combine bwd", clock=clock,
                start=clock.stamp("comm"), done=clock.stamp("comm")).wait()
    got = counters.as_dict()
    assert got["time_bwd_s"] == pytest.approx(0.004, abs=1e-12)
    assert got["exposed_bwd_s"] == pytest.approx(exposed_ms / 1e3, abs=1e-12)


def test_union_of_overlapping_collectives_on_event_times():
    """Dispatch [1, 5] ms and its probabilities [2, 6] ms overlap: 5 ms in flight, not 8; a second
    layer's [10, 11] adds 1 ms in ``total``."""
    dev = FakeDevice([0.0, 1.0, 5.0, 2.0, 6.0, 10.0, 11.0, 7.0, 7.0, 10.5])
    clock = _clock(dev)
    a, b = CommCounters(), CommCounters()
    p1 = PendingComm(None, None, a, False, "dispatch", clock=clock, start=clock.stamp("comm"), done=clock.stamp("comm"))
    p2 = PendingComm(None, None, a, False, "meta", clock=clock, start=clock.stamp("comm"), done=clock.stamp("comm"))
    p3 = PendingComm(None, None, b, False, "dispatch", clock=clock, start=clock.stamp("comm"), done=clock.stamp("comm"))
    p1.wait(), p2.wait(), p3.wait()
    total = CommCounters.total([a, b])
    assert a.as_dict()["time_fwd_s"] == pytest.approx(0.005, abs=1e-12)
    assert total["time_fwd_s"] == pytest.approx(0.006, abs=1e-12)
    assert total["exposed_fwd_s"] == pytest.approx(0.0005, abs=1e-12)  # only p3, waited from 10.5


def test_deferred_wgrad_fills_the_window_until_the_done_event():
    """The deferral's ``run_while(in_flight)`` reads the done event: tasks run while the device has
    not completed the collective (each task moves the device on by 1 ms; done at 3 ms)."""
    dev = FakeDevice([0.0, 0.0, 3.0])
    clock = _clock(dev)
    pending = PendingComm(None, None, None, True, "x", clock=clock, start=clock.stamp("comm"), done=clock.stamp("comm"))
    ran = []

    def task(i):
        def run():
            ran.append(i)
            dev.now_ms += 1.0
        return run

    saved = list(wgrad._QUEUE)
    wgrad._QUEUE.clear()
    try:
        wgrad._QUEUE.extend(task(i) for i in range(6))
        wgrad.run_while(pending.in_flight)
        assert ran == [0, 1, 2] and wgrad.pending() == 3
    finally:
        wgrad._QUEUE.clear()
        wgrad._QUEUE.extend(saved)


def test_span_timer_on_events():
    """Two forward micro-batches [1, 3] and [4, 7] ms inside a step [0.5, 9] ms."""
    dev = FakeDevice([0.0, 0.5, 1.0, 3.0, 4.0, 7.0, 8.0, 9.0])
    timer = timing.SpanTimer(_clock(dev))
    timer.mark("start")
    for _ in range(2):
        timer.begin("forward")
        timer.end("forward")
    timer.mark("forward_backward")
    timer.mark("end")
    assert timer.seconds("forward") == pytest.approx(0.005, abs=1e-12)
    assert timer.between("start", "end") == pytest.approx(0.0085, abs=1e-12)
    assert timer.between("forward_backward", "end") == pytest.approx(0.001, abs=1e-12)


def test_launch_orders_streams_on_the_device_clock():
    """``_launch`` on a device clock: the communication stream waits for the compute stream, the
    start and done events are recorded on the communication stream around the collective, and the
    compute stream's wait comes at ``wait()``. Runs a real gloo all-to-all of one rank."""
    from megatron.components.parallel import single_process_group

    dev = FakeDevice([0.0, 1.0, 2.0, 6.0, 7.0])
    clock = _clock(dev)
    counters = CommCounters()
    with single_process_group():
        import torch.distributed as dist

        x = torch.arange(6.0).reshape(3, 2)
        pending = comm._launch(dist.group.WORLD, x, [3], [3], counters, "dispatch", False, "dispatch", clock=clock)
        assert [s for _, s in dev.records] == ["compute", "compute", "comm", "comm"]  # base first
        assert dev.waits == [(1.0, "comm")]
        assert torch.equal(pending.wait(), x)
    assert dev.waits[-1] == (6.0, "compute")
    got = counters.as_dict()
    assert got["time_fwd_s"] == pytest.approx(0.004, abs=1e-12) and got["exposed_fwd_s"] == 0.0


def test_clock_for_cpu_is_the_host_clock():
    assert timing.clock_for("cpu") is timing.HOST and not timing.HOST.device_side
    assert timing.span_seconds(1.0, 0.5, 0.0) == (1.0, 1.0, 0.0)  # done before start: clamped
