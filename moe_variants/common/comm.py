"""Expert-parallel collectives with their own accounting, on any device (gloo or NCCL).

All expert-parallel traffic of the project goes through ``all_to_all`` here, so the byte and time
counters of every variant come from one place (the training metrics and the EP benchmark read
them). The same autograd function serves the blocking path (standard MoE, FarSkip reference) and
the asynchronous one (FarSkip overlapped): forward returns the output at once and leaves a
``PendingComm`` in the caller's per-call ``handles`` dict under ``"forward"``; with
``async_backward`` the reverse all-to-all of the backward is also launched without waiting and
its ``PendingComm`` is stored under ``"backward"``, to be waited by a tensor hook the caller puts
on the all-to-all input (``wait_backward_hook``).

Timing (``moe_variants.common.timing``): on CPU/gloo the collective runs on the host and gloo's
work future completes when it is done, so host clocks time it. On GPU an NCCL future completes at
enqueue, so the collective is launched on a communication stream between two CUDA events (start,
and done after the stream has waited for NCCL's), the compute stream waits on the done event, and
an event on the compute stream marks where it started waiting; the counters read the events when
they are reported. ``PendingComm.in_flight()`` queries the done event, so the deferred weight
gradients see the collective's real completion on both.

Shape legend: ``N`` rows sent (tokens x top-k routed off this rank's slice), ``M`` rows received.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time
from typing import Optional, Sequence

import torch
from megatron.core.transformer.moe.shared_experts import set_tensor_grad_fn_sequence_sr

from megatron.common import collectives
from moe_variants.common import timing, wgrad

__all__ = [
    "CommCounters",
    "PendingComm",
    "all_to_all",
    "start_all_reduce",
    "wait_backward_hook",
    "off_rank_bytes",
    "TimelineRecorder",
    "set_backward_priority",
    "LAUNCH_BACKWARD",
    "DEFER_BACKWARD",
]


class TimelineRecorder:
    """Optional event recorder for a Chrome-trace timeline (``chrome://tracing`` / Perfetto).

    Events are ``(name, lane, start_s, end_s)`` in ``time.perf_counter`` seconds. Lanes used:
    ``compute`` (work on the main thread), ``comm`` (collective in flight, launch to completion)
    and ``wait`` (main thread blocked on a collective).
    """

    def __init__(self):
        self.events: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()

    def add(self, name: str, lane: str, start: float, end: float) -> None:
        with self._lock:
            self.events.append((name, lane, start, end))

    def to_chrome_trace(self, pid: int = 0) -> dict:
        if not self.events:
            return {"traceEvents": []}
        t0 = min(e[2] for e in self.events)
        lanes = {"step": 0, "compute": 1, "wait": 2, "comm": 3, "phases": 4}
        trace = [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}}
            for lane, tid in lanes.items()
        ]
        for name, lane, start, end in self.events:
            trace.append(
                {
                    "name": name,
                    "ph": "X",
                    "pid": pid,
                    "tid": lanes.get(lane, 9),
                    "ts": (start - t0) * 1e6,
                    "dur": max(end - start, 0.0) * 1e6,
                }
            )
        return {"traceEvents": trace, "displayTimeUnit": "ms"}


@dataclasses.dataclass
class CommCounters:
    """Expert-parallel communication of one MoE layer since the last ``reset``.

    Bytes count only what leaves this rank (rows addressed to other ranks); the local share of
    an all-to-all is a memory copy, not network traffic.

    ``time_*_s`` is wall time with at least one all-to-all in flight (the union of the launch-to-
    completion intervals), not the sum over collectives: an overlapped layer keeps two in flight
    at once (the dispatch and its routing probabilities), and summing would count that interval
    twice and inflate the overlap fraction ``1 - exposed / time``. ``total`` takes the union
    across layers too. ``exposed_*_s`` is the time the compute thread waited (its waits never
    overlap each other: they are on one thread); on GPU, the time the compute stream waited.

    Device-side spans (CUDA events, ``add_span``) are booked when the counters are read
    (``as_dict``/``total``/``resolve``), which waits for their events.
    """

    bytes_dispatch: int = 0  # forward dispatch, hidden-state payload
    bytes_combine: int = 0  # forward combine, hidden-state payload
    bytes_meta: int = 0  # routing probabilities and other metadata, forward and backward
    bytes_backward: int = 0  # backward all-to-alls of the hidden-state payload
    time_fwd_s: float = 0.0  # wall time with a forward collective in flight (union, see above)
    time_bwd_s: float = 0.0
    exposed_fwd_s: float = 0.0  # time the compute thread waited on forward collectives
    exposed_bwd_s: float = 0.0
    calls: int = 0
    timeline: Optional[TimelineRecorder] = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self._lock = threading.Lock()
        self._busy = {False: BusyTime(), True: BusyTime()}  # by direction (backward?)
        self._unresolved: list = []  # (backward, start, done, wait_at, name) stamps not yet read

    def reset(self) -> None:
        timeline = self.timeline
        for field in dataclasses.fields(self):
            if field.name != "timeline":
                setattr(self, field.name, field.default)
        self.timeline = timeline
        self._busy = {False: BusyTime(), True: BusyTime()}
        self._unresolved = []

    def add_bytes(self, kind: str, num_bytes: int) -> None:
        with self._lock:
            attr = {
                "dispatch": "bytes_dispatch",
                "combine": "bytes_combine",
                "meta": "bytes_meta",
                "backward": "bytes_backward",
            }[kind]
            setattr(self, attr, getattr(self, attr) + num_bytes)
            self.calls += 1

    def add_time(self, backward: bool, start: float, done: float, exposed_s: float) -> None:
        """Book a collective in flight from ``start`` to ``done`` (``perf_counter`` seconds) of
        which the compute thread waited ``exposed_s``."""
        with self._lock:
            busy = self._busy[backward].add(start, done)
            if backward:
                self.time_bwd_s = busy
                self.exposed_bwd_s += exposed_s
            else:
                self.time_fwd_s = busy
                self.exposed_fwd_s += exposed_s

    def add_span(self, backward: bool, start, done, wait_at, name: Optional[str] = None) -> None:
        """Book a collective from stamp ``start`` to ``done`` whose result compute began waiting for
        at ``wait_at`` (``timing`` stamps; read, and waited for, at the next ``resolve``)."""
        with self._lock:
            self._unresolved.append((backward, start, done, wait_at, name))

    def resolve(self) -> None:
        """Read the stamps of the spans added since the last call and book them."""
        with self._lock:
            items, self._unresolved = self._unresolved, []
        for backward, start, done, wait_at, name in items:
            s, d, exposed = timing.span_seconds(start.seconds(), done.seconds(), wait_at.seconds())
            self.add_time(backward, s, d, exposed)
            if self.timeline is not None and name is not None:
                self.timeline.add(name, "comm", s, d)
                self.timeline.add(f"wait {name}", "wait", min(wait_at.seconds(), d), d)

    def as_dict(self) -> dict:
        self.resolve()
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "timeline"
        }

    @staticmethod
    def total(counters: Sequence["CommCounters"]) -> dict:
        """Sum of several layers' counters as a plain dict."""
        out = CommCounters().as_dict()
        busy = {False: BusyTime(), True: BusyTime()}
        for c in counters:
            for key, value in c.as_dict().items():
                out[key] += value
            for backward, mine in c._busy.items():
                for start, end in mine.spans:
                    busy[backward].add(start, end)
        out["time_fwd_s"] = busy[False].total
        out["time_bwd_s"] = busy[True].total
        return out


class BusyTime:
    """Length of the union of intervals added in any order (kept as sorted disjoint spans, so a
    long evaluation's thousands of collectives cost little)."""

    def __init__(self):
        self.spans: list[list[float]] = []
        self.total = 0.0

    def add(self, start: float, end: float) -> float:
        """Add ``[start, end]``; returns the new total."""
        if end <= start:
            return self.total
        i = bisect.bisect_left(self.spans, [start, start])
        if i > 0 and self.spans[i - 1][1] >= start:
            i -= 1
        j, lo, hi, covered = i, start, end, 0.0
        while j < len(self.spans) and self.spans[j][0] <= end:
            lo, hi = min(lo, self.spans[j][0]), max(hi, self.spans[j][1])
            covered += self.spans[j][1] - self.spans[j][0]
            j += 1
        self.spans[i:j] = [[lo, hi]]
        self.total += (hi - lo) - covered
        return self.total


def off_rank_bytes(input_splits: Sequence[int], row_numel: int, element_size: int, rank: int) -> int:
    """Bytes an all-to-all sends to other ranks: rows not addressed to ``rank``."""
    rows = sum(int(n) for i, n in enumerate(input_splits) if i != rank)
    return rows * row_numel * element_size


class PendingComm:
    """An all-to-all in flight: ``wait()`` blocks until done and books the timing once.

    Host clock (CPU/gloo): ``work`` is the collective's work; its future stamps completion.
    Device clock (GPU): ``start`` and ``done`` are events on the communication stream around the
    collective (``_launch``); ``wait()`` makes the compute stream wait for ``done``.
    """

    def __init__(self, work, output, counters, backward: bool, name: str, timeline=None, *,
                 clock=timing.HOST, start=None, done=None, source=None):
        self.work = work
        self.output = output
        # the tensor the collective reads: kept alive until waited (its caller may drop it at once)
        self.source = source
        self.counters = counters
        self.backward = backward
        self.name = name
        self.timeline = timeline
        self.clock = clock
        self.start_stamp = start if start is not None else clock.stamp()
        self.start = self.start_stamp.seconds() if not clock.device_side else None
        self.done_stamp = done
        self.completed_at: Optional[float] = None
        self._done = False
        if work is not None and not clock.device_side:
            try:
                work.get_future().then(self._on_complete)
            except (RuntimeError, AttributeError):
                pass  # backends without futures: completion is taken at wait()

    def in_flight(self) -> bool:
        """True while the collective has not completed (never blocks)."""
        if self._done:
            return False
        if self.clock.device_side:
            return self.done_stamp is not None and not self.done_stamp.ready()
        if self.completed_at is not None or self.work is None:
            return False
        try:
            return not self.work.is_completed()
        except (RuntimeError, AttributeError):
            return False

    def _on_complete(self, fut):
        self.completed_at = time.perf_counter()
        return None

    def wait(self) -> torch.Tensor:
        """Block until the collective is done; returns the output (once: the reference is dropped).

        Dropping the references matters: the forward ``PendingComm`` sits in the autograd ctx's
        ``handles`` dict, so keeping ``output`` would close a cycle output -> grad_fn -> ctx ->
        handles -> output through C++ autograd nodes that Python's GC cannot collect, leaking every
        step's graph.
        """
        if self._done:
            raise RuntimeError(f"{self.name}: already waited")
        if self.clock.device_side:
            return self._wait_device()
        t0 = time.perf_counter()
        if self.work is not None:
            self.work.wait()
        t1 = time.perf_counter()
        # The future callback may land a moment after wait() returns; the wait end bounds it.
        done = self.completed_at if self.completed_at is not None else t1
        done = min(done, t1)
        # exposed = the part of the in-flight interval the caller spent waiting (a wake-up after
        # completion is scheduling latency, not communication)
        _, done, exposed = timing.span_seconds(self.start, done, t0)
        if self.counters is not None:
            self.counters.add_time(self.backward, self.start, done, exposed)
        if self.timeline is not None:
            self.timeline.add(self.name, "comm", self.start, done)
            # recorded even when it did not block: its start ends the collective's compute window
            self.timeline.add(f"wait {self.name}", "wait", t0, t1)
        self._done = True
        output, self.output, self.work, self.source = self.output, None, None, None
        return output

    def _wait_device(self) -> torch.Tensor:
        wait_at = self.clock.stamp()  # on the compute stream: from here it waits for the collective
        self.clock.wait_for(self.done_stamp)
        if self.counters is not None:
            self.counters.add_span(self.backward, self.start_stamp, self.done_stamp, wait_at,
                                   self.name if self.timeline is not None else None)
        self._done = True
        output, self.output, self.work, self.source = self.output, None, None, None
        return output


def _launch(group, tensor, output_splits, input_splits, counters, kind, backward, name, clock=None):
    """Start ``all_to_all_single`` (uneven splits) without waiting; return the PendingComm.

    ``clock`` defaults to the tensor's device clock (``timing.clock_for``)."""
    tensor = tensor.contiguous()
    clock = clock if clock is not None else timing.clock_for(tensor.device)
    output = tensor.new_empty((sum(output_splits),) + tuple(tensor.shape[1:]))
    if counters is not None:
        # a rank may send nothing (no token chose its experts): size a row from the shape, not row 0
        row_numel = int(torch.Size(tensor.shape[1:]).numel())
        num_bytes = off_rank_bytes(input_splits, row_numel, tensor.element_size(), group.rank())
        counters.add_bytes("backward" if backward and kind != "meta" else kind, num_bytes)
    timeline = counters.timeline if counters is not None else None

    def launch():
        return collectives.all_to_all_single(
            output,
            tensor,
            output_split_sizes=list(output_splits),
            input_split_sizes=list(input_splits),
            group=group,
            async_op=True,
        )

    return _start(clock, launch, tensor, output, counters, backward, name, timeline)


def _start(clock, launch, tensor, output, counters, backward, name, timeline) -> PendingComm:
    """Run ``launch()`` (an ``async_op`` collective reading ``tensor``, writing ``output``) and
    return its PendingComm: on the host as it is; on a device on the communication stream between
    two events."""
    if not clock.device_side:
        return PendingComm(launch(), output, counters, backward, name, timeline, clock=clock, source=tensor)
    comm = clock.communication_stream()
    clock.wait_for(clock.stamp(), comm)  # the inputs are produced on the compute stream
    with clock.stream_context(comm):
        start = clock.stamp(comm)
        work = launch()
        work.wait()  # the communication stream waits for NCCL's: the next event marks completion
        done = clock.stamp(comm)
    # Both buffers came from the compute stream's pool, but NCCL reads and writes them on another
    # stream. Since torch 2.7 ProcessGroupNCCL no longer records its streams on them, and it drops
    # its own references at work.wait() above, while the collective may not have run yet. Without
    # this, the caching allocator could hand the input (often a .contiguous() copy that only this
    # frame holds) to the next compute-stream allocation while NCCL still reads it. The input is
    # also kept until the compute stream has waited (PendingComm.source).
    if tensor.device.type == "cuda":  # streams of CUDA's caching allocator (not a fake clock's test streams)
        tensor.record_stream(comm)
        if output is not tensor:
            output.record_stream(comm)
    return PendingComm(None, output, counters, backward, name, timeline, clock=clock, start=start, done=done,
                       source=tensor)


def start_all_reduce(group, tensor: torch.Tensor, counters: Optional[CommCounters] = None,
                     name: str = "combine") -> PendingComm:
    """Start an in-place sum all-reduce of ``tensor`` over ``group`` (forward only: serving's
    replicated-activation experts); ``wait()`` returns the reduced tensor.

    Bytes booked under ``combine``: what a ring all-reduce sends from each rank,
    ``2 (n-1)/n`` of the tensor. Timed like ``_launch`` (host clock on CPU, events around a
    communication stream on GPU)."""
    tensor = tensor.contiguous()
    clock = timing.clock_for(tensor.device)
    size = group.size()
    if counters is not None:
        counters.add_bytes("combine", tensor.numel() * tensor.element_size() * 2 * (size - 1) // size)
    timeline = counters.timeline if counters is not None else None
    return _start(clock, lambda: collectives.all_reduce_async(tensor, group=group), tensor, tensor, counters,
                  False, name, timeline)


class _AllToAll(torch.autograd.Function):
    """All-to-all whose forward does not wait; the caller waits ``handles['forward']``."""

    @staticmethod
    def forward(ctx, tensor, group, output_splits, input_splits, handles, counters, kind, async_backward):
        ctx.group = group
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        ctx.handles = handles
        ctx.counters = counters
        ctx.kind = kind
        ctx.async_backward = async_backward
        pending = _launch(group, tensor, output_splits, input_splits, counters, kind, False, kind)
        handles["forward"] = pending
        return pending.output

    @staticmethod
    def backward(ctx, grad_output):
        pending = _launch(
            ctx.group,
            grad_output,
            ctx.input_splits,
            ctx.output_splits,
            ctx.counters,
            ctx.kind,
            True,
            f"{ctx.kind} bwd",
        )
        grad_input = pending.output  # filled by the collective; read before wait() drops it
        if ctx.async_backward:
            ctx.handles["backward"] = pending
        else:
            pending.wait()
        return grad_input, None, None, None, None, None, None, None


def all_to_all(
    group,
    tensor: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    *,
    counters: Optional[CommCounters] = None,
    kind: str = "dispatch",
    handles: Optional[dict] = None,
    async_op: bool = False,
):
    """All-to-all with uneven splits along dim 0, differentiable, allocated on ``tensor.device``.

    Args:
        tensor: [N, ...] rows ordered by destination rank, ``input_splits[r]`` rows for rank r.
        output_splits / input_splits: python ints per rank (host values: gloo and NCCL need them).
        kind: ``dispatch`` | ``combine`` | ``meta``, the counter the forward bytes go to.
        async_op: if True, return ``(output, handles)`` without waiting: the caller must call
            ``handles['forward'].wait()`` before reading ``output``, and register
            ``wait_backward_hook(handles)`` on ``tensor`` so its gradient is waited on in backward.
            If False, wait now and return ``output`` [M, ...]; the backward also waits at once.

    A group of size 1 issues no collective (the EP=1 path must not create handles).
    """
    output_splits = [int(n) for n in output_splits]
    input_splits = [int(n) for n in input_splits]
    handles = {} if handles is None else handles
    if group is None or group.size() == 1:
        return (tensor, handles) if async_op else tensor
    output = _AllToAll.apply(
        tensor, group, output_splits, input_splits, handles, counters, kind, async_op
    )
    if async_op:
        if tensor.requires_grad:
            tensor.register_hook(wait_backward_hook(handles))
            set_backward_priority(tensor, DEFER_BACKWARD)
        set_backward_priority(output, LAUNCH_BACKWARD)
        return output, handles
    handles["forward"].wait()
    return output


# Backward priorities (autograd sequence numbers; among ready nodes the engine runs the highest
# first, torch/csrc/autograd/engine.h CompareNodeTaskTime). Nodes created in the forward carry
# increasing default numbers, far below LAUNCH and far above these small constants.
LAUNCH_BACKWARD = 2**31 - 1  # an all-to-all's backward: launch its reverse collective at once
DEFER_BACKWARD = 0  # the node that consumes that collective's result (its hook waits): run last


def set_backward_priority(tensor: torch.Tensor, sequence_nr: int) -> None:
    """Reorder the backward: give ``tensor``'s producer node the sequence number ``sequence_nr``."""
    set_tensor_grad_fn_sequence_sr(tensor, sequence_nr)


def wait_backward_hook(handles: dict):
    """A tensor hook that waits for the asynchronous backward all-to-all stored in ``handles``.

    Put it on the all-to-all *input*: autograd runs it when the gradient of that input is about to
    be consumed by its producer, which is where the gradient must be complete.
    """

    def hook(grad):
        pending = handles.pop("backward", None)
        if pending is not None:
            wgrad.run_while(pending.in_flight)  # deferred expert weight gradients fill the window
            pending.wait()
        return grad

    return hook
