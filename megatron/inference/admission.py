"""The front end's requests from admission to answer, and what becomes of them when the engine is
lost: held and sent again to the restarted engine, or failed.

An HTTP request is a ``Stream``: the queue its handler waits on (the engine's ``TokenUpdate``s, or
a word from here: ``("dead", reason)``, ``"abort"``; ``None`` when its client went away) and one
``Choice`` per prompt, each one engine request under its own id. The ``RequestBook`` (used on the
HTTP thread's event loop only; other threads read its ``in_flight`` and ``queued``, ints) registers
them, puts their ``Submit``s and cancellations on ``commands`` (which the engine loop, or the link
to it, drains), routes the engine's updates to them, and counts what ``--max-queued-requests``
bounds: engine requests without a first token yet, held ones included.

**Holding.** When the engine is lost and torchrun will restart it (``lose(reason, hold=True)``: the
front end in its own process, with restarts left), a request that has sent its client nothing yet
is held: a non-streamed one, or a streamed one whose stream has not started. Its unfinished choices
forget what the lost engine generated and their engine request ids: an update for an old id that
still arrives is dropped, so an answer the lost engine finished but whose tokens never reached the
front end is answered once, by the new engine. A request that arrives during the outage is held from
the start. When the engine says hello again, ``resume`` submits every held choice under a new id,
in arrival order. Greedy requests and requests with a ``seed`` (sampled with their own generator)
give the same tokens again; an unseeded sampled request draws a new sample. A request is held
across ``MAX_LOSSES`` engine loss only: one in flight at the next loss fails, so that a request that
makes the engine fail cannot use up every restart. A streamed request whose stream has started gets
the error event; without a restart (``hold=False``), on shutdown and when the engine cannot come
back (``fail``), every request, held ones included, gets the 503. Each stays bounded by its own
``--request-timeout`` (504) throughout.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Callable, Optional

from megatron.inference import protocol

__all__ = ["Choice", "Stream", "RequestBook", "MAX_LOSSES"]

MAX_LOSSES = 1  # engine losses a request is held across; at the next one it fails


class Choice:
    """One engine request of an HTTP request (one prompt), as its client sees it."""

    def __init__(self, index: int, prompt: list, stop_text: protocol.StopText):
        self.index = index
        self.prompt = prompt
        self.rid: Optional[int] = None  # its engine request id now; None while held
        self.cancelled = False  # a cancellation went to the engine
        self.lost = False  # held after a lost engine had it: its next submission is a resubmission
        self.waiting = True  # counts against the queue until its first token
        self.restart(stop_text)

    def restart(self, stop_text: protocol.StopText) -> None:
        """Forget what an engine generated for it (a held choice starts again)."""
        self.text = stop_text
        self.tokens: list = []
        self.logprobs: list = []  # LogprobEntry per token in ``tokens``
        self.prompt_logprobs: list = []
        self.finish: Optional[str] = None
        self.first_at: Optional[float] = None
        self.last_at: Optional[float] = None
        self.started = False  # streaming: the first chunk of this choice went out
        self.offset = 0  # streaming: text offset of the next logprobs token
        self.dp_rank: Optional[int] = None  # the data-parallel engine the loop gave it


class Stream:
    """One HTTP request: its choices (``all``, in index order; ``choices``: the live ones by engine
    request id) and the queue its handler reads. ``submit(choice)`` makes a choice's ``Submit``
    (its engine request id set); ``stop_text()`` a fresh stop-string scanner."""

    def __init__(self, order: int, prompts: list, submit: Callable, stop_text: Callable[[], protocol.StopText]):
        self.order = order  # arrival
        self.updates: asyncio.Queue = asyncio.Queue()
        self.all = [Choice(index, prompt, stop_text()) for index, prompt in enumerate(prompts)]
        self.choices: dict = {}  # engine request id -> Choice, for the choices an engine has now
        self.submit = submit
        self.stop_text = stop_text
        self.started = False  # the answer's first byte went out: it can no longer be held
        self.losses = 0  # engine losses it was held across
        self.held = False

    @property
    def unfinished(self) -> list:
        return [c for c in self.all if c.finish is None]


class RequestBook:
    """Every request the front end is answering (module docstring). ``commands`` is the queue of
    ``("submit", Submit)`` and ``("cancel", id)`` for the engine; ``metrics`` the ``ServingMetrics``
    that count resubmissions."""

    def __init__(self, commands, metrics):
        self.commands = commands
        self.metrics = metrics
        self.in_flight = 0  # HTTP requests being answered
        self.queued = 0  # engine requests without a first token yet
        self.holding = False  # the engine is lost and will restart: new requests are held
        self._live: dict = {}  # engine request id -> Stream
        self._held: list = []  # held streams (resumed in arrival order)
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    def stream_of(self, rid: int) -> Optional[Stream]:
        return self._live.get(rid)

    def open(self, prompts: list, submit: Callable, stop_text: Callable) -> Stream:
        """Register a new HTTP request and send its engine requests (hold them while ``holding``)."""
        stream = Stream(next(self._arrivals), prompts, submit, stop_text)
        self.queued += len(stream.all)
        self.in_flight += 1
        if self.holding:
            self._hold(stream)
        else:
            self._send(stream)
        return stream

    def close(self, stream: Stream) -> None:
        """The request was answered (or its handler ended): forget it."""
        for rid in list(stream.choices):
            self._live.pop(rid, None)
        stream.choices.clear()
        if stream.held:
            stream.held = False
            self._held.remove(stream)
        self.queued -= sum(c.waiting for c in stream.all)
        self.in_flight -= 1

    def first_token(self, choice: Choice) -> None:
        """``choice`` has its first token (or finished without one): it no longer counts as queued."""
        if choice.waiting:
            choice.waiting = False
            self.queued -= 1

    def route(self, update) -> None:
        """An engine update to the stream of its request (nothing for an id no longer live)."""
        stream = self._live.get(update.request_id)
        if stream is not None:
            stream.updates.put_nowait(update)

    def cancel(self, rid: int) -> None:
        self.commands.put(("cancel", rid))

    def cancel_unfinished(self, stream: Stream) -> None:
        """Cancel in the engine every choice of ``stream`` it still decodes."""
        for rid, choice in stream.choices.items():
            if choice.finish is None and not choice.cancelled:
                choice.cancelled = True
                self.cancel(rid)

    def lose(self, reason: str, *, hold: bool) -> None:
        """The engine was lost (module docstring): hold what can be held when ``hold``, answer every
        other request in flight with a 503 naming ``reason``."""
        self.holding = hold
        for stream in {id(s): s for s in self._live.values()}.values():
            if stream.held or not stream.unfinished:
                continue  # held already; answered already, or about to be
            if hold and not stream.started and stream.losses < MAX_LOSSES:
                stream.losses += 1
                self._hold(stream)
            else:
                stream.updates.put_nowait(("dead", reason))
        if not hold:
            self.fail_held(reason)

    def resume(self) -> None:
        """The engine serves again: submit every held request, in arrival order."""
        self.holding = False
        held, self._held = sorted(self._held, key=lambda s: s.order), []
        for stream in held:
            stream.held = False
            self._send(stream)

    def fail_held(self, reason: str) -> None:
        """The engine will not come back (or the server stops): every held request gets the 503."""
        self.holding = False
        for stream in self._held:
            stream.held = False
            stream.updates.put_nowait(("dead", reason))
        self._held = []

    def abort_all(self) -> None:
        """The shutdown deadline passed: cancel every request still decoding, end every stream."""
        for stream in {id(s): s for s in self._live.values()}.values():
            self.cancel_unfinished(stream)
            stream.updates.put_nowait("abort")
        for stream in self._held:
            stream.updates.put_nowait("abort")

    def fail_all(self, reason: str) -> None:
        """The engine stopped serving for good: every request in flight gets the 503."""
        self.holding = False
        for stream in {id(s): s for s in self._live.values()}.values():
            stream.updates.put_nowait(("dead", reason))
        self.fail_held(reason)

    @property
    def held(self) -> int:
        """Engine requests held now."""
        return sum(len(s.unfinished) for s in self._held)

    def _send(self, stream: Stream) -> None:
        for choice in stream.unfinished:
            if choice.lost:
                choice.lost = False
                self.metrics.resubmitted += 1
            choice.rid = rid = next(self._ids)
            stream.choices[rid] = choice
            self._live[rid] = stream
            self.commands.put(("submit", stream.submit(choice)))

    def _hold(self, stream: Stream) -> None:
        """Take ``stream``'s unfinished choices back from the engine: their ids forgotten, their
        output cleared."""
        for choice in stream.unfinished:
            if choice.rid is not None:
                choice.lost = True
                del stream.choices[choice.rid]
                self._live.pop(choice.rid, None)
                choice.rid = None
            if not choice.waiting:
                choice.waiting = True
                self.queued += 1
            choice.cancelled = False
            choice.restart(stream.stop_text())
        stream.held = True
        self._held.append(stream)
