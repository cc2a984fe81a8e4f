"""The front end in its own process outlives its engine (``serve --nproc-per-node 2 --max-restarts
2``: two ranks under torchrun, EP = 2, the tiny standard checkpoint, 127.0.0.1, ``--stall-timeout
2 --watchdog-timeout 5``).

- SIGSTOP rank 0 while a long request is in flight, then send a new one: both get a 503 within
  ``--stall-timeout`` + 5 s of the signal (slack for a loaded 2-core machine; the design bound is
  the stall timeout plus one poll), ``/health`` answers 503 ``lost`` with the reason; the front end
  SIGKILLs the stopped rank 0, torchrun restarts both ranks, the new rank 0 reconnects and the same
  port answers 200 again, with the greedy tokens of the run before the fault (exact). Then SIGSTOP
  rank 1: rank 0 still beats, but the loop stalls; the front end finds the stopped rank, answers
  the request in flight with a 503 within the same bound and SIGKILLs it; the engine comes back
  again. Then kill -9 the new rank 0: the request in flight gets a 503 at once, torchrun has no
  restart left and the front end exits non-zero.
- SIGTERM: a request in flight completes, the engine stops, the front end exits 0 and says
  ``server stopped`` once (no traceback: torchrun exits on its own).

Where the front end lived in rank 0 (``torchrun --max-restarts 1 -m megatron.inference.serve``), a
stopped rank 0 left its clients waiting until rank 1's watchdog fired and torchrun killed rank 0 30
s later (``--watchdog-timeout`` + 30 s), when their connections reset.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.serving.conftest import PROMPTS, Server, post
from tools.faults.launch import rank_pid

pytestmark = pytest.mark.slow

STALL_S = 2.0
SLACK_S = 5.0


def _health(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _greedy(url):
    status, body = post(url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0,
                                                 "return_token_ids": True})
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def _long_request(srv, answers: dict):
    """A request that runs for a while (64 prompts filling their context), answered into ``answers``."""
    budget = min(srv.info["context_length"], srv.info["max_request_tokens"]) - 8

    def client():
        try:
            answers["out"] = post(srv.url, "/v1/completions", {"prompt": ["Hello"] * 64, "max_tokens": budget,
                                                               "temperature": 0, "ignore_eos": True}, timeout=120)
        except OSError as err:  # the connection went away: not a clean answer
            answers["out"] = (None, {"error": {"message": repr(err)}})
        answers["at"] = time.monotonic()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    time.sleep(0.5)  # in the engine
    return thread


def _names_stopped_rank0(message: str, pid: int) -> bool:
    """The front end's reason: rank 0's link fell silent, or it found rank 0 stopped while the loop
    stalled (whichever it saw first)."""
    return (f"rank 0 of the engine (pid {pid}) sent nothing for" in message
            or f"rank 0 (pid {pid}) of the engine is stopped (SIGSTOP)" in message)


def _wait_serving(srv, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while _health(srv.url)[0] != 200:
        assert time.monotonic() < deadline and srv.proc.poll() is None, srv.output()[-3000:]
        time.sleep(0.2)


def test_a_stopped_rank0_is_answered_within_the_stall_timeout_and_the_engine_comes_back(serve_ckpts, tmp_path):
    srv = Server(serve_ckpts["standard"], tmp_path, nproc=2, frontend_process=True,
                 extra=["--expert-model-parallel-size", 2, "--max-restarts", 2, "--stall-timeout", STALL_S,
                        "--watchdog-timeout", 5])
    try:
        reference = _greedy(srv.url)
        rank0 = rank_pid(srv.proc.pid, 0)
        answers: dict = {}
        waiting = _long_request(srv, answers)
        t0 = time.monotonic()
        os.kill(rank0, signal.SIGSTOP)
        time.sleep(0.2)
        status, body = post(srv.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}, timeout=60)
        new_at = time.monotonic() - t0
        assert status == 503 and _names_stopped_rank0(body["error"]["message"], rank0), body
        assert new_at < STALL_S + SLACK_S, new_at
        waiting.join(60)
        status, body = answers["out"]
        assert status == 503 and _names_stopped_rank0(body["error"]["message"], rank0), body
        assert answers["at"] - t0 < STALL_S + SLACK_S, answers["at"] - t0
        status, health = _health(srv.url)
        if status == 503:  # (the restarted engine may already be back)
            assert health["status"] == "lost" and _names_stopped_rank0(health["reason"], rank0), health
        try:
            os.kill(rank0, signal.SIGCONT)  # the front end SIGKILLed it already
        except ProcessLookupError:
            pass

        _wait_serving(srv)
        assert _greedy(srv.url) == reference

        # SIGSTOP rank 1: found stopped while the loop stalls, answered within the same bound
        rank1 = rank_pid(srv.proc.pid, 1)
        waiting = _long_request(srv, answers)
        t0 = time.monotonic()
        os.kill(rank1, signal.SIGSTOP)
        waiting.join(60)
        status, body = answers["out"]
        assert status == 503 and f"rank 1 (pid {rank1}) of the engine is stopped" in body["error"]["message"], body
        assert answers["at"] - t0 < STALL_S + SLACK_S, answers["at"] - t0
        _wait_serving(srv)
        assert _greedy(srv.url) == reference

        # kill -9 the restarted rank 0: answered at once; no restart is left
        waiting = _long_request(srv, answers)
        t0 = time.monotonic()
        os.kill(rank_pid(srv.proc.pid, 0), signal.SIGKILL)
        waiting.join(60)
        status, body = answers["out"]
        assert status == 503 and "closed the link" in body["error"]["message"], body
        assert answers["at"] - t0 < SLACK_S
        assert srv.proc.wait(120) != 0
        assert "no restart left" in srv.output()
    finally:
        srv.stop()


def test_sigterm_finishes_the_request_in_flight_and_exits_0(serve_ckpts, tmp_path):
    srv = Server(serve_ckpts["standard"], tmp_path, nproc=2, frontend_process=True,
                 extra=["--expert-model-parallel-size", 2])
    answers: dict = {}
    waiting = _long_request(srv, answers)
    os.kill(srv.proc.pid, signal.SIGTERM)  # the front end alone: it drains, then stops the engine
    waiting.join(120)
    assert answers["out"][0] == 200, answers
    assert srv.proc.wait(120) == 0, srv.output()[-3000:]
    out = srv.output()  # one line says it stopped: torchrun exits on its own, never signalled (no traceback)
    assert out.count("server stopped") == 1 and "Traceback" not in out and "SignalException" not in out, out[-3000:]
