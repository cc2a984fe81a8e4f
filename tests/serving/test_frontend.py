"""The HTTP front end (frontend.py) on 127.0.0.1 with a scripted engine in place of the serving
loop: a thread that takes the frontend's commands and publishes the token updates a test
chooses. Tests admission (queue limit with Retry-After, request timeout 504 with the request
cancelled in the engine), the API key, /health's states (starting, ok, stalled, draining,
dead), a failed request next to one that succeeds, stop token ids, batched prompts with echo
and log-probs, and the tokenizer endpoints. No model, no torch.distributed; exact comparisons.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from megatron.inference import protocol as P
from megatron.inference.engine import TokenUpdate
from megatron.inference.frontend import Frontend, FrontendConfig
from megatron.common.watchdog import Heartbeat

EOD = 0
VOCAB = 300


class CharTokenizer:
    """One id per character; id 0 is the end-of-document token "<eod>"."""

    eod = EOD
    vocab_size = VOCAB

    def tokenize(self, text):
        if text == "<eod>":
            return [EOD]
        return [ord(c) for c in text]

    def detokenize(self, ids):
        return "".join("<eod>" if i == EOD else chr(i) for i in ids)


class ScriptedEngine:
    """Plays the serving loop: ``script(submit) -> [TokenUpdate]`` answers each new request
    (None: never answer); cancellations are recorded."""

    def __init__(self, frontend, script):
        self.frontend, self.script = frontend, script
        self.submits, self.cancels = [], []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            cmds = self.frontend.take_commands(0.01)
            self.frontend.heartbeat.tick()
            self.cancels.extend(cmds.cancels)
            updates = []
            for submit in cmds.submits:
                self.submits.append(submit)
                updates.extend(self.script(submit) or [])
            if updates:
                self.frontend.publish(updates, [])

    def stop(self):
        self._stop.set()
        self.thread.join(5)


def _frontend(script, heartbeat=None, engine=True, tokenizer=None, **config):
    limits = P.Limits(context=64, vocab_size=VOCAB, max_request_tokens=48)
    frontend = Frontend(tokenizer=tokenizer or CharTokenizer(), chat_render=P.simple_chat_prompt,
                        heartbeat=heartbeat or Heartbeat(),
                        config=FrontendConfig(served_model="m", limits=limits, port=0, **config))
    frontend.start()
    frontend.url = f"http://127.0.0.1:{frontend.port}"
    frontend.engine = ScriptedEngine(frontend, script) if engine else None
    return frontend


def _close(frontend):
    if frontend.engine is not None:
        frontend.engine.stop()
    frontend.request_stop()
    frontend.join(10)


def _request(url, path, body=None, headers=None, timeout=30):
    """(status, JSON body, response headers)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), {k.lower(): v for k, v in err.headers.items()}


def _echo_tokens(text, logprob=-0.5):
    """A script answering each prompt with the tokens of ``text`` (one update, finished), each
    with a log-prob and one alternative, and prompt log-probs when asked."""

    def script(submit):
        ids = [ord(c) for c in text][:submit.max_tokens]
        spec = submit.sampling
        entries = [(t, logprob, ((t, logprob),) * min(1, spec.logprobs or 0)) for t in ids] \
            if spec.logprobs is not None else None
        prompt = [(t, -1.0, ()) for t in submit.prompt[1:]] if spec.prompt_logprobs else None
        return [TokenUpdate(submit.request_id, ids, finished=True, logprobs=entries, prompt_logprobs=prompt)]

    return script


@pytest.fixture
def frontend():
    made = []

    def make(script, **kw):
        made.append(_frontend(script, **kw))
        return made[-1]

    yield make
    for f in made:
        _close(f)


def test_request_timeout_answers_504_and_cancels_in_the_engine(frontend):
    f = frontend(lambda submit: None, request_timeout=0.3)
    status, body, _ = _request(f.url, "/v1/completions", {"prompt": "ab", "max_tokens": 4})
    assert status == 504 and body["error"]["code"] == "timeout"
    deadline = time.monotonic() + 5
    # the answer goes out while the request still counts in flight (so that a stopping server waits
    # for it): its counters drop just after the client has it
    while (not f.engine.cancels or f.in_flight) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert f.engine.cancels == [f.engine.submits[0].request_id]
    assert f.queued == 0 and f.in_flight == 0


def test_a_full_queue_answers_503_with_retry_after(frontend):
    f = frontend(lambda submit: None, max_queued_requests=2, request_timeout=2)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_request, f.url, "/v1/completions", {"prompt": "ab"})
        deadline = time.monotonic() + 5
        while f.queued < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, body, headers = _request(f.url, "/v1/completions", {"prompt": ["a", "b"]})  # two more
        assert status == 503 and headers.get("retry-after") == "1" and "--max-queued-requests" in body["error"]["message"]
        status, _, _ = _request(f.url, "/v1/completions", {"prompt": "a", "max_tokens": 1})  # one more fits
        assert status == 504  # (nothing answers in this test)
        assert waiting.result()[0] == 504


def test_api_key_guards_every_path_but_health_and_metrics(frontend):
    f = frontend(_echo_tokens("hi"), api_keys=("s3cret",))
    body = {"prompt": "a", "max_tokens": 2}
    status, err, headers = _request(f.url, "/v1/completions", body)
    assert status == 401 and headers.get("www-authenticate") == "Bearer" and err["error"]["code"] == "invalid_api_key"
    assert _request(f.url, "/v1/completions", body, {"Authorization": "Bearer wrong"})[0] == 401
    assert _request(f.url, "/tokenize", {"prompt": "a"})[0] == 401
    assert _request(f.url, "/v1/models")[0] == 401
    assert _request(f.url, "/no/such/path")[0] == 401  # no route discovery without the key
    status, out, _ = _request(f.url, "/v1/completions", body, {"Authorization": "Bearer s3cret"})
    assert status == 200 and out["choices"][0]["text"] == "hi"
    assert _request(f.url, "/health")[0] == 200
    with urllib.request.urlopen(f.url + "/metrics", timeout=10) as resp:
        assert resp.status == 200


def test_health_follows_the_heartbeat_drain_and_death(frontend):
    clock = [100.0]
    heartbeat = Heartbeat(lambda: clock[0])
    f = frontend(lambda submit: None, heartbeat=heartbeat, engine=False, stall_timeout=1.0)
    assert _request(f.url, "/health")[:2] == (503, {"status": "starting"})
    heartbeat.tick()
    assert _request(f.url, "/health")[0] == 200
    clock[0] += 5.0  # the loop has made no progress for 5 s
    status, body, _ = _request(f.url, "/health")
    assert status == 503 and body["status"] == "stalled" and body["seconds_since_last_step"] == 5
    assert "--stall-timeout 1 or 5 x the longest recent step, 0.0 s" in body["reason"]
    heartbeat.tick()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_request, f.url, "/v1/completions", {"prompt": "a"})
        deadline = time.monotonic() + 5
        while not f.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        f.mark_dead("rank 1 died")
        status, body, _ = pending.result(timeout=10)
    assert status == 503 and "rank 1 died" in body["error"]["message"]
    assert _request(f.url, "/health")[:2] == (503, {"status": "dead", "reason": "rank 1 died"})
    assert _request(f.url, "/v1/completions", {"prompt": "a"})[0] == 503


def test_a_failed_request_is_a_5xx_and_the_next_one_succeeds(frontend):
    def script(submit):
        if submit.prompt == [ord("x")]:
            return [TokenUpdate(submit.request_id, [], finished=True, failed="sampling failed: boom")]
        return _echo_tokens("ok")(submit)

    f = frontend(script)
    status, body, _ = _request(f.url, "/v1/completions", {"prompt": "x"})
    assert status == 500 and "boom" in body["error"]["message"] and body["error"]["type"] == "server_error"
    status, body, _ = _request(f.url, "/v1/completions", {"prompt": "y"})
    assert status == 200 and body["choices"][0]["text"] == "ok"
    assert f.metrics.requests["failed"] == 1 and f.metrics.requests["completed"] == 1


class BuggyTokenizer(CharTokenizer):
    """Detokenizing id 1 raises: a bug in the front end's handling of one token."""

    def detokenize(self, ids):
        if 1 in ids:
            raise KeyError("no text for id 1")
        return super().detokenize(ids)


def test_an_exception_while_answering_cancels_the_requests_in_the_engine(frontend, capsys):
    """A bug while a request is answered (here: its first token cannot be detokenized) is a 500 for
    that request, its traceback on the server's stderr, and every one of its engine requests still
    decoding is cancelled (none decodes on for nobody); the next request is served."""
    def script(submit):
        if submit.prompt == [ord("a")]:
            return [TokenUpdate(submit.request_id, [1])]  # unfinished: more would follow
        if submit.prompt == [ord("q")]:
            return _echo_tokens("ok")(submit)
        return None  # the second prompt: still decoding

    f = frontend(script, tokenizer=BuggyTokenizer())
    status, body, _ = _request(f.url, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 8})
    assert status == 500 and body["error"]["message"] == "internal error: KeyError: 'no text for id 1'"
    deadline = time.monotonic() + 5
    while len(f.engine.cancels) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(f.engine.cancels) == sorted(s.request_id for s in f.engine.submits)
    assert f.queued == 0 and f.in_flight == 0
    assert "Traceback" in capsys.readouterr().err
    assert _request(f.url, "/v1/completions", {"prompt": "q"})[0] == 200


def test_stop_token_ids_cut_the_output_and_cancel(frontend):
    def script(submit):
        return [TokenUpdate(submit.request_id, [ord("a"), ord("b")]),
                TokenUpdate(submit.request_id, [ord("c"), ord("d")])]

    f = frontend(script)
    status, body, _ = _request(f.url, "/v1/completions", {"prompt": "q", "max_tokens": 8, "return_token_ids": True,
                                                          "stop_token_ids": [ord("c")]})
    assert status == 200 and body["choices"][0]["text"] == "ab" and body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["token_ids"] == [ord("a"), ord("b")]
    deadline = time.monotonic() + 5
    while not f.engine.cancels and time.monotonic() < deadline:
        time.sleep(0.01)
    assert f.engine.cancels == [f.engine.submits[0].request_id]


def test_batched_prompts_echo_and_logprobs(frontend):
    f = frontend(_echo_tokens("xy"))
    status, body, _ = _request(f.url, "/v1/completions", {"prompt": ["ab", [ord("c")]], "max_tokens": 2,
                                                          "echo": True, "logprobs": 1, "temperature": 0})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    first, second = body["choices"]
    assert first["text"] == "abxy" and second["text"] == "cxy"
    lp = first["logprobs"]
    assert lp["tokens"] == ["a", "b", "x", "y"] and lp["token_logprobs"] == [None, -1.0, -0.5, -0.5]
    assert lp["top_logprobs"] == [None, {"b": -1.0}, {"x": -0.5}, {"y": -0.5}] and lp["text_offset"] == [0, 1, 2, 3]
    assert second["logprobs"]["token_logprobs"] == [None, -0.5, -0.5]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert all(s.sampling.prompt_logprobs for s in f.engine.submits)
    # streamed: the prompt comes in each choice's first chunk; offsets continue across chunks
    req = urllib.request.Request(f.url + "/v1/completions", data=json.dumps(
        {"prompt": "ab", "max_tokens": 2, "echo": True, "logprobs": 0, "stream": True}).encode(),
        headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                  if line.startswith("data: {")]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == "abxy"
    chat = _request(f.url, "/v1/chat/completions", {"messages": [{"role": "u", "content": "hi"}], "max_tokens": 2,
                                                    "logprobs": True, "top_logprobs": 1})[1]
    assert [c["token"] for c in chat["choices"][0]["logprobs"]["content"]] == ["x", "y"]


def _stream_logprobs(url, body):
    """The streamed choice's text and its log-prob tokens, chunks joined."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        choices = [c for line in resp.read().decode().splitlines() if line.startswith("data: {")
                   for c in json.loads(line[6:])["choices"]]
    return "".join(c["text"] for c in choices), [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]


def test_the_token_that_ends_a_choice_keeps_its_logprob_entry(frontend):
    """lm-eval's echo scoring (``max_tokens: 1``, ``token_logprobs[ctxlen:-1]``) needs one entry past
    the prompt also when the generated token is EOD; without it the prompt's last log-prob was dropped."""
    f = frontend(_echo_tokens(chr(EOD)))
    body = {"prompt": "ab", "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0, "return_token_ids": True}
    choice = _request(f.url, "/v1/completions", body)[1]["choices"][0]
    assert choice["text"] == "ab" and choice["finish_reason"] == "stop" and choice["token_ids"] == []
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "<eod>"] and lp["token_logprobs"] == [None, -1.0, -0.5]
    assert lp["text_offset"] == [0, 1, 2]
    assert _stream_logprobs(f.url, body) == ("ab", ["a", "b", "<eod>"])
    chat = _request(f.url, "/v1/chat/completions", {"messages": [{"role": "u", "content": "hi"}], "max_tokens": 1,
                                                    "logprobs": True})[1]["choices"][0]
    assert chat["message"]["content"] == "" and [c["token"] for c in chat["logprobs"]["content"]] == ["<eod>"]
    # a stop token id ends the text and token ids before it, and keeps its entry too
    g = frontend(_echo_tokens("xcy"))
    choice = _request(g.url, "/v1/completions", {"prompt": "a", "max_tokens": 3, "logprobs": 0, "return_token_ids": True,
                                                 "stop_token_ids": [ord("c")]})[1]["choices"][0]
    assert choice["text"] == "x" and choice["token_ids"] == [ord("x")] and choice["logprobs"]["tokens"] == ["x", "c"]
    # with ignore_eos the EOD is an ordinary token of the output
    h = frontend(_echo_tokens(chr(EOD) + "z"))
    choice = _request(h.url, "/v1/completions", {"prompt": "a", "max_tokens": 2, "logprobs": 0, "ignore_eos": True})[1]
    assert choice["choices"][0]["logprobs"]["tokens"] == ["<eod>", "z"]


def test_tokenizer_endpoints(frontend):
    f = frontend(_echo_tokens("z"), enable_tokenizer_info=True)
    status, body, _ = _request(f.url, "/tokenize", {"prompt": "ab", "add_special_tokens": False,
                                                    "return_token_strs": True})
    assert status == 200 and body == {"count": 2, "max_model_len": 64, "tokens": [97, 98], "token_strs": ["a", "b"]}
    assert _request(f.url, "/v1/detokenize", {"tokens": [104, 105]})[1] == {"prompt": "hi"}
    assert _request(f.url, "/detokenize", {"tokens": [VOCAB]})[0] == 400
    info = _request(f.url, "/tokenizer_info")[1]
    assert info["eos_token"] == "<eod>" and info["bos_token"] is None and info["model_max_length"] == 64
    assert P.ChatTemplate(info["chat_template"])([{"role": "u", "content": "x"}]) == "u: x\nassistant:"
    g = frontend(_echo_tokens("z"))
    assert _request(g.url, "/tokenizer_info")[0] == 404  # opt-in, as vLLM's


def test_bodies_over_the_limit_are_413(frontend):
    f = frontend(_echo_tokens("z"), max_body_bytes=100)
    status, body, _ = _request(f.url, "/v1/completions", {"prompt": "a" * 200})
    assert status == 413 and "--max-body-bytes" in body["error"]["message"]


def test_an_error_answer_is_sent_while_its_request_still_counts_in_flight():
    """``mark_dead`` fails the request in flight with a 503, and the engine thread then waits for
    ``in_flight`` to reach 0 (``wait_answered``) before the process may exit at once
    (``serve._engine_failed``, the front end inside rank 0): the 503 must be sent while the request
    still counts, or the process can end before it is written (the client then sees its connection
    closed without an answer). Driven through the ASGI app on one event loop: deterministic."""
    import asyncio

    limits = P.Limits(context=64, vocab_size=VOCAB, max_request_tokens=48)
    f = Frontend(tokenizer=CharTokenizer(), chat_render=P.simple_chat_prompt, heartbeat=Heartbeat(),
                 config=FrontendConfig(served_model="m", limits=limits))
    sent = []

    async def main():
        messages = [{"type": "http.request", "body": json.dumps({"prompt": "ab", "max_tokens": 4}).encode(),
                     "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client stays connected

        async def send(message):
            sent.append((message["type"], message.get("status"), f.in_flight))

        scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": []}
        task = asyncio.ensure_future(f.app(scope, receive, send))
        while not f.in_flight:
            await asyncio.sleep(0.001)
        f.book.fail_all("rank 1 died")  # what mark_dead runs on the event loop
        await task

    asyncio.run(main())
    assert sent[0] == ("http.response.start", 503, 1), sent
    assert f.in_flight == 0
