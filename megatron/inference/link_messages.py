"""The messages between the front end process and rank 0 of the engine (``megatron.inference.link``).

Each message is a frozen dataclass with its ``kind``; on the wire it is the envelope ``(VERSION,
kind, fields)``: the version and kind as plain ``int`` and ``str``, ``fields`` the pickled dict of the
message's fields. Any code, of whatever version, unpickles the envelope (it holds no class of
ours), so the receiver checks the version and the kind before it reads the fields: a peer that
runs other code (another version of this repository, or the positional tuples sent before the
messages were typed) is refused in one line naming what it sent (``LinkMismatch``), never misread.
``VERSION`` changes whenever a message's fields, or those of what it carries (``protocol.Limits``,
``engine.TokenUpdate``, ``frontend.Submit``, ``sampling.RequestSampling``, ``watchdog.Pulse``),
change; ``tests/serving/test_link_messages.py`` pins them to it.

engine (rank 0) -> front end
    ``Hello`` first (the front end answers ``Welcome``, or ``Refused`` and closes the link),
    then ``Assigned``, ``Publish``, ``Beat``, ``Drain``, ``Dead``.
front end -> engine
    ``Welcome`` or ``Refused`` (the answer to ``Hello``), then ``Commands``.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import ClassVar

from megatron.common.watchdog import Pulse

__all__ = ["VERSION", "LinkMismatch", "Hello", "Welcome", "Refused", "Assigned", "Publish", "Beat", "Drain", "Dead",
           "Commands", "MESSAGES", "encode", "decode"]

VERSION = 1


class LinkMismatch(Exception):
    """The peer sent something that is no message of this ``VERSION`` (it runs other code)."""


@dataclasses.dataclass(frozen=True)
class Hello:
    """Rank 0 built its engine and serves: its process, machine (``process.machine_id``), the
    limits of the served model and what the ready file holds."""

    kind: ClassVar[str] = "hello"
    pid: int
    machine: str
    limits: object  # protocol.Limits
    info: dict


@dataclasses.dataclass(frozen=True)
class Welcome:
    """The front end took rank 0's ``Hello``: it serves through this rank 0 from now on."""

    kind: ClassVar[str] = "welcome"


@dataclasses.dataclass(frozen=True)
class Refused:
    """The front end refused rank 0's ``Hello`` (why) and closes the link."""

    kind: ClassVar[str] = "refused"
    reason: str


@dataclasses.dataclass(frozen=True)
class Assigned:
    """Requests placed on data-parallel ranks: ``{request id: rank}``."""

    kind: ClassVar[str] = "assigned"
    placed: dict


@dataclasses.dataclass(frozen=True)
class Publish:
    """New tokens (``[engine.TokenUpdate]``) and the ranks' stats, as the loop hands them to an
    in-process front end."""

    kind: ClassVar[str] = "publish"
    updates: list
    stats: list


@dataclasses.dataclass(frozen=True)
class Beat:
    """The loop heartbeat's pulse (``/health`` reads it as it reads a local heartbeat)."""

    kind: ClassVar[str] = "beat"
    pulse: Pulse


@dataclasses.dataclass(frozen=True)
class Drain:
    """A rank was asked to stop (SIGTERM): stop accepting, finish what is in flight."""

    kind: ClassVar[str] = "drain"


@dataclasses.dataclass(frozen=True)
class Dead:
    """The engine failed or its watchdog fired (why); rank 0 exits next."""

    kind: ClassVar[str] = "dead"
    reason: str


@dataclasses.dataclass(frozen=True)
class Commands:
    """The front end's ``frontend.Commands`` (``[frontend.Submit]``, request ids to cancel, stop),
    as the loop takes them."""

    kind: ClassVar[str] = "commands"
    submits: list
    cancels: list
    stop: bool


MESSAGES = {cls.kind: cls for cls in (Hello, Welcome, Refused, Assigned, Publish, Beat, Drain, Dead, Commands)}


def encode(message) -> tuple:
    """The envelope of ``message`` (what ``Connection.send`` pickles)."""
    assert MESSAGES.get(message.kind) is type(message), message
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    return VERSION, message.kind, pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL)


def decode(envelope, sender: str):
    """The message in ``envelope`` from ``sender`` ("rank 0", "the front end"); ``LinkMismatch``
    naming what arrived when it is no message of this version."""
    if not (isinstance(envelope, tuple) and len(envelope) == 3 and type(envelope[0]) is int
            and isinstance(envelope[1], str) and isinstance(envelope[2], bytes)):
        sent = repr(envelope)
        sent = sent if len(sent) <= 60 else sent[:57] + "..."
        raise LinkMismatch(f"{sender} sent {sent}, no link message (version {VERSION}): it runs other code")
    version, kind, payload = envelope
    if version != VERSION:
        raise LinkMismatch(f"{sender} speaks link version {version}, not {VERSION}: the two run different code")
    cls = MESSAGES.get(kind)
    if cls is None:
        raise LinkMismatch(f"{sender} sent an unknown link message {kind!r} (link version {VERSION})")
    try:
        return cls(**pickle.loads(payload))
    except Exception as err:  # a class it carries is missing or changed, or the fields differ
        why = " ".join(f"{type(err).__name__}: {err}".split())
        raise LinkMismatch(f"{sender} sent a link message {kind!r} this process cannot read ({why}): it runs "
                           f"other code of link version {VERSION}") from None
