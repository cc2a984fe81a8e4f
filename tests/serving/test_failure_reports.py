"""What a failed engine says (``megatron.inference.failures``): the rank that failed and why, in
our words, to the clients, ``/health`` and the log; the raw collective error only in the log.

- ``describe`` on a store of its own (``HashStore``): a collective error names the peer that
  reported its own failure, else the peer whose process is gone (a zombie counts as gone), else "a
  peer rank"; this rank's own error is reported to the store for its peers and keeps its traceback.
- End to end (slow): ``serve --nproc-per-node 2 --max-restarts 1``, kill -9 of rank 1 while a
  stream is in flight: the stream's error event, ``/health`` and the log name rank 1 and its pid,
  none carries gloo's text; the log has no traceback. A new request waits for the restarted engine
  and is answered by it; ``/metrics`` counts the restart and the lost requests; SIGTERM to the front end then says
  ``server stopped`` once, with no traceback (torchrun exits on its own, never signalled).
Exact strings, no timing asserted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch.distributed as dist

from megatron.common.process import pid_alive
from megatron.inference.failures import RankRoster, describe

GLOO_RESET = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                          "[127.0.0.1]:41695: Connection reset by peer. This is typically caused by a remote worker "
                          "hanging or bugs in the application. GLHF!")


def _zombie() -> subprocess.Popen:
    """A child that has exited and is not reaped yet (what a killed rank is until torchrun reaps it)."""
    proc = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as f:
            stat = f.read()
        if stat[stat.rindex(")") + 2] == "Z":
            return proc
        time.sleep(0.01)
    raise AssertionError("the child did not exit")


def test_a_peer_failure_names_the_peer_and_an_own_failure_is_reported():
    store = dist.HashStore()
    zombie = _zombie()
    try:
        assert not pid_alive(zombie.pid) and pid_alive(os.getpid())
        rank0 = RankRoster(store, 0, 3).register()
        RankRoster(store, 2, 3).register()  # rank 2: this process, alive
        store.set("rank/1", f"{zombie.pid} {store.get('rank/0').decode().split(' ', 1)[1]}")
        report = describe(0, GLOO_RESET, rank0)
        assert report.reason == f"rank 1 of the engine exited (pid {zombie.pid}: killed or crashed)"
        assert report.log == [f"rank 0: the engine stopped: {report.reason}",
                              f"rank 0: the collective error: RuntimeError: {GLOO_RESET}"]
        assert not report.traceback
    finally:
        zombie.wait()
    # a rank that failed on its own says so first: its peers name it and its cause
    own = describe(2, ValueError("NaN in the logits\nmore detail"), RankRoster(store, 2, 3))
    assert own.reason == "the engine loop failed on rank 2 (ValueError: NaN in the logits)" and own.traceback
    assert describe(0, GLOO_RESET, rank0).reason == "rank 2 of the engine failed (ValueError: NaN in the logits)"
    # nothing to find (a rank of another machine killed outright): said honestly
    alone = RankRoster(dist.HashStore(), 0, 2).register()
    assert describe(0, GLOO_RESET, alone, wait_s=0.1).reason == (
        "rank 0 lost its connection to a peer rank of the engine (killed, crashed or unreachable)")


def _get(url: str, path: str):
    try:
        with urllib.request.urlopen(url + path, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


PROMPTS = 16


@pytest.mark.slow
def test_kill_9_of_rank_1_is_reported_as_rank_1_and_a_clean_stop_is_one_line(serve_ckpts, tmp_path):
    from megatron.inference.metrics import parse_metrics
    from tests.serving.conftest import Server, post
    from tools.faults.launch import rank_pid

    srv = Server(serve_ckpts["standard"], tmp_path, nproc=2, frontend_process=True,
                 extra=["--expert-model-parallel-size", 2, "--max-restarts", 1])
    try:
        events: list = []
        decoding = threading.Event()
        budget = min(srv.info["context_length"], srv.info["max_request_tokens"]) - 8  # far from done when killed

        def client():
            body = {"prompt": ["Hello"] * PROMPTS, "max_tokens": budget, "ignore_eos": True, "stream": True}
            req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                for line in resp:
                    if line.startswith(b"data: "):
                        events.append(line[6:].decode().strip())
                        decoding.set()

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        assert decoding.wait(60)
        rank1 = rank_pid(srv.proc.pid, 1)
        os.kill(rank1, signal.SIGKILL)
        thread.join(120)
        named = f"rank 1 of the engine exited (pid {rank1}: killed or crashed)"
        error = json.loads(events[-2])["error"]["message"]
        assert error == f"the engine stopped serving: {named}" and events[-1] == "[DONE]"
        status, health = _get(srv.url, "/health")
        if status == 503:  # (the restarted engine may already be back)
            assert json.loads(health) == {"status": "lost", "reason": named}
        status, body = post(srv.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, timeout=180)
        assert status == 200, body  # held while the ranks restart, answered by the new ones
        deadline = time.monotonic() + 180
        while _get(srv.url, "/health")[0] != 200:
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.output()[-3000:]
            time.sleep(0.2)
        metrics = parse_metrics(_get(srv.url, "/metrics")[1])
        assert metrics["moe_serve_engine_restarts_total"] == 1
        assert metrics['moe_serve_requests_total{status="lost"}'] == PROMPTS
        os.kill(srv.proc.pid, signal.SIGTERM)  # the front end alone, as a user's kill or systemd's stop
        assert srv.proc.wait(120) == 0
    finally:
        srv.stop()
    out = srv.output()
    assert f"rank 0: the engine stopped: {named}\n" in out
    assert "rank 0: the collective error: RuntimeError: " in out  # the raw error: in the log only
    assert "Traceback" not in out and "SignalException" not in out, out[-5000:]
    assert out.count("server stopped") == 1 and out.rstrip().endswith("server stopped"), out[-3000:]
