"""The HTTP side of the server (in rank 0, or in the front end's own process:
``megatron.inference.launcher``): an ASGI app served by hypercorn in a background thread.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as server-sent
events or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, vLLM's tokenizer endpoints
``POST /tokenize``, ``POST /detokenize`` (also under ``/v1``) and, with
``enable_tokenizer_info``, ``GET /tokenizer_info`` (what lm-eval's remote tokenizer reads).
Request handlers never touch torch: they tokenize, put a ``Submit`` or a cancellation on
``commands`` (a thread-safe queue the engine loop drains every iteration) and wait on their own
queue of ``TokenUpdate``s, which the engine loop hands over with ``publish``
(``call_soon_threadsafe`` into this thread's event loop). A completions request may carry several
prompts: each is one engine request and one choice.

Failures stay with their request: a body the protocol refuses gets a 4xx; a request the engine
fails (``TokenUpdate.failed``) a 5xx (an error event once a stream has started); an exception in
a handler a one-line 500, its traceback on stderr, and its engine requests still decoding are
cancelled; every other request carries on. Admission is decided here, on rank 0: a request
while the engine is dead, stalled or draining gets 503; one that would take the queue (engine
requests without a first token yet) past ``max_queued_requests`` gets 503 with ``Retry-After``;
one still unfinished ``request_timeout`` seconds after it arrived is cancelled in the engine and
answered 504. ``/health`` is 200 only while the loop's heartbeat
(``megatron.common.watchdog.Heartbeat``: its last all-gather, engine step start or end) is
younger than ``stall_timeout``, grown with the slowest recent engine step up to
``max_stall_timeout`` (``megatron.inference.watchdog``); 503 with the reason (starting, stalled, draining, dead)
otherwise. With ``api_keys``, every path except ``/health``,
``/v1/health`` and ``/metrics`` needs ``Authorization: Bearer KEY`` (401 otherwise; compared as
SHA-256 digests in constant time).

A client that disconnects (streaming or not) has its requests cancelled in the engine, which
frees their KV blocks at the next step. On shutdown (``request_stop``, SIGTERM) hypercorn stops
accepting connections, ``/health`` turns 503, in-flight requests run to completion; after
``shutdown_timeout`` seconds the remaining ones are cancelled (streams end with
``finish_reason: "abort"``). ``mark_dead`` (the engine loop failed or the watchdog fired; in its own
process, the engine was lost) answers every in-flight request with a 503 at once; ``engine_up``
(a restarted engine) admits requests again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import json
import queue
import secrets
import socket
import threading
import time
import traceback
from typing import Optional

from megatron.common.cli import UserError, one_line
from megatron.inference import protocol
from megatron.inference.metrics import ServingMetrics
from megatron.inference.protocol import BadRequest
from megatron.inference.sampling import RequestSampling
from megatron.inference.watchdog import health_deadline, limit_text

__all__ = ["Submit", "Commands", "Frontend", "FrontendConfig", "OPEN_PATHS", "bind_listener", "check_address"]

OPEN_PATHS = frozenset({"/health", "/v1/health", "/metrics"})  # reachable without the API key


@dataclasses.dataclass
class Submit:
    """A request for the engines (picklable: it is broadcast to every rank)."""

    request_id: int
    prompt: list
    max_tokens: int
    sampling: RequestSampling
    ignore_eos: bool = False  # generate exactly max_tokens (the end-of-document token does not stop it)


@dataclasses.dataclass
class Commands:
    """What rank 0 tells every rank at the start of a loop iteration."""

    submits: list = dataclasses.field(default_factory=list)
    cancels: list = dataclasses.field(default_factory=list)
    stop: bool = False


@dataclasses.dataclass
class FrontendConfig:
    """The HTTP front end's settings (``serve``'s flags)."""

    served_model: str
    limits: protocol.Limits
    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_timeout: float = 30.0
    api_keys: tuple = ()
    max_queued_requests: int = 512
    request_timeout: float = 600.0  # 0: none
    stall_timeout: float = 30.0
    max_stall_timeout: Optional[float] = None  # default: watchdog.STALL_GROWTH x stall_timeout
    max_body_bytes: int = 16 * 1024 * 1024
    enable_tokenizer_info: bool = False


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0: any free one); ``UserError`` when the
    address cannot be bound (in use, not this machine's)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UserError(f"--host {host} --port {port}: cannot bind ({err.strerror})") from None
    return sock


def check_address(host: str, port: int) -> None:
    """``UserError`` unless ``host:port`` can be bound now: the server checks it on the rank that
    serves HTTP before any rank starts, so a busy port is its one-line error, not a rank that
    exits while the others wait for it in the serving loop."""
    bind_listener(host, port).close()


class _Choice:
    """One engine request of an HTTP request, as the client sees it."""

    def __init__(self, index: int, prompt: list, stop_text: protocol.StopText):
        self.index = index
        self.prompt = prompt
        self.text = stop_text
        self.tokens: list = []
        self.logprobs: list = []  # LogprobEntry per token in ``tokens``
        self.prompt_logprobs: list = []
        self.finish: Optional[str] = None
        self.waiting = True  # counts against the queue until its first token
        self.first_at: Optional[float] = None
        self.last_at: Optional[float] = None
        self.started = False  # streaming: the first chunk of this choice went out
        self.offset = 0  # streaming: text offset of the next logprobs token
        self.dp_rank: Optional[int] = None  # the data-parallel engine the loop gave it
        self.cancelled = False  # a cancellation went to the engine


class _Stream:
    def __init__(self):
        self.updates: asyncio.Queue = asyncio.Queue()
        self.choices: dict = {}  # request id -> _Choice


class Frontend:
    """Rank 0's HTTP server and its bridge to the engine loop (see the module docstring)."""

    def __init__(self, *, tokenizer, chat_render, config: FrontendConfig, heartbeat=None):
        self.tokenizer = tokenizer
        self.chat_render = chat_render
        self.config = config
        self.served_model = config.served_model
        self.context_length = int(config.limits.context)
        self.heartbeat = heartbeat
        self._stall = health_deadline(config.stall_timeout, config.max_stall_timeout)
        self.commands: "queue.Queue[tuple]" = queue.Queue()
        self.metrics = ServingMetrics(config.served_model)
        self._key_digests = [hashlib.sha256(k.encode()).digest() for k in config.api_keys]
        self._ids = itertools.count()
        self._streams: dict[int, _Stream] = {}
        self._token_text: dict[int, str] = {}
        self.in_flight = 0  # HTTP requests being answered (read by the engine thread: an int, atomic)
        self.queued = 0  # engine requests without a first token yet
        self.dead: Optional[str] = None  # why the engine stopped serving
        self.dead_status = "dead"  # /health's status while it does not ("lost": it may come back)
        self.stop_requested = threading.Event()
        self._stop_deadline: Optional[float] = None
        self._aborted_all = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._shutdown: Optional[asyncio.Event] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._fd: Optional[int] = None

    # --- lifecycle (engine thread) -------------------------------------------------------------
    def start(self) -> int:
        """Bind, start serving in a background thread; returns the bound port."""
        sock = bind_listener(self.config.host, self.config.port)
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self._fd = sock.detach()  # hypercorn owns (and closes) the listening socket from here
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
        config.bind = [f"fd://{self._fd}"]
        config.graceful_timeout = self.config.shutdown_timeout + 5.0
        config.accesslog = None
        config.loglevel = "WARNING"
        self._ready.set()
        await serve(self.app, config, shutdown_trigger=self._shutdown.wait)

    def request_stop(self) -> None:
        """Stop accepting connections and start draining (thread-safe, idempotent)."""
        if self.stop_requested.is_set():
            return
        self.stop_requested.set()
        self._stop_deadline = time.monotonic() + self.config.shutdown_timeout
        self._call(self._shutdown.set)

    def mark_dead(self, reason: str, *, status: str = "dead") -> None:
        """The engine stopped serving (thread-safe): answer every in-flight request with a 503,
        refuse new ones, /health 503 with ``status``: ``dead``, or ``lost`` when a front end in its
        own process waits for the engine to restart (new requests then get ``Retry-After``)."""
        self.dead, self.dead_status = reason, status
        self._call(self._fail_all, reason)

    def engine_up(self, limits: protocol.Limits) -> None:
        """An engine (restarted) serves again with ``limits``: requests are admitted again (counted
        in ``moe_serve_engine_restarts_total``)."""
        self.config = dataclasses.replace(self.config, limits=limits)
        self.context_length = int(limits.context)
        self.dead = None
        self._call(self._count_restart)

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_answered(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every in-flight HTTP request to be answered."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)

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

    def assigned(self, placed: dict) -> None:
        """The loop's assignment of new engine requests to data-parallel engines (engine thread):
        reported to the client in the ``x-dp-rank`` response header (benchmarks replay it)."""
        for rid, dp_rank in placed.items():
            stream = self._streams.get(rid)
            choice = stream.choices.get(rid) if stream is not None else None
            if choice is not None:
                choice.dp_rank = int(dp_rank)

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

    def _count_restart(self) -> None:
        self.metrics.engine_restarts += 1

    def _abort_all(self) -> None:
        for rid, stream in list(self._streams.items()):
            self.commands.put(("cancel", rid))
            stream.updates.put_nowait("abort")

    def _fail_all(self, reason: str) -> None:
        for stream in set(self._streams.values()):
            stream.updates.put_nowait(("dead", reason))

    def token_text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.detokenize([token])
        return text

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
            "/tokenize": ("POST", self._tokenize), "/v1/tokenize": ("POST", self._tokenize),
            "/detokenize": ("POST", self._detokenize), "/v1/detokenize": ("POST", self._detokenize),
        }
        if self.config.enable_tokenizer_info:
            routes["/tokenizer_info"] = ("GET", self._tokenizer_info)
        state = {"started": False}

        async def tracked_send(message):
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            if self._key_digests and path not in OPEN_PATHS and not self._authorized(scope):
                raise BadRequest("a valid API key is required (Authorization: Bearer KEY)", status=401,
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            if path not in routes:
                raise BadRequest(f"no route {path} (routes: {', '.join(sorted(routes))})", status=404)
            allowed, handler = routes[path]
            if method != allowed:
                raise BadRequest(f"{path} takes {allowed}, not {method}", status=405)
            await handler(receive, tracked_send)
        except BadRequest as err:
            if not state["started"]:
                await _send_json(send, err.status, protocol.error_body(err), err.headers)
        except Exception as err:  # a bug in a handler fails this request only: its traceback here, one line there
            traceback.print_exc()
            if not state["started"]:
                await _send_json(send, 500, protocol.error_body(
                    BadRequest(f"internal error: {type(err).__name__}: {one_line(err)}", status=500)))

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return False
        digest = hashlib.sha256(key.strip().encode()).digest()
        return any(secrets.compare_digest(digest, d) for d in self._key_digests)

    def health(self) -> tuple:
        """(HTTP status, body) of /health."""
        if self.dead is not None:
            return 503, {"status": self.dead_status, "reason": self.dead}
        if self.stop_requested.is_set():
            return 503, {"status": "draining"}
        if self.heartbeat is None:
            return 200, {"status": "ok", "model": self.served_model, "seconds_since_last_step": 0.0}
        pulse = self.heartbeat.pulse()
        age = pulse.age_s
        if age is None or not pulse.started:
            return 503, {"status": "starting"}
        if self._stall.overdue(pulse):
            why = limit_text("--stall-timeout", self._stall, pulse, "--max-stall-timeout")
            return 503, {"status": "stalled", "seconds_since_last_step": round(age, 3),
                         "reason": f"the engine loop made no progress for {age:.1f} s ({why})"}
        return 200, {"status": "ok", "model": self.served_model, "seconds_since_last_step": round(age, 3)}

    async def _health(self, receive, send):
        status, body = self.health()
        await _send_json(send, status, body)

    async def _metrics(self, receive, send):
        self.metrics.queued = self.queued
        body = self.metrics.render().encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
        await send({"type": "http.response.body", "body": body})

    async def _models(self, receive, send):
        await _send_json(send, 200, {"object": "list", "data": [
            {"id": self.served_model, "object": "model", "owned_by": "moe-comm-stack",
             "max_model_len": self.context_length}]})

    async def _tokenize(self, receive, send):
        body = protocol.decode_json(await _read_body(receive, self.config.max_body_bytes))
        tokens = protocol.parse_tokenize(body, render=self.chat_render, tokenize=self.tokenizer.tokenize,
                                         served_model=self.served_model)
        out = {"count": len(tokens), "max_model_len": self.context_length, "tokens": tokens}
        if body.get("return_token_strs"):
            out["token_strs"] = [self.token_text(t) for t in tokens]
        await _send_json(send, 200, out)

    async def _detokenize(self, receive, send):
        body = protocol.decode_json(await _read_body(receive, self.config.max_body_bytes))
        tokens = protocol.parse_detokenize(body, served_model=self.served_model,
                                           vocab_size=self.config.limits.vocab_size)
        await _send_json(send, 200, {"prompt": self.tokenizer.detokenize(tokens)})

    def tokenizer_info(self) -> dict:
        """The tokenizer's special tokens and chat template (no file paths), as vLLM's
        ``/tokenizer_info``: a special token is given only when its text tokenizes back to it."""

        def special(token_id):
            if token_id is None or not 0 <= int(token_id) < self.config.limits.vocab_size:
                return None
            text = self.tokenizer.detokenize([int(token_id)])
            return text if list(self.tokenizer.tokenize(text)) == [int(token_id)] else None

        template = getattr(self.chat_render, "source", None) or protocol.SIMPLE_CHAT_JINJA
        return {"tokenizer_class": type(self.tokenizer).__name__, "eos_token": special(self.tokenizer.eod),
                "bos_token": special(getattr(self.tokenizer, "bos", None)),
                "pad_token": special(getattr(self.tokenizer, "pad", None)),
                "model_max_length": self.context_length, "vocab_size": self.config.limits.vocab_size,
                "chat_template": template}

    async def _tokenizer_info(self, receive, send):
        await _send_json(send, 200, self.tokenizer_info())

    async def _completions(self, receive, send):
        await self._generate(receive, send, chat=False)

    async def _chat(self, receive, send):
        await self._generate(receive, send, chat=True)

    def _admit(self, num: int) -> None:
        if self.dead is not None:
            raise BadRequest(f"the engine is not serving: {self.dead}", status=503,
                             headers={"Retry-After": "1"} if self.dead_status == "lost" else None)
        if self.stop_requested.is_set():
            raise BadRequest("the server is shutting down", status=503)
        limit = self.config.max_queued_requests
        if self.queued + num > limit:
            raise BadRequest(f"the server is busy: {self.queued} requests wait for their first token "
                             f"(--max-queued-requests {limit}); retry later", status=503,
                             headers={"Retry-After": "1"})

    async def _generate(self, receive, send, *, chat: bool) -> None:
        arrival = time.perf_counter()
        try:
            self._admit(1)
            body = protocol.decode_json(await _read_body(receive, self.config.max_body_bytes))
            limits = self.config.limits
            if chat:
                req = protocol.parse_chat(body, render=self.chat_render, tokenize=self.tokenizer.tokenize,
                                          served_model=self.served_model, limits=limits)
            else:
                req = protocol.parse_completion(body, tokenize=self.tokenizer.tokenize,
                                                served_model=self.served_model, limits=limits)
            self._admit(len(req.prompts))
        except BadRequest:
            self.metrics.requests["rejected"] += 1
            raise
        stream = _Stream()
        sampling = req.sampling()
        submits = []
        for index, prompt in enumerate(req.prompts):
            rid = next(self._ids)
            stream.choices[rid] = _Choice(index, prompt, protocol.StopText(self.tokenizer.detokenize, req.stop))
            self._streams[rid] = stream
            submits.append(Submit(rid, prompt, req.max_tokens, sampling, req.ignore_eos))
        self.queued += len(submits)
        self.in_flight += 1
        self.metrics.running = self.in_flight
        watcher = asyncio.ensure_future(_watch_disconnect(receive, stream))
        for submit in submits:
            self.commands.put(("submit", submit))
        try:
            await self._respond(req, stream, send, chat, arrival)
        except BadRequest as err:  # answered while it still counts in flight: wait_answered waits for it
            self._cancel_unfinished(stream)
            await _send_json(send, err.status, protocol.error_body(err), err.headers)
        except BaseException:  # a bug or a cancelled handler: no engine request decodes on for nobody
            self._cancel_unfinished(stream)
            raise
        finally:
            watcher.cancel()
            for rid, choice in stream.choices.items():
                self._streams.pop(rid, None)
                if choice.waiting:
                    self.queued -= 1
            self.in_flight -= 1
            self.metrics.running = self.in_flight

    def _cancel_unfinished(self, stream: _Stream) -> None:
        for rid, choice in stream.choices.items():
            if choice.finish is None and not choice.cancelled:
                choice.cancelled = True
                self.commands.put(("cancel", rid))

    def _absorb(self, req, choice: _Choice, update, rid: int) -> tuple:
        """Take one update into ``choice``: (visible text, token ids, log-prob entries) new to
        the client."""
        now = time.perf_counter()
        if choice.waiting and (update.tokens or update.finished):
            choice.waiting = False
            self.queued -= 1
        if update.prompt_logprobs:
            choice.prompt_logprobs.extend(update.prompt_logprobs)
        new = list(update.tokens)
        entries = list(update.logprobs or [])[:len(new)]
        if new:
            choice.first_at = choice.first_at or now
            choice.last_at = now
        finish = None
        if update.finished and new and new[-1] == self.tokenizer.eod and not req.ignore_eos:
            new, finish = new[:-1], "stop"
        cut = next((k for k, t in enumerate(new) if t in req.stop_token_ids), None)
        if cut is not None:
            new, finish = new[:cut], "stop"
        # the token that ended the choice (EOD, a stop token id) is not in the text or token ids, but
        # keeps its log-prob entry, as OpenAI's and vLLM's: echo scoring (lm-eval's) reads one entry
        # past the prompt and would otherwise lose the prompt's last one
        entries = entries[:len(new) + (finish == "stop")]
        start = len(choice.tokens)
        choice.tokens.extend(new)
        choice.logprobs.extend(entries)
        piece = choice.text.push(new)
        if choice.text.stopped:
            finish = "stop"  # tokens after the one that completed the stop string are not reported
        elif update.finished and finish is None:
            finish = "length" if len(choice.tokens) >= req.max_tokens else "stop"
        if finish is not None and not update.finished:
            self.commands.put(("cancel", rid))
        if finish is not None and not choice.text.stopped:
            piece += choice.text.finish()
        choice.finish = finish
        return piece, choice.tokens[start:], entries

    def _logprobs(self, req, choice: _Choice, entries: list, *, with_prompt: bool, offset: int = 0):
        if req.logprobs is None:
            return None
        if req.chat:
            return protocol.chat_logprobs(entries, self.token_text)
        if with_prompt and req.echo:
            entries = [(choice.prompt[0], None, None)] + list(choice.prompt_logprobs) + list(entries)
        return protocol.completion_logprobs(entries, self.token_text, text_offset=offset)

    async def _respond(self, req, stream: _Stream, send, chat: bool, arrival: float) -> None:
        name = f"{'chatcmpl' if chat else 'cmpl'}-{min(stream.choices)}"
        deadline = arrival + self.config.request_timeout if self.config.request_timeout > 0 else None
        started = False
        error: Optional[BadRequest] = None
        aborted = disconnected = lost = False

        async def sse(payload: dict):
            nonlocal started
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                                        *((k.encode(), v.encode()) for k, v in _rank_header(stream).items())]})
            await send({"type": "http.response.body", "body": f"data: {json.dumps(payload)}\n\n".encode(),
                        "more_body": True})

        while any(c.finish is None for c in stream.choices.values()):
            try:
                timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
                item = await asyncio.wait_for(stream.updates.get(), timeout)
            except asyncio.TimeoutError:
                error = BadRequest(f"the request did not finish within --request-timeout "
                                   f"{self.config.request_timeout:g} s", status=504, code="timeout")
                self._cancel_unfinished(stream)
                break
            if item is None:  # the client went away
                self._cancel_unfinished(stream)
                disconnected = True
                break
            if item == "abort":
                aborted = True
                break
            if isinstance(item, tuple):  # ("dead", reason)
                error = BadRequest(f"the engine stopped serving: {item[1]}", status=503)
                lost = True
                break
            choice = stream.choices.get(item.request_id)
            if choice is None or choice.finish is not None:
                continue
            if item.failed:
                error = BadRequest(f"generation failed: {item.failed}", status=item.status)
                choice.finish = "error"
                self._cancel_unfinished(stream)
                break
            piece, ids, entries = self._absorb(req, choice, item, item.request_id)
            if not req.stream:
                continue
            if not choice.started:
                choice.started = True
                prefix = self.tokenizer.detokenize(choice.prompt) if req.echo else ""
                logprobs = self._logprobs(req, choice, entries, with_prompt=True)
                piece = prefix + piece
                role = chat
            else:
                logprobs = self._logprobs(req, choice, entries, with_prompt=False, offset=choice.offset)
                role = False
            if not piece and not ids and choice.finish is None and not role:
                continue
            if logprobs is not None and not chat:
                choice.offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) if logprobs["tokens"] \
                    else choice.offset
            await sse(protocol.response(chat=chat, stream=True, rid=name, model=self.served_model, choices=[
                protocol.choice(chat=chat, stream=True, index=choice.index, text=piece, finish_reason=choice.finish,
                                token_ids=ids if req.return_token_ids and ids else None, logprobs=logprobs,
                                role=role)]))

        self._record(stream, arrival, "lost" if lost else "failed" if error is not None and error.status != 504 else
                     "timeout" if error is not None else "aborted" if (aborted or disconnected) else "completed")
        if disconnected:
            return
        if error is not None:
            if not started:
                raise error
            await sse(protocol.error_body(error))
            return await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        choices = sorted(stream.choices.values(), key=lambda c: c.index)
        usage = (sum(len(c.prompt) for c in choices), sum(len(c.tokens) for c in choices))
        if not req.stream:
            body = [protocol.choice(chat=chat, stream=False, index=c.index,
                                    text=(self.tokenizer.detokenize(c.prompt) if req.echo else "") + c.text.text,
                                    finish_reason=c.finish or "abort",
                                    token_ids=list(c.tokens) if req.return_token_ids else None,
                                    logprobs=self._logprobs(req, c, c.logprobs, with_prompt=True)) for c in choices]
            return await _send_json(send, 200, protocol.response(chat=chat, stream=False, rid=name,
                                                                 model=self.served_model, choices=body, usage=usage),
                                    headers=_rank_header(stream))
        for c in choices:
            if aborted and c.finish is None:
                await sse(protocol.response(chat=chat, stream=True, rid=name, model=self.served_model, choices=[
                    protocol.choice(chat=chat, stream=True, index=c.index, text="", finish_reason="abort",
                                    role=chat and not c.started)]))
        if req.include_usage:
            await sse(protocol.response(chat=chat, stream=True, rid=name, model=self.served_model, choices=[],
                                        usage=usage))
        if not started:  # nothing was generated (e.g. aborted at once): still a well-formed stream
            await sse(protocol.response(chat=chat, stream=True, rid=name, model=self.served_model, choices=[]))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def _record(self, stream: _Stream, arrival: float, status: str) -> None:
        e2e = time.perf_counter() - arrival
        for c in stream.choices.values():
            ttft = (c.first_at - arrival) if c.first_at is not None else None
            tpot = (c.last_at - c.first_at) / (len(c.tokens) - 1) if c.first_at is not None and len(c.tokens) > 1 \
                else None
            self.metrics.finished(status, prompt_tokens=len(c.prompt), generation_tokens=len(c.tokens),
                                  ttft_s=ttft, tpot_s=tpot, e2e_s=e2e)


async def _watch_disconnect(receive, stream: _Stream) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            stream.updates.put_nowait(None)
            return


async def _read_body(receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("the client disconnected while sending the request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the request body is larger than {limit} bytes (--max-body-bytes)", status=413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _rank_header(stream: _Stream) -> dict:
    """``x-dp-rank``: the data-parallel engine of each choice, in choice order (comma-separated),
    once the loop has assigned them all; nothing before."""
    ranks = [c.dp_rank for c in sorted(stream.choices.values(), key=lambda c: c.index)]
    if not ranks or any(r is None for r in ranks):
        return {}
    return {"x-dp-rank": ",".join(str(r) for r in ranks)}


async def _send_json(send, status: int, payload: dict, headers: Optional[dict] = None) -> None:
    body = json.dumps(payload).encode()
    extra = [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": body})
