"""Clocks for the communication counters and the step timers: host time on CPU, CUDA events on GPU.

On CPU/gloo a collective runs on the host, so ``time.perf_counter`` read when it completes (gloo's
work future) is its completion time. On GPU neither host clock means anything: NCCL work futures
complete when the collective is *enqueued* and kernels run after the host has moved on, so host
stamps read about zero for communication and only the launch time for compute. There the times
are CUDA events recorded on the streams doing the work (the communication stream for a
collective's start and end, the compute stream for the point where compute waits on it and for
the step timers), read back when the figures are reported.

A ``Stamp`` is a point on one clock's timeline that may not have happened yet: ``ready()`` never
blocks (``in_flight()`` and the deferred weight gradients use it), ``seconds()`` blocks until it
has happened. ``EventClock`` takes any event factory, so its arithmetic is tested on CPU with
events whose times a test records (``tests/foundation/test_timing.py``); ``clock_for(device)``
gives the real one (``torch.cuda.Event``) for a CUDA device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Protocol

import torch

__all__ = [
    "Stamp",
    "HostStamp",
    "EventStamp",
    "HostClock",
    "EventClock",
    "HOST",
    "clock_for",
    "span_seconds",
    "SpanTimer",
]


class Stamp(Protocol):
    def ready(self) -> bool:
        """True once the stamped point has happened (never blocks)."""

    def seconds(self) -> float:
        """The point's time in seconds on its clock's timeline (blocks until it has happened)."""


@dataclasses.dataclass(frozen=True)
class HostStamp:
    t: float

    def ready(self) -> bool:
        return True

    def seconds(self) -> float:
        return self.t


class HostClock:
    """``time.perf_counter``: the work happens on the host, so a stamp is taken when it happens."""

    device_side = False

    def stamp(self, stream=None) -> HostStamp:
        return HostStamp(time.perf_counter())

    def stream_context(self, stream):
        return contextlib.nullcontext()

    def communication_stream(self):
        return None

    def current_stream(self):
        return None

    def wait_for(self, stamp, stream=None) -> None:
        """Make ``stream`` wait for ``stamp`` (nothing to do on the host)."""


HOST = HostClock()


class EventStamp:
    """An event recorded on a stream, timed against the clock's base event."""

    def __init__(self, event, clock: "EventClock"):
        self.event = event
        self.clock = clock

    def ready(self) -> bool:
        return bool(self.event.query())

    def seconds(self) -> float:
        self.event.synchronize()
        return self.clock.base_s + self.clock.base.elapsed_time(self.event) / 1e3


class EventClock:
    """Device-side stamps: events recorded on streams; times are milliseconds from a base event
    recorded when the clock was made (``elapsed_time``), in seconds, offset by the host time of
    that moment so that host and device figures read alike.

    ``new_event()`` makes an event with ``record(stream)``, ``query()``, ``synchronize()``,
    ``wait(stream)`` and ``elapsed_time(other)`` in ms (``torch.cuda.Event(enable_timing=True)``).
    ``streams`` gives ``(current_stream(), communication_stream(), stream_context(stream))``
    callables; without it, streams are ``None`` and contexts do nothing (tests).
    """

    device_side = True

    def __init__(self, new_event: Callable[[], object], *, current_stream=None, communication_stream=None,
                 stream_context=None):
        self.new_event = new_event
        self._current = current_stream or (lambda: None)
        self._comm = communication_stream or (lambda: None)
        self._context = stream_context or (lambda stream: contextlib.nullcontext())
        self.base = new_event()
        self.base.record(self._current())
        self.base_s = time.perf_counter()

    def stamp(self, stream=None) -> EventStamp:
        event = self.new_event()
        event.record(stream if stream is not None else self._current())
        return EventStamp(event, self)

    def current_stream(self):
        return self._current()

    def communication_stream(self):
        return self._comm()

    def stream_context(self, stream):
        return self._context(stream)

    def wait_for(self, stamp: EventStamp, stream=None) -> None:
        """Make ``stream`` (default the current one) wait until ``stamp`` has happened."""
        stamp.event.wait(stream if stream is not None else self._current())


_CUDA_CLOCKS: dict[int, EventClock] = {}
_COMM_STREAMS: dict[int, object] = {}


def _cuda_clock(index: int) -> EventClock:
    def communication_stream():
        if index not in _COMM_STREAMS:
            _COMM_STREAMS[index] = torch.cuda.Stream(device=index)
        return _COMM_STREAMS[index]

    with torch.cuda.device(index):
        return EventClock(
            lambda: torch.cuda.Event(enable_timing=True),
            current_stream=lambda: torch.cuda.current_stream(index),
            communication_stream=communication_stream,
            stream_context=torch.cuda.stream,
        )


def clock_for(device) -> HostClock | EventClock:
    """CUDA events for a CUDA device (one clock per device), the host clock otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return HOST
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CUDA_CLOCKS:
        _CUDA_CLOCKS[index] = _cuda_clock(index)
    return _CUDA_CLOCKS[index]


def span_seconds(start: float, done: float, wait_at: float) -> tuple[float, float, float]:
    """``(start, done, exposed)`` of a collective in flight from ``start`` to ``done`` whose result
    the compute side started waiting for at ``wait_at``: exposed is the part of the interval
    spent waiting, ``max(0, done - max(wait_at, start))`` (a wait that begins after completion
    exposes nothing; one that begins before the launch exposes the whole interval)."""
    done = max(done, start)
    return start, done, max(0.0, done - max(wait_at, start))


class SpanTimer:
    """Named durations on one clock, read when needed: ``begin(name)``/``end(name)`` pairs
    accumulate (per micro-batch forward, say), ``mark(name)`` stamps a point; ``seconds`` and
    ``between`` block until the stamps have happened (on GPU: the events have been reached)."""

    def __init__(self, clock=HOST):
        self.clock = clock
        self._marks: dict[str, Stamp] = {}
        self._open: dict[str, Stamp] = {}
        self._spans: dict[str, list[tuple[Stamp, Stamp]]] = {}

    def mark(self, name: str) -> None:
        self._marks[name] = self.clock.stamp()

    def begin(self, name: str) -> None:
        self._open[name] = self.clock.stamp()

    def end(self, name: str) -> None:
        self._spans.setdefault(name, []).append((self._open.pop(name), self.clock.stamp()))

    def between(self, first: str, last: str) -> float:
        return max(self._marks[last].seconds() - self._marks[first].seconds(), 0.0)

    def seconds(self, name: str) -> float:
        return sum(max(b.seconds() - a.seconds(), 0.0) for a, b in self._spans.get(name, []))

