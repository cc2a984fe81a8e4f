"""``serve_loop(trace=...)`` (``serve --a2a-spans``' ``loop_rank<R>.jsonl``): every iteration's
phases, which requests it brought, whether it gathered token updates and stepped (the real loop on
one gloo rank with the scripted engine of ``test_loop_failures``)."""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from megatron.components.parallel import single_process_group
from megatron.inference.frontend import Submit
from megatron.inference.loop import LOOP_PHASES, serve_loop
from megatron.inference.sampling import RequestSampling
from tests.serving.test_loop_failures import OneTokenEngine, Rounds


def test_every_iteration_is_traced_with_its_phases():
    submit = lambda rid: Submit(rid, [1, 2], 2, RequestSampling())  # noqa: E731
    frontend = Rounds([[submit(0), submit(1)], [submit(2)]])
    records = []
    with single_process_group():
        world = dist.group.WORLD
        serve_loop(OneTokenEngine(), types.SimpleNamespace(dp=world, tp=world, ep=world), frontend=frontend,
                   trace=records.append)
    assert [u.tokens for u in frontend.updates[2]] == [[7], [7]]
    # round 1: brings 2 requests and steps; steps again, gathering the first tokens; gathers the
    # last ones (no work left); round 2 likewise with 1 request; the stop
    assert [(r["arrived"], r["gathered"], r["stepped"]) for r in records] == [
        (2, False, True), (0, True, True), (0, True, False),
        (1, False, True), (0, True, True), (0, True, False)]
    for r, after in zip(records, records[1:]):
        assert set(r["phases"]) == set(LOOP_PHASES) and all(v >= 0 for v in r["phases"].values())
        assert r["t"] + sum(r["phases"].values()) <= after["t"]  # an iteration ends before the next starts
        assert sum(r["phases"].values()) == pytest.approx(after["t"] - r["t"], abs=0.05)


def test_a_trace_that_cannot_write_stops_without_stopping_serving(capsys):
    from megatron.inference.observability import LoopTrace

    lines = []
    trace = LoopTrace(lines.append)
    trace({"t": 1.0})
    assert lines == ['{"t": 1.0}\n']

    def full(text):
        raise OSError(28, "No space left on device")

    trace = LoopTrace(full)
    trace({"t": 1.0})
    trace({"t": 2.0})  # no second attempt, no second line
    err = capsys.readouterr().err
    assert err.count("the loop trace stopped") == 1 and "No space left on device" in err and trace.failed
