"""Request failures are agreed across ranks, and a divergence is an engine failure, not a hang.

- A request scheduler that raises on a request (or answers a rank out of range) fails that
  request with a 500; the requests around it are served and the loop goes on (the real
  ``serve_loop`` on one gloo rank with a scripted engine).
- At TP = 2 (the tiny standard checkpoint, the real engine, two forked gloo ranks), a request
  whose add fails on TP rank 1 only, and one whose sampling fails on TP rank 1 only, are dropped by
  both ranks and reported once, by rank 1, with its reason; a greedy request served beside them
  gets the same tokens as served alone (exact: the same engine, the same steps' shapes or not,
  peaked distributions); both ranks end with every KV block free. Without the agreement rank 0
  kept the request and the two ranks' steps batched different tokens: their collectives hung.
- A TP group whose ranks come to hold different requests (TP rank 1 cancels a request its peer
  keeps) stops with ``EngineDiverged`` on both ranks, naming the ranks, before the next step.
"""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from megatron.inference.engine import STAT_FIELDS, TokenUpdate
from megatron.inference.frontend import Commands, Submit
from megatron.inference.loop import serve_loop
from megatron.inference.sampling import RequestSampling
from megatron.components.parallel import single_process_group


class Rounds:
    """Rank 0's frontend as the loop sees it: hands over each round of submits once every request
    of the round before has finished, then stop; keeps every update per request."""

    def __init__(self, rounds: list):
        self.rounds = list(rounds)
        self.open: set = set()
        self.updates: dict = {}
        self.placed: dict = {}

    def take_commands(self, wait_s):
        if self.open:
            return Commands()
        if not self.rounds:
            return Commands(stop=True)
        submits = self.rounds.pop(0)
        self.open = {s.request_id for s in submits}
        return Commands(submits=submits)

    def assigned(self, placed):
        self.placed.update(placed)

    def publish(self, updates, stats):
        for u in updates:
            self.updates.setdefault(u.request_id, []).append(u)
            if u.finished:
                self.open.discard(u.request_id)


class OneTokenEngine:
    """The calls ``serve_loop`` makes on a rank engine: each request gets token 7 per step until
    its ``max_tokens``."""

    activations = None

    def __init__(self):
        self.steps = self.dummy_steps = 0
        self.requests: dict = {}
        self.controller = types.SimpleNamespace(tokenizer=types.SimpleNamespace(eod=0))

    def local_work(self):
        return len(self.requests)

    def stats(self):
        return dict.fromkeys(STAT_FIELDS, 0)

    def add(self, request_id, prompt, *, max_tokens, **kwargs):
        self.requests[request_id] = max_tokens

    def step(self):
        self.steps += 1
        updates = []
        for rid in list(self.requests):
            self.requests[rid] -= 1
            updates.append(TokenUpdate(rid, [7], finished=self.requests[rid] == 0))
            if not self.requests[rid]:
                del self.requests[rid]
        return updates, True

    def dummy_step(self):
        self.dummy_steps += 1

    def cancel(self, request_id):
        return None


def test_a_scheduler_error_fails_its_request_only(capsys):
    def schedule(prompt, outstanding):
        if prompt[0] == 13:
            raise KeyError("no table entry for token 13")
        return 5 if prompt[0] == 14 else 0  # 5: no such data-parallel rank

    submit = lambda rid, token: Submit(rid, [token, 2], 3, RequestSampling())  # noqa: E731
    frontend = Rounds([[submit(0, 1), submit(1, 13), submit(2, 1)], [submit(3, 14)], [submit(4, 1)]])
    with single_process_group():
        world = dist.group.WORLD
        serve_loop(OneTokenEngine(), types.SimpleNamespace(dp=world, tp=world, ep=world), frontend=frontend,
                   schedule=schedule)
    got = frontend.updates
    assert [u.tokens for u in got[0]] == [[7]] * 3 and [u.tokens for u in got[2]] == [[7]] * 3
    assert [u.tokens for u in got[4]] == [[7]] * 3
    (failed,), (out_of_range,) = got[1], got[3]
    assert failed.finished and failed.status == 500
    assert failed.failed == "the request scheduler failed on the request: KeyError: 'no table entry for token 13'"
    assert out_of_range.failed == ("the request scheduler failed on the request: ValueError: it gave rank 5, "
                                   "not in [0, 1)")
    assert set(frontend.placed) == {0, 2, 4}  # the failed requests never reached an engine
    # the client gets one line; the server's log gets each failure's whole traceback, once
    err = capsys.readouterr().err
    assert err.count("Traceback (most recent call last)") == 2, err
    assert err.count('raise KeyError("no table entry for token 13")') == 1, err
    assert "request failed: the request scheduler failed on the request: KeyError: 'no table entry for token 13'" in err


# --- the real engine at TP = 2 ---------------------------------------------------------------------

POISON_PROMPT_TOKEN = 1999  # rank 1 refuses to add a prompt that starts with it
POISON_SEED = 666  # rank 1's sampling fails for a request with this seed


def _tp2_engine(ckpt):
    from megatron.inference.engine import EngineConfig, RankEngine, build_engine
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants.config import ParallelConfig

    parallel = ParallelConfig(tensor_model_parallel_size=2)
    pgc = initialize_parallel(parallel, seed=0)
    model, configs, tokenizer, _ = load_model(ckpt, parallel=parallel, pg_collection=pgc)
    return RankEngine(*build_engine(model, configs, tokenizer, pgc, EngineConfig(kv_cache_gb=0.01)), model), pgc


def tp_failures_rank(rank, world, ckpt):
    from megatron.inference import engine as engine_module

    eng, pgc = _tp2_engine(ckpt)
    if rank == 1:
        add, sample = eng.add, engine_module.sample

        def failing_add(request_id, prompt, **kw):
            if prompt[0] == POISON_PROMPT_TOKEN:
                raise RuntimeError("no memory for this one")
            return add(request_id, prompt, **kw)

        def failing_sample(logits, spec, generator):
            if spec.seed == POISON_SEED:
                raise FloatingPointError("NaN in the probabilities")
            return sample(logits, spec, generator)

        eng.add, engine_module.sample = failing_add, failing_sample
    prompt = [5, 6, 7, 8, 9]
    greedy = lambda rid: Submit(rid, prompt, 10, RequestSampling(), ignore_eos=True)  # noqa: E731
    frontend = Rounds([[greedy(0)], [greedy(1), Submit(2, [POISON_PROMPT_TOKEN, 3], 10, RequestSampling()),
                                     Submit(3, [4, 3], 10, RequestSampling(temperature=1.0, seed=POISON_SEED))]]) \
        if rank == 0 else None
    serve_loop(eng, pgc, frontend=frontend)
    return (frontend.updates if rank == 0 else None), eng.local_work(), eng.stats()["kv_blocks_used"]


def test_request_failures_on_one_tp_rank_are_agreed(serve_ckpts, capfd):
    from tools.spawn import run_distributed

    (updates, work0, blocks0), (_, work1, blocks1) = run_distributed(tp_failures_rank, 2, serve_ckpts["standard"],
                                                                     timeout_s=240)
    tokens = lambda rid: [t for u in updates[rid] for t in u.tokens]  # noqa: E731
    assert len(tokens(0)) == 10 and tokens(1) == tokens(0)
    (add_failure,) = updates[2]
    assert add_failure.failed == ("the engine could not add the request on rank 1: RuntimeError: no memory for "
                                  "this one")
    assert [u.failed for u in updates[3] if u.failed] == ["sampling failed: FloatingPointError: NaN in the "
                                                           "probabilities"]
    assert updates[3][-1].failed and all(not u.finished for u in updates[3][:-1])
    assert (work0, work1, blocks0, blocks1) == (0, 0, 0, 0)
    # each failure's traceback is in rank 1's log once (the forked ranks write to this process's fd 2)
    err = capfd.readouterr().err
    assert err.count('raise FloatingPointError("NaN in the probabilities")') == 1, err
    assert err.count('raise RuntimeError("no memory for this one")') == 1, err


def tp_divergence_rank(rank, world, ckpt):
    from megatron.inference.loop import EngineDiverged

    eng, pgc = _tp2_engine(ckpt)
    if rank == 1:  # TP rank 1 alone cancels request 0 after the second step
        step = eng.step

        def step_then_cancel():
            out = step()
            if eng.steps == 2:
                eng.cancel(0)
            return out

        eng.step = step_then_cancel
    frontend = Rounds([[Submit(0, [5, 6, 7], 10, RequestSampling()), Submit(1, [8, 9], 10, RequestSampling())]]) \
        if rank == 0 else None
    try:
        serve_loop(eng, pgc, frontend=frontend)
    except EngineDiverged as err:
        return str(err)
    return None


def test_a_diverged_tp_group_is_an_engine_failure(serve_ckpts):
    from tools.spawn import run_distributed

    errors = run_distributed(tp_divergence_rank, 2, serve_ckpts["standard"], timeout_s=240)
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("the tensor-parallel ranks 0, 1 hold different requests before engine step 4 "
                                "(rank 0: 2 requests, digest "), errors
    assert "; rank 1: 1 requests, digest " in errors[0]
