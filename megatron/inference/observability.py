"""What a served rank measures around its engine steps: ``engine.StepObserver``s the server
subscribes to its ``RankEngine``.

* ``AllToAllCounters``: each step's expert all-to-all counters (the MoE layers' ``comm_counters``:
  off-rank bytes sent, calls, time in flight, time the compute thread waited), added to the rank's
  totals (``stats()``: the ``a2a_*`` fields of ``engine.STAT_FIELDS``, which ``/metrics`` serves)
  and reset: the counters' in-flight union keeps every interval, so summing the whole history at
  each ``stats()`` would cost more every step.
* ``SpanRecorder`` (``serve --a2a-spans``): each step's expert all-to-alls, in launch order, as one
  record ``{"t": step start, "end": step end, "tokens": real tokens (0: a dummy forward), "bytes":
  off-rank all-to-all bytes sent, "spans": [[name, start, end], ...], "waits": [[name, start, end],
  ...]}`` (``perf_counter`` seconds; a wait is when the compute thread asked for a collective's
  result until it had it, one per collective, in the order they were asked for),
  handed to a sink for every step with any. With a tensor-parallel group the record also has
  ``"tp": [[op, bytes, start, end], ...]``, the step's all-reduces and gathers on that group
  (``megatron.compat.tp_collectives``). The serving benchmark matches the records across ranks to
  split the all-to-all time into transfer and rank-skew wait (``tools.bench.overlap.transfer_skew``);
  ``tools.profile.replay_steps`` and the serving compute profile read them too.

They are the server's, not the engine's: the engine only announces its steps.
"""

from __future__ import annotations

import json
import sys
from typing import Callable, Optional

from megatron.inference.engine import StepInfo, StepObserver

__all__ = ["AllToAllCounters", "SpanRecorder", "LoopTrace"]


class AllToAllCounters(StepObserver):
    """The expert all-to-all counters of ``model``'s MoE layers, per step and in total (see the
    module docstring). ``last``: the last step's figures."""

    def __init__(self, model):
        from moe_variants.common.moe_layer import comm_counters

        self.model = model
        self.layers = comm_counters([model])
        self.totals = {"a2a_bytes": 0, "a2a_calls": 0, "a2a_time_s": 0.0, "a2a_exposed_s": 0.0}
        self.last = dict(self.totals)
        self.step: Optional[StepInfo] = None  # the step ``last`` is of

    def step_end(self, step: StepInfo) -> None:
        from moe_variants.common.moe_layer import comm_totals, reset_comm_counters

        self.step = step
        if not self.layers:
            return
        totals = comm_totals([self.model])
        self.last = {"a2a_bytes": int(totals["bytes_dispatch"] + totals["bytes_combine"] + totals["bytes_meta"]),
                     "a2a_calls": int(totals["calls"]), "a2a_time_s": float(totals["time_fwd_s"]),
                     "a2a_exposed_s": float(totals["exposed_fwd_s"])}
        for key, value in self.last.items():
            self.totals[key] += value
        reset_comm_counters([self.model])

    def stats(self) -> dict:
        return dict(self.totals)


class SpanRecorder(StepObserver):
    """Each step's collectives as one record for ``sink`` (see the module docstring). Subscribe it
    after ``counters`` (it reads their ``last``); ``close()`` detaches it from the layers and, with
    ``tp_group``, puts torch.distributed back."""

    def __init__(self, counters: AllToAllCounters, sink: Callable[[dict], None], tp_group=None):
        from megatron.compat.tp_collectives import GroupCollectives
        from moe_variants.common.comm import TimelineRecorder

        self.counters = counters
        self.sink = sink
        self.timeline = TimelineRecorder()
        for layer in counters.layers:
            layer.timeline = self.timeline
        self.tp_calls = GroupCollectives(tp_group).__enter__() if tp_group is not None else None

    def step_start(self, step: StepInfo) -> None:
        self.timeline.events = []  # only the step's own collectives
        if self.tp_calls is not None:
            self.tp_calls.take()

    def step_end(self, step: StepInfo) -> None:
        assert self.counters.step is step, "subscribe the SpanRecorder after its AllToAllCounters"
        events, self.timeline.events = self.timeline.events, []
        ordered = sorted(events, key=lambda ev: ev[2])
        spans = [[name, s, e] for name, lane, s, e in ordered if lane == "comm"]
        record = {"t": step.start, "end": step.end, "tokens": step.real_tokens,
                  "bytes": self.counters.last["a2a_bytes"], "spans": spans,
                  "waits": [[name[len("wait "):], s, e] for name, lane, s, e in ordered if lane == "wait"]}
        if self.tp_calls is not None:
            record["tp"] = [list(call) for call in self.tp_calls.take()]
        if spans:
            self.sink(record)

    def close(self) -> None:
        for layer in self.counters.layers:
            if layer.timeline is self.timeline:
                layer.timeline = None
        if self.tp_calls is not None:
            self.tp_calls.__exit__(None, None, None)
            self.tp_calls = None


class LoopTrace:
    """``serve_loop(trace=...)`` writing each iteration's record as a JSON line through ``write``. A
    diagnostic never stops serving: the first write that fails (a full disk) is reported in one line
    on stderr and the trace stops there."""

    def __init__(self, write: Callable[[str], object]):
        self.write, self.failed = write, False

    def __call__(self, record: dict) -> None:
        if self.failed:
            return
        try:
            self.write(json.dumps(record) + "\n")
        except OSError as err:
            self.failed = True
            print(f"serve: the loop trace stopped: {err}", file=sys.stderr, flush=True)
