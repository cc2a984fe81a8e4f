"""Requests held while the engine restarts (``megatron.inference.admission``), through the real
``Frontend`` behind the real ``EngineBridge`` with ``--max-restarts`` and a scripted rank 0 on the
real ``EngineLink`` (``test_link``'s setup: no model, no torch.distributed; exact comparisons).

- An engine lost with a restart left: a non-streamed request in flight (with tokens it had already
  received, not yet sent), a streamed one whose stream has not started and one that arrives during
  the outage are answered by the restarted engine, sent to it once each under new ids, in arrival
  order, with their prompt, length and sampling (its seed) unchanged; only the new engine's tokens
  reach the clients; a late answer of the lost engine for an old id is dropped (no double answer);
  a streamed request whose stream had started gets the error event; ``/health`` is 503 ``lost``
  throughout the outage; ``/metrics`` counts the resubmissions.
- Held requests keep their bounds: ``--request-timeout`` (504), ``--max-queued-requests`` (503 with
  ``Retry-After``), and get the 503 when the engine will not come back (``mark_dead``).
- A request is held across one loss only: in flight at the next one, it gets the 503.
- The restarted rank 0's first beat goes out as its loop starts, not a beat interval later:
  ``/health`` turns 200 with it.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import urllib.error
import urllib.request

from megatron.common.watchdog import Heartbeat
from megatron.inference.engine import TokenUpdate
from megatron.inference.link import EngineLink
from megatron.inference.metrics import parse_metrics
from tests.serving.test_frontend import _request
from tests.serving.test_link import LIMITS, Setup, _health, _until


class SSEClient(threading.Thread):
    """A streamed completion read event by event (``events``: the JSON payloads, then "[DONE]")."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, dict(body, stream=True)
        self.status = None
        self.events: list = []
        self.start()

    def run(self):
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(self.body).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                self.status = resp.status
                for line in resp:
                    if line.startswith(b"data: "):
                        payload = line[6:].strip().decode()
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
        except urllib.error.HTTPError as err:
            self.status = err.code

    def text(self) -> str:
        return "".join(c["text"] for e in self.events if isinstance(e, dict) for c in e.get("choices", []))


def _metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode())


def _partial(submit):
    """The engine that will be lost: two tokens of an unfinished answer for prompts "p" and "s"."""
    if submit.prompt in ([ord("p")], [ord("s")]):
        return [TokenUpdate(submit.request_id, [ord("x"), ord("y")])]
    return []


def test_requests_that_sent_nothing_yet_go_to_the_restarted_engine_once():
    setup = Setup(max_restarts=2)
    try:
        lost = setup.engine(script=_partial)
        f = setup.serve()
        _until(lambda: _health(f.url)[0] == 200)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            plain = pool.submit(_request, f.url, "/v1/completions",
                                {"prompt": "p", "max_tokens": 4, "temperature": 0.7, "seed": 3})
            _until(lambda: len(lost.submits) == 1)
            waiting = SSEClient(f.url, {"prompt": "q", "max_tokens": 4})  # its stream has not started
            _until(lambda: len(lost.submits) == 2)
            started = SSEClient(f.url, {"prompt": "s", "max_tokens": 4})  # its stream has started
            _until(lambda: len(lost.submits) == 3 and started.events)
            old = {s.prompt[0]: s for s in lost.submits}
            lost.close()  # rank 0 exits: the link closes
            started.join(30)
            assert started.status == 200 and started.text() == "xy" and started.events[-1] == "[DONE]"
            assert started.events[-2]["error"]["message"] == ("the engine stopped serving: rank 0 of the engine "
                                                              "closed the link: it exited")
            _until(lambda: f.queued == 2 and f.in_flight == 2)  # held: "p" (its tokens forgotten) and "q"
            assert _health(f.url) == (503, {"status": "lost", "reason": "rank 0 of the engine closed the link: "
                                                                         "it exited"})
            late = pool.submit(_request, f.url, "/v1/completions", {"prompt": "n", "max_tokens": 4})
            _until(lambda: f.queued == 3)  # arrived during the outage: held, not refused
            f.publish([TokenUpdate(old[ord("p")].request_id, [ord("z")], finished=True)], [])  # the lost engine's
            assert _metrics(f.url)["moe_serve_requests_held"] == 3  # late answer: dropped
            assert not plain.done() and not late.done() and waiting.status is None
            back = setup.engine()  # the restarted rank 0: answers "ok"
            assert plain.result(30)[:2][0] == 200 and plain.result()[1]["choices"][0]["text"] == "ok"
            assert late.result(30)[0] == 200 and late.result()[1]["choices"][0]["text"] == "ok"
            waiting.join(30)
            assert waiting.status == 200 and waiting.text() == "ok" and waiting.events[-1] == "[DONE]"
        assert [s.prompt for s in back.submits] == [[ord("p")], [ord("q")], [ord("n")]]  # once each, in order
        assert not {s.request_id for s in back.submits} & {s.request_id for s in lost.submits}
        again = back.submits[0]
        assert (again.max_tokens, again.sampling, again.ignore_eos) == (4, old[ord("p")].sampling, False)
        assert again.sampling.seed == 3 and again.sampling.temperature == 0.7
        metrics = _metrics(f.url)
        assert metrics["moe_serve_requests_resubmitted_total"] == 2 and metrics["moe_serve_requests_held"] == 0
        assert metrics['moe_serve_requests_total{status="completed"}'] == 3
        assert metrics['moe_serve_requests_total{status="lost"}'] == 1
        assert metrics["moe_serve_engine_restarts_total"] == 1
        assert any("holding the requests that have not started answering" in line for line in setup.logs)
    finally:
        setup.close()


def test_held_requests_keep_their_timeout_and_queue_bound_and_fail_when_the_engine_cannot_come_back():
    setup = Setup(max_restarts=1)
    try:
        lost = setup.engine(answer=False)
        f = setup.serve(request_timeout=2.0, max_queued_requests=1)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(_request, f.url, "/v1/completions", {"prompt": "a"})
            _until(lambda: lost.submits)
            lost.close()
            status, body, _ = first.result(30)  # held, never resubmitted: its own timeout
            assert status == 504 and "--request-timeout 2 s" in body["error"]["message"]
            _until(lambda: f.in_flight == 0)
            held = pool.submit(_request, f.url, "/v1/completions", {"prompt": "b"})
            _until(lambda: f.queued == 1)
            status, body, headers = _request(f.url, "/v1/completions", {"prompt": "c"})
            assert status == 503 and headers["retry-after"] == "1" and "--max-queued-requests 1" in \
                body["error"]["message"]
            assert _health(f.url)[0] == 503
            f.mark_dead("the engine exited with status 1 (torchrun: no restart left)")
            status, body, _ = held.result(30)
        assert status == 503 and body["error"]["message"] == ("the engine stopped serving: the engine exited with "
                                                              "status 1 (torchrun: no restart left)")
        metrics = _metrics(f.url)
        assert metrics['moe_serve_requests_total{status="timeout"}'] == 1
        assert metrics['moe_serve_requests_total{status="lost"}'] == 1
        assert metrics["moe_serve_requests_resubmitted_total"] == 0  # the engine never came back
    finally:
        setup.close()


def test_a_request_is_held_across_one_engine_loss_only():
    setup = Setup(max_restarts=3)
    try:
        first = setup.engine(answer=False)
        f = setup.serve()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_request, f.url, "/v1/completions", {"prompt": "a"})
            _until(lambda: first.submits)
            first.close()
            second = setup.engine(answer=False)
            _until(lambda: second.submits)  # sent again
            second.close()  # lost again with the request in flight
            status, body, _ = pending.result(30)
        assert status == 503 and "closed the link: it exited" in body["error"]["message"]
        assert _metrics(f.url)["moe_serve_requests_resubmitted_total"] == 1
    finally:
        setup.close()


def test_the_first_beat_goes_out_when_the_loop_starts():
    """A beat interval of 60 s: without the first beat at once, ``/health`` would stay
    ``starting`` for a minute after the loop started."""
    setup = Setup()
    try:
        heartbeat = Heartbeat()
        link = EngineLink.connect(setup.address, setup.authkey, heartbeat, beat_interval_s=60.0, timeout_s=10)
        link.hello(LIMITS, {"model": "m"})
        assert setup.bridge.wait_engine(10)
        f = setup.serve()
        assert _health(f.url) == (503, {"status": "starting"})
        heartbeat.tick()  # the loop's first all-gather
        _until(lambda: _health(f.url)[0] == 200, timeout=20)
        link.join(1)
    finally:
        setup.close()


def test_an_engine_lost_while_the_server_drains_is_not_waited_for():
    """SIGTERM, then the engine lost with a request in flight: nothing will restart it for the
    stopping server, so the request gets its 503 at once instead of being held."""
    setup = Setup(max_restarts=2)
    try:
        engine = setup.engine(answer=False)
        f = setup.serve()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_request, f.url, "/v1/completions", {"prompt": "a"})
            _until(lambda: engine.submits)
            f.request_stop()
            engine.close()
            status, body, _ = pending.result(30)
        assert status == 503 and "closed the link: it exited" in body["error"]["message"]
        assert any("stopping: failing the requests in flight" in line for line in setup.logs)
    finally:
        setup.close()
