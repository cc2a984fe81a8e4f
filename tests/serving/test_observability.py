"""What the server measures around its engine steps (``megatron.inference.observability``: step
observers of ``RankEngine``). Counts and records are exact; times are only ordered."""

from __future__ import annotations

import pytest
import torch

from megatron.inference.engine import StepInfo, StepObserver
from megatron.inference.observability import AllToAllCounters, SpanRecorder
from moe_variants.common.comm import CommCounters
from tools.spawn import run_distributed


def _model_with_counters(n: int) -> torch.nn.Module:
    """A module tree whose ``n`` children report expert-parallel communication the way the EP
    benchmark's peers do (``moe_comm_counters``; ``comm_counters`` finds them)."""
    model = torch.nn.Sequential(*(torch.nn.Identity() for _ in range(n)))
    for child in model:
        child.moe_comm_counters = CommCounters()
    return model


def _step(observers, step: StepInfo, end: float, during=None) -> None:
    """Drive ``observers`` through one step as ``RankEngine`` does."""
    for o in observers:
        o.step_start(step)
    if during is not None:
        during()
    done = StepInfo(step.start, step.real_tokens, step.dummy, end)
    for o in observers:
        o.step_end(done)


def test_span_recorder_hands_on_one_record_per_step_with_collectives():
    """``serve --a2a-spans``: one timeline on every layer's counters; a step's all-to-alls in
    launch order with the step's start, end, real tokens and the counters' off-rank bytes, and the
    compute thread's waits for them in the order it asked; a step without any gives no record;
    what was recorded between steps is not the next step's; closing detaches the timeline."""
    model = _model_with_counters(2)
    counters = AllToAllCounters(model)
    records = []
    recorder = SpanRecorder(counters, records.append)
    assert all(c.timeline is recorder.timeline for c in counters.layers)
    first, second = counters.layers

    def traffic():
        first.add_bytes("dispatch", 4000)
        second.add_bytes("meta", 96)
        second.add_time(False, 2.0, 2.5, 0.0)
        recorder.timeline.add("combine", "comm", 2.0, 2.5)
        recorder.timeline.add("dispatch", "comm", 1.0, 1.5)
        recorder.timeline.add("wait dispatch", "wait", 1.2, 1.5)

    _step([counters, recorder], StepInfo(0.5, 12), 2.7, traffic)
    recorder.timeline.add("dispatch", "comm", 2.8, 2.9)  # between steps: not the next step's
    _step([counters, recorder], StepInfo(3.0, 0, dummy=True), 3.1)
    recorder.close()
    assert records == [{"t": 0.5, "end": 2.7, "tokens": 12, "bytes": 4096,
                        "spans": [["dispatch", 1.0, 1.5], ["combine", 2.0, 2.5]],
                        "waits": [["dispatch", 1.2, 1.5]]}]
    assert all(c.timeline is None for c in counters.layers)


def test_counters_add_each_step_to_the_totals_and_reset_the_layers():
    model = _model_with_counters(2)
    counters = AllToAllCounters(model)
    first, second = counters.layers
    for step, num_bytes in enumerate((1000, 24)):
        def traffic():
            first.add_bytes("dispatch", num_bytes)
            second.add_bytes("combine", num_bytes)
            first.add_time(False, 1.0, 1.5, 0.25)

        _step([counters], StepInfo(float(step), 8), step + 0.9, traffic)
        assert counters.last == {"a2a_bytes": 2 * num_bytes, "a2a_calls": 2, "a2a_time_s": 0.5,
                                 "a2a_exposed_s": 0.25}
        assert first.bytes_dispatch == 0 and second.calls == 0  # reset for the next step
    assert counters.stats() == {"a2a_bytes": 2048, "a2a_calls": 4, "a2a_time_s": 1.0, "a2a_exposed_s": 0.5}


def test_the_recorder_refuses_to_run_before_its_counters():
    counters = AllToAllCounters(_model_with_counters(1))
    recorder = SpanRecorder(counters, [].append)
    with pytest.raises(AssertionError, match="after its AllToAllCounters"):
        _step([recorder, counters], StepInfo(0.0, 1), 1.0)
    recorder.close()


def test_a_tp_group_adds_its_collectives_and_close_puts_torch_distributed_back():
    """With a TP group the records also carry the step's all-reduces on that group (op, bytes,
    start, end); calls on other groups and between steps are not counted."""
    import torch.distributed as dist

    from megatron.components.parallel import single_process_group

    with single_process_group():
        group = dist.new_group([0])
        counters = AllToAllCounters(_model_with_counters(1))
        records = []
        all_reduce = dist.all_reduce
        recorder = SpanRecorder(counters, records.append, tp_group=group)
        dist.all_reduce(torch.ones(2), group=group)  # before the step: not its

        def traffic():
            dist.all_reduce(torch.ones(4, 8), group=group)  # counted: 128 bytes
            dist.all_reduce(torch.ones(3))  # the world group: not counted
            recorder.timeline.add("dispatch", "comm", 1.0, 1.5)

        _step([counters, recorder], StepInfo(0.5, 12), 2.7, traffic)
        recorder.close()
        assert dist.all_reduce is all_reduce
    (record,) = records
    (op, size, start, end), = record["tp"]
    assert (op, size) == ("all_reduce", 128) and start <= end


class _Log(StepObserver):
    def __init__(self):
        self.events = []

    def step_start(self, step):
        self.events.append(("start", step))

    def step_end(self, step):
        self.events.append(("end", step))

    def stats(self):
        return {"steps_seen": sum(kind == "end" for kind, _ in self.events)}


def _observed_rank(rank, world, ckpt):
    from megatron.inference.engine import EngineConfig, RankEngine, build_engine
    from megatron.inference.sampling import RequestSampling
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants.config import ParallelConfig

    parallel = ParallelConfig(expert_model_parallel_size=world)
    pgc = initialize_parallel(parallel, seed=0)
    model, configs, tokenizer, _ = load_model(ckpt, parallel=parallel, pg_collection=pgc)
    eng = RankEngine(*build_engine(model, configs, tokenizer, pgc, EngineConfig(kv_cache_gb=0.01)), model)
    log, counters, records = _Log(), AllToAllCounters(model), []
    recorder = SpanRecorder(counters, records.append)
    for observer in (log, counters, recorder):
        eng.subscribe(observer)
    prompt = list(range(1, 10 + 3 * rank))
    eng.add(0, prompt, max_tokens=1, sampling=RequestSampling(), termination_id=-1)
    eng.step()  # the prefill: every rank has a request
    eng.dummy_step()  # and a dummy forward, together
    eng.unsubscribe(recorder)
    recorder.close()
    eng.dummy_step()
    return {"events": [(kind, s.start, s.end, s.real_tokens, s.dummy) for kind, s in log.events],
            "prompt": len(prompt), "stats": eng.stats(), "totals": counters.totals, "records": records,
            "busy_s": eng.busy_s}


def test_a_rank_engine_tells_its_observers_of_every_step(serve_ckpts):
    """Two ranks (EP = 2): every observer sees each step start (no end yet) and end, in order, with
    the step's real tokens (the prompt's; 0 and ``dummy`` for the dummy forward); ``stats()``
    carries the observers' counters (the all-to-all totals are the server's ``a2a_*`` fields); the
    span records are the steps' own (real tokens, the counters' bytes); an unsubscribed observer
    hears nothing more."""
    for out in run_distributed(_observed_rank, 2, serve_ckpts["standard"], timeout_s=300):
        events = out["events"]
        assert [e[0] for e in events] == ["start", "end"] * 3
        (_, s0, e0, n0, d0), (_, s1, e1, n1, d1) = events[0], events[1]
        assert e0 is None and s1 == s0 and e1 >= s1 and (n0, n1, d0, d1) == (out["prompt"], out["prompt"], False, False)
        assert [e[3:] for e in events[2:]] == [(0, True), (0, True), (0, True), (0, True)]
        assert sum(e[2] - e[1] for e in events if e[0] == "end") == pytest.approx(out["busy_s"])
        stats = out["stats"]
        assert stats["steps_seen"] == 3 and stats["steps"] == 1 and stats["dummy_steps"] == 2
        assert {k: stats[k] for k in out["totals"]} == out["totals"] and out["totals"]["a2a_bytes"] > 0
        assert out["totals"]["a2a_calls"] == 3 * 2 * 3  # dispatch, combine, metadata x 2 MoE layers x 3 forwards
        records = out["records"]
        assert [r["tokens"] for r in records] == [out["prompt"], 0] and all(len(r["spans"]) == 6 for r in records)
        assert sum(r["bytes"] for r in records) < out["totals"]["a2a_bytes"]  # the last forward was not recorded
