"""The HTTP side of the server (rank 0): an ASGI app served by hypercorn in a background thread.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as server-sent
events or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Request handlers never touch
torch: they tokenize, put a ``Submit`` or a cancellation on ``commands`` (a thread-safe queue the
engine loop drains every iteration) and wait on their own queue of ``TokenUpdate``s, which the
engine loop hands over with ``publish`` (``call_soon_threadsafe`` into this thread's event loop).

A client that disconnects (streaming or not) has its request cancelled in the engine, which frees
its KV blocks at the next step. On shutdown (``request_stop``, SIGTERM) hypercorn stops accepting
connections, ``/health`` turns 503, in-flight requests run to completion; after
``shutdown_timeout`` seconds the remaining ones are cancelled (streams end with
``finish_reason: "abort"``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import queue
import socket
import threading
import time
from typing import Optional

from megatron.inference import protocol
from megatron.inference.metrics import ServingMetrics
from megatron.inference.protocol import BadRequest

__all__ = ["Submit", "Commands", "Frontend"]

MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass
class Submit:
    """A request for the engines (picklable: it is broadcast to every rank)."""

    request_id: int
    prompt: list
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: Optional[int]
    ignore_eos: bool = False  # generate exactly max_tokens (the end-of-document token does not stop it)


@dataclasses.dataclass
class Commands:
    """What rank 0 tells every rank at the start of a loop iteration."""

    submits: list = dataclasses.field(default_factory=list)
    cancels: list = dataclasses.field(default_factory=list)
    stop: bool = False


class _Stream:
    def __init__(self):
        self.updates: asyncio.Queue = asyncio.Queue()
        self.disconnected = False


class Frontend:
    """Rank 0's HTTP server and its bridge to the engine loop (see the module docstring)."""

    def __init__(self, *, tokenizer, served_model: str, context_length: int, chat_render,
                 host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0):
        self.tokenizer = tokenizer
        self.served_model = served_model
        self.context_length = int(context_length)
        self.chat_render = chat_render
        self.host, self.port = host, int(port)
        self.shutdown_timeout = float(shutdown_timeout)
        self.commands: "queue.Queue[tuple]" = queue.Queue()
        self.metrics = ServingMetrics(served_model)
        self._ids = itertools.count()
        self._streams: dict[int, _Stream] = {}
        self.in_flight = 0  # read by the engine thread (an int: atomic under the GIL)
        self.stop_requested = threading.Event()
        self._stop_deadline: Optional[float] = None
        self._aborted_all = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._shutdown: Optional[asyncio.Event] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._socket: Optional[socket.socket] = None

    # --- lifecycle (engine thread) -------------------------------------------------------------
    def start(self) -> int:
        """Bind, start serving in a background thread; returns the bound port."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as err:
            sock.close()
            raise ValueError(f"--host {self.host} --port {self.port}: cannot bind ({err.strerror})") from None
        sock.listen(128)
        self._socket = sock
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name="http-frontend", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self.port

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as err:  # reported to the engine thread
            self._error = err
            self._ready.set()

    async def _serve(self) -> None:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        self._loop = asyncio.get_running_loop()
        self._shutdown = asyncio.Event()
        config = Config()
        config.bind = [f"fd://{self._socket.fileno()}"]
        config.graceful_timeout = self.shutdown_timeout + 5.0
        config.accesslog = None
        config.loglevel = "WARNING"
        self._ready.set()
        await serve(self.app, config, shutdown_trigger=self._shutdown.wait)

    def request_stop(self) -> None:
        """Stop accepting connections and start draining (thread-safe, idempotent)."""
        if self.stop_requested.is_set():
            return
        self.stop_requested.set()
        self._stop_deadline = time.monotonic() + self.shutdown_timeout
        self._call(self._shutdown.set)

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # --- engine-loop API (engine thread) ---------------------------------------------------------
    def take_commands(self, wait_s: float) -> Commands:
        """Everything queued since the last call; blocks up to ``wait_s`` for the first item."""
        cmds = Commands()
        try:
            item = self.commands.get(timeout=wait_s) if wait_s > 0 else self.commands.get_nowait()
            while True:
                kind, value = item
                (cmds.submits if kind == "submit" else cmds.cancels).append(value)
                item = self.commands.get_nowait()
        except queue.Empty:
            pass
        if self.stop_requested.is_set():
            if self.in_flight and not self._aborted_all and time.monotonic() >= self._stop_deadline:
                self._aborted_all = True
                self._call(self._abort_all)
            cmds.stop = self.in_flight == 0 or self._aborted_all
        return cmds

    def publish(self, updates: list, stats: list) -> None:
        """Token updates and every rank's engine stats, from the engine loop."""
        self._call(self._on_publish, updates, stats)

    def _call(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the HTTP thread's event loop (nothing once it has ended: after a
        shutdown no request is left to hear about it)."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            pass

    # --- event loop side -------------------------------------------------------------------------
    def _on_publish(self, updates: list, stats: list) -> None:
        self.metrics.rank_stats = stats
        for update in updates:
            stream = self._streams.get(update.request_id)
            if stream is not None:
                stream.updates.put_nowait(update)

    def _abort_all(self) -> None:
        for rid, stream in list(self._streams.items()):
            self.commands.put(("cancel", rid))
            stream.updates.put_nowait("abort")

    async def app(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"].rstrip("/") or "/", scope["method"]
        routes = {
            "/health": ("GET", self._health), "/v1/health": ("GET", self._health),
            "/metrics": ("GET", self._metrics), "/v1/models": ("GET", self._models),
            "/v1/completions": ("POST", self._completions), "/v1/chat/completions": ("POST", self._chat),
        }
        if path not in routes:
            return await _send_json(send, 404, protocol.error_body(
                BadRequest(f"no route {path} (routes: {', '.join(sorted(routes))})", status=404)))
        allowed, handler = routes[path]
        if method != allowed:
            return await _send_json(send, 405, protocol.error_body(
                BadRequest(f"{path} takes {allowed}, not {method}", status=405)))
        await handler(receive, send)

    async def _health(self, receive, send):
        if self.stop_requested.is_set():
            return await _send_json(send, 503, {"status": "draining"})
        await _send_json(send, 200, {"status": "ok", "model": self.served_model})

    async def _metrics(self, receive, send):
        body = self.metrics.render().encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
        await send({"type": "http.response.body", "body": body})

    async def _models(self, receive, send):
        await _send_json(send, 200, {"object": "list", "data": [
            {"id": self.served_model, "object": "model", "owned_by": "moe-comm-stack",
             "max_model_len": self.context_length}]})

    async def _completions(self, receive, send):
        await self._generate(receive, send, chat=False)

    async def _chat(self, receive, send):
        await self._generate(receive, send, chat=True)

    async def _generate(self, receive, send, *, chat: bool) -> None:
        arrival = time.perf_counter()
        try:
            if self.stop_requested.is_set():
                raise BadRequest("the server is shutting down", status=503)
            body = protocol.decode_json(await _read_body(receive))
            if chat:
                req = protocol.parse_chat(body, render=self.chat_render, tokenize=self.tokenizer.tokenize,
                                          served_model=self.served_model, context=self.context_length)
            else:
                req = protocol.parse_completion(body, tokenize=self.tokenizer.tokenize,
                                                served_model=self.served_model, context=self.context_length)
        except BadRequest as err:
            self.metrics.requests["rejected"] += 1
            return await _send_json(send, err.status, protocol.error_body(err))
        rid = next(self._ids)
        stream = _Stream()
        self._streams[rid] = stream
        self.in_flight += 1
        self.metrics.running = self.in_flight
        watcher = asyncio.ensure_future(_watch_disconnect(receive, stream))
        self.commands.put(("submit", Submit(rid, req.prompt_tokens, req.max_tokens, req.temperature, req.top_p,
                                            req.top_k, req.seed, req.ignore_eos)))
        try:
            await self._respond(rid, req, stream, send, chat, arrival)
        finally:
            watcher.cancel()
            self._streams.pop(rid, None)
            self.in_flight -= 1
            self.metrics.running = self.in_flight

    async def _respond(self, rid: int, req, stream: _Stream, send, chat: bool, arrival: float) -> None:
        name = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
        eod = self.tokenizer.eod
        text = protocol.StopText(self.tokenizer.detokenize, req.stop)
        tokens: list = []
        first_at = last_at = None
        finish = None
        failed = None
        started = False

        async def emit(piece: str, reason=None, ids=None):
            nonlocal started
            if not req.stream:
                return
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
                if chat:
                    await _sse(send, protocol.chat_chunk(name, self.served_model, {"role": "assistant", "content": ""}))
            if not piece and reason is None and not ids:
                return
            if chat:
                delta = {"content": piece} if piece else {}
                chunk = protocol.chat_chunk(name, self.served_model, delta, reason, token_ids=ids)
            else:
                chunk = protocol.completion_chunk(name, self.served_model, piece, reason, token_ids=ids)
            await _sse(send, chunk)

        while finish is None:
            update = await stream.updates.get()
            if update is None:  # the client went away
                self.commands.put(("cancel", rid))
                finish = "disconnected"
                break
            if update == "abort":
                finish = "abort"
                break
            now = time.perf_counter()
            new = list(update.tokens)
            if update.finished and new and new[-1] == eod and not req.ignore_eos:
                new, finish = new[:-1], "stop"
            if update.failed:
                failed = update.failed
                break
            if update.tokens:
                first_at = first_at or now
                last_at = now
            start = len(tokens)
            tokens.extend(new)
            piece = text.push(new)
            if text.stopped:
                # tokens after the one that completed the stop string are not reported
                finish = "stop"
                if not update.finished:
                    self.commands.put(("cancel", rid))
            elif update.finished and finish is None:
                finish = "length" if len(tokens) >= req.max_tokens else "stop"
            if finish is not None and not text.stopped:
                piece += text.finish()
            await emit(piece, finish, tokens[start:] if req.return_token_ids and tokens[start:] else None)

        prompt_len = len(req.prompt_tokens)
        e2e = time.perf_counter() - arrival
        ttft = (first_at - arrival) if first_at is not None else None
        tpot = (last_at - first_at) / (len(tokens) - 1) if first_at is not None and len(tokens) > 1 else None
        status = {"disconnected": "aborted", "abort": "aborted"}.get(finish, "completed")
        if failed is not None:
            status = "failed"
        self.metrics.finished(status, prompt_tokens=prompt_len, generation_tokens=len(tokens),
                              ttft_s=ttft, tpot_s=tpot, e2e_s=e2e)
        if finish == "disconnected":
            return
        if failed is not None:
            err = BadRequest(f"generation failed: {failed}", status=500)
            if not started:
                return await _send_json(send, 500, protocol.error_body(err))
            await _sse(send, protocol.error_body(err))
            return await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        ids = list(tokens) if req.return_token_ids else None
        if not req.stream:
            build = protocol.chat_body if chat else protocol.completion_body
            return await _send_json(send, 200, build(name, self.served_model, text.text, finish, prompt_len,
                                                     len(tokens), token_ids=ids))
        if finish == "abort":
            await emit("", "abort")
        if req.include_usage:
            usage = (prompt_len, len(tokens))
            chunk = protocol.chat_chunk(name, self.served_model, {}, usage=usage) if chat else \
                protocol.completion_chunk(name, self.served_model, "", usage=usage)
            await _sse(send, chunk)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _watch_disconnect(receive, stream: _Stream) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            stream.disconnected = True
            stream.updates.put_nowait(None)
            return


async def _read_body(receive) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("the client disconnected while sending the request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_json(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _sse(send, payload: dict) -> None:
    await send({"type": "http.response.body", "body": f"data: {json.dumps(payload)}\n\n".encode(),
                "more_body": True})
