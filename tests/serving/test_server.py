"""The HTTP server on one rank (127.0.0.1 only): greedy output equals evaluate_lm's generation,
a real OpenAI client streams and not, concurrent requests equal sequential ones, bad requests get
a one-line 4xx and the server keeps serving, a disconnecting client's KV blocks are freed, SIGTERM
drains and exits 0. Token comparisons are exact (greedy decoding on a model with peaked
next-token distributions); no timing is asserted.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import pytest

from tests.serving.conftest import PROMPTS, Server, get_metrics, offline_greedy, post

# servers started as processes
pytestmark = pytest.mark.slow

MAX_NEW = 24


@pytest.fixture(scope="module")
def server(serve_ckpts, tmp_path_factory):
    srv = Server(serve_ckpts["standard"], tmp_path_factory.mktemp("srv"))
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]


@pytest.fixture(scope="module")
def reference(serve_ckpts):
    out, mode = offline_greedy(serve_ckpts["standard"], PROMPTS, MAX_NEW)
    assert mode == "kv_cache"  # the static-engine path of evaluate_lm
    return out


def _complete(url, prompt, **kw):
    status, body = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
                                                 "return_token_ids": True, **kw})
    assert status == 200, body
    return body["choices"][0]


def test_greedy_equals_offline_generation(server, reference):
    for prompt, (tokens, text) in zip(PROMPTS, reference):
        choice = _complete(server.url, prompt)
        assert choice["token_ids"] == tokens
        assert choice["text"] == text
        assert choice["finish_reason"] == ("length" if len(tokens) == MAX_NEW else "stop")


def test_concurrent_requests_equal_sequential(server, reference):
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        choices = list(pool.map(lambda p: _complete(server.url, p), PROMPTS * 2))
    assert [c["token_ids"] for c in choices] == [t for t, _ in reference] * 2
    metrics = get_metrics(server.url)
    assert metrics['moe_serve_kv_cache_blocks_used{rank="0"}'] == 0


def test_stop_string_cuts_like_evaluate_lm(server, reference):
    from megatron.training.lm_eval_adapter import greedy_stop

    tokens, text = reference[0]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    choice = _complete(server.url, PROMPTS[0], stop=[stop])
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == greedy_stop(text, [stop])[0]


def test_openai_client_streaming_and_not(server, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = server.info["model"]
    assert [m.id for m in client.models.list().data] == [model]
    full = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0)
    assert full.choices[0].text == reference[1][1]
    assert full.usage.completion_tokens == len(reference[1][0])
    pieces, usage = [], None
    for chunk in client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == reference[1][1] and usage.completion_tokens == len(reference[1][0])
    messages = [{"role": "user", "content": "Speak."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert chat.choices[0].message.content == streamed and chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)


def test_seeded_sampling_is_reproducible(server):
    first = _complete(server.url, PROMPTS[2], temperature=1.0, seed=5)
    again = _complete(server.url, PROMPTS[2], temperature=1.0, seed=5, top_p=1.0)
    assert first["token_ids"] == again["token_ids"]


@pytest.mark.parametrize("body", [
    b"{not json", {"prompt": "x", "max_tokens": -3}, {"prompt": "x", "model": "no-such-model"},
    {"prompt": "x " * 200, "max_tokens": 4}, {"prompt": "x", "unknown_field": 1}, {"messages": "hi"},
])
def test_bad_requests_get_one_line_4xx_and_the_server_keeps_serving(server, reference, body):
    status, payload = post(server.url, "/v1/completions", body)
    assert 400 <= status < 500
    message = payload["error"]["message"]
    assert message and "\n" not in message
    assert _complete(server.url, PROMPTS[0])["token_ids"] == reference[0][0]


def _open_stream(url, prompt, max_tokens):
    """A raw HTTP/1.1 streaming request; returns the socket after the first SSE event arrived."""
    host, port = url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while b"data: " not in received:
        received += sock.recv(4096)
    return sock


def test_disconnect_mid_stream_frees_kv_blocks(server):
    """The engine's block accounting (``moe_serve_kv_cache_blocks_used``) drops back to 0 and the
    request stops long before its 100 tokens."""
    before = get_metrics(server.url)
    sock = _open_stream(server.url, PROMPTS[0], 100)
    during = get_metrics(server.url)
    sock.close()
    deadline = time.monotonic() + 60
    while True:
        after = get_metrics(server.url)
        if after['moe_serve_requests_total{status="aborted"}'] > before['moe_serve_requests_total{status="aborted"}'] \
                and after['moe_serve_kv_cache_blocks_used{rank="0"}'] == 0 \
                and after['moe_serve_engine_requests_running{rank="0"}'] == 0:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    assert during['moe_serve_kv_cache_blocks_used{rank="0"}'] > 0 or during['moe_serve_engine_steps_total{rank="0"}'] \
        > before['moe_serve_engine_steps_total{rank="0"}']
    steps = after['moe_serve_engine_steps_total{rank="0"}'] - before['moe_serve_engine_steps_total{rank="0"}']
    assert steps < 100


def test_sigterm_finishes_in_flight_requests_and_exits_0(serve_ckpts, tmp_path, reference):
    srv = Server(serve_ckpts["standard"], tmp_path)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_complete, srv.url, PROMPTS[3])
            deadline = time.monotonic() + 60
            while get_metrics(srv.url)["moe_serve_requests_in_flight"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            srv.proc.send_signal(15)
            choice = pending.result(timeout=60)
        assert choice["token_ids"] == reference[3][0]
        assert srv.proc.wait(60) == 0
        with pytest.raises(OSError):
            post(srv.url, "/v1/completions", {"prompt": "x", "max_tokens": 1}, timeout=5)
    finally:
        srv.stop()
