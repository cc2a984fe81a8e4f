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
while the engine is dead or draining gets 503; one that would take the queue (engine
requests without a first token yet) past ``max_queued_requests`` gets 503 with ``Retry-After``;
one still unfinished ``request_timeout`` seconds after it arrived is cancelled in the engine and
answered 504 (``megatron.inference.admission`` keeps the requests, ``megatron.inference.responding``
answers them). ``/health`` is 200 only while the loop's heartbeat
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
``finish_reason: "abort"``). ``mark_dead`` (the engine loop failed or the watchdog fired, or, in its
own process, the engine will not come back) answers every in-flight request with a 503 at once.
``engine_lost`` (in its own process: the engine was lost and torchrun restarts it) holds every
request that has sent its client nothing yet, and new ones, until ``engine_up`` (the restarted
engine said hello) sends them to the new engine (``admission``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import queue
import secrets
import socket
import threading
import time
import traceback
from typing import Optional

from megatron.common.cli import UserError, one_line
from megatron.inference import protocol
from megatron.inference.admission import RequestBook
from megatron.inference.metrics import ServingMetrics
from megatron.inference.protocol import BadRequest
from megatron.inference.responding import read_body, respond, send_json, watch_disconnect
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
        self.book = RequestBook(self.commands, self.metrics)  # the requests being answered
        self._key_digests = [hashlib.sha256(k.encode()).digest() for k in config.api_keys]
        self._token_text: dict[int, str] = {}
        self.dead: Optional[str] = None  # why the engine stopped serving
        self.dead_status = "dead"  # /health's status while it does not ("lost": it may come back)
        self.holding = False  # the engine was lost and will restart: new requests are held, not refused
        self.stop_requested = threading.Event()
        self._stop_deadline: Optional[float] = None
        self._aborted_all = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._shutdown: Optional[asyncio.Event] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._fd: Optional[int] = None

    @property
    def in_flight(self) -> int:
        """HTTP requests being answered, held ones included (read by other threads: an int)."""
        return self.book.in_flight

    @property
    def queued(self) -> int:
        """Engine requests without a first token yet, held ones included."""
        return self.book.queued

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
        """Stop accepting connections and start draining (thread-safe, idempotent); held requests
        get their 503 (no engine will come back for them)."""
        if self.stop_requested.is_set():
            return
        self.stop_requested.set()
        self._stop_deadline = time.monotonic() + self.config.shutdown_timeout
        self._call(self.book.fail_held, "the server is shutting down")
        self._call(self._shutdown.set)

    def mark_dead(self, reason: str, *, status: str = "dead") -> None:
        """The engine stopped serving (thread-safe): answer every in-flight request, held ones
        included, with a 503, refuse new ones, /health 503 with ``status``: ``dead``, or ``lost``
        (new requests then get ``Retry-After``)."""
        self.dead, self.dead_status, self.holding = reason, status, False
        self._call(self.book.fail_all, reason)

    def engine_lost(self, reason: str, *, will_restart: bool) -> None:
        """The engine of a front end in its own process was lost (thread-safe): /health 503
        ``lost`` with ``reason``. When torchrun ``will_restart`` it, hold every request that sent
        its client nothing yet and admit new ones held, until ``engine_up``; fail the others with
        a 503 (``admission``). Otherwise as ``mark_dead``."""
        self.holding = will_restart
        self.dead, self.dead_status = reason, "lost"
        self._call(functools.partial(self.book.lose, reason, hold=will_restart))

    def engine_up(self, limits: protocol.Limits) -> None:
        """An engine (restarted) serves again with ``limits``: the held requests go to it in
        arrival order, requests are admitted again (counted in ``moe_serve_engine_restarts_total``)."""
        self.config = dataclasses.replace(self.config, limits=limits)
        self.context_length = int(limits.context)
        self.dead, self.holding = None, False
        self._call(self._count_restart)
        self._call(self.book.resume)

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
                self._call(self.book.abort_all)
            cmds.stop = self.in_flight == 0 or self._aborted_all
        return cmds

    def assigned(self, placed: dict) -> None:
        """The loop's assignment of new engine requests to data-parallel engines (engine thread):
        reported to the client in the ``x-dp-rank`` response header (benchmarks replay it)."""
        for rid, dp_rank in placed.items():
            stream = self.book.stream_of(rid)
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
            self.book.route(update)

    def _count_restart(self) -> None:
        self.metrics.engine_restarts += 1

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
                await send_json(send, err.status, protocol.error_body(err), err.headers)
        except Exception as err:  # a bug in a handler fails this request only: its traceback here, one line there
            traceback.print_exc()
            if not state["started"]:
                await send_json(send, 500, protocol.error_body(
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
        await send_json(send, status, body)

    async def _metrics(self, receive, send):
        self.metrics.queued, self.metrics.held = self.queued, self.book.held
        body = self.metrics.render().encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
        await send({"type": "http.response.body", "body": body})

    async def _models(self, receive, send):
        await send_json(send, 200, {"object": "list", "data": [
            {"id": self.served_model, "object": "model", "owned_by": "moe-comm-stack",
             "max_model_len": self.context_length}]})

    async def _tokenize(self, receive, send):
        body = protocol.decode_json(await read_body(receive, self.config.max_body_bytes))
        tokens = protocol.parse_tokenize(body, render=self.chat_render, tokenize=self.tokenizer.tokenize,
                                         served_model=self.served_model)
        out = {"count": len(tokens), "max_model_len": self.context_length, "tokens": tokens}
        if body.get("return_token_strs"):
            out["token_strs"] = [self.token_text(t) for t in tokens]
        await send_json(send, 200, out)

    async def _detokenize(self, receive, send):
        body = protocol.decode_json(await read_body(receive, self.config.max_body_bytes))
        tokens = protocol.parse_detokenize(body, served_model=self.served_model,
                                           vocab_size=self.config.limits.vocab_size)
        await send_json(send, 200, {"prompt": self.tokenizer.detokenize(tokens)})

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
        await send_json(send, 200, self.tokenizer_info())

    async def _completions(self, receive, send):
        await self._generate(receive, send, chat=False)

    async def _chat(self, receive, send):
        await self._generate(receive, send, chat=True)

    def _admit(self, num: int) -> None:
        if self.dead is not None and not self.holding:
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
            body = protocol.decode_json(await read_body(receive, self.config.max_body_bytes))
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
        sampling = req.sampling()

        def submit(choice):
            return Submit(choice.rid, choice.prompt, req.max_tokens, sampling, req.ignore_eos)

        stream = self.book.open(req.prompts, submit, lambda: protocol.StopText(self.tokenizer.detokenize, req.stop))
        self.metrics.running = self.in_flight
        watcher = asyncio.ensure_future(watch_disconnect(receive, stream))
        try:
            await respond(self, req, stream, send, chat, arrival)
        except BadRequest as err:  # answered while it still counts in flight: wait_answered waits for it
            self.book.cancel_unfinished(stream)
            await send_json(send, err.status, protocol.error_body(err), err.headers)
        except BaseException:  # a bug or a cancelled handler: no engine request decodes on for nobody
            self.book.cancel_unfinished(stream)
            raise
        finally:
            watcher.cancel()
            self.book.close(stream)
            self.metrics.running = self.in_flight
