"""The typed, versioned messages between the front end and rank 0 (``megatron.inference.link_messages``).

- Every kind goes through ``encode``/``decode`` unchanged, and the envelope holds no class of the
  project (any version of the code unpickles it).
- What is no message of this version is refused with one line naming it: another version, an
  unknown kind, fields that differ, a class the receiver lacks, the positional tuples of code
  from before the messages were typed.
- The fields of every message and of what it carries are pinned to ``VERSION``: changing one
  fails here until the version changes with it.
"""

from __future__ import annotations

import dataclasses
import pickle
import pickletools
import sys

import pytest

from megatron.common.watchdog import Pulse
from megatron.inference import link_messages as M
from megatron.inference import protocol as P
from megatron.inference.engine import TokenUpdate
from megatron.inference.frontend import Submit
from megatron.inference.sampling import RequestSampling

LIMITS = P.Limits(context=64, vocab_size=300, max_request_tokens=48)
EXAMPLES = [
    M.Hello(123, "machine-a", LIMITS, {"model": "m"}),
    M.Welcome(),
    M.Refused("why"),
    M.Assigned({7: 1}),
    M.Publish([TokenUpdate(7, [1, 2], finished=True)], [{"rank": 0}]),
    M.Beat(Pulse(0.5, 0.1, 3)),
    M.Drain(),
    M.Dead("the engine loop failed"),
    M.Commands([Submit(7, [1, 2], 4, RequestSampling())], [5], False),
]


def test_every_kind_has_an_example():
    assert sorted(type(m).kind for m in EXAMPLES) == sorted(M.MESSAGES)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.kind)
def test_every_message_round_trips(message):
    envelope = M.encode(message)
    version, kind, payload = envelope
    assert (version, kind) == (M.VERSION, message.kind) and isinstance(payload, bytes)
    # the envelope names no class: pickle holds no global reference in it
    assert not any(op.name in ("GLOBAL", "STACK_GLOBAL") for op, _, _ in pickletools.genops(pickle.dumps(envelope)))
    assert M.decode(pickle.loads(pickle.dumps(envelope)), "rank 0") == message


def _payload(fields: dict) -> bytes:
    return pickle.dumps(fields)


class _Gone:
    """A class the receiver's code lacks (its name is removed from the module before decoding)."""


@pytest.mark.parametrize("envelope,message", [
    ((M.VERSION + 1, "hello", _payload({})), f"rank 0 speaks link version {M.VERSION + 1}, not {M.VERSION}: "
                                              "the two run different code"),
    ((M.VERSION, "frobnicate", _payload({})), f"rank 0 sent an unknown link message 'frobnicate' "
                                               f"(link version {M.VERSION})"),
    ((M.VERSION, "dead", _payload({"why": "x"})), "rank 0 sent a link message 'dead' this process cannot read "
                                                   "(TypeError: "),
    (("hello", 123, "machine-a", LIMITS, {"model": "m"}), "rank 0 sent ('hello', 123, 'machine-a', Limits(context=64"),
    ("hello", "rank 0 sent 'hello', no link message (version"),
    ((M.VERSION, "refused"), f"rank 0 sent ({M.VERSION}, 'refused'), no link message"),
])
def test_what_is_no_message_of_this_version_is_refused_in_one_line(envelope, message):
    with pytest.raises(M.LinkMismatch) as err:
        M.decode(envelope, "rank 0")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_class_the_receiver_lacks_is_refused_in_one_line(monkeypatch):
    envelope = (M.VERSION, "dead", pickle.dumps({"reason": _Gone()}))
    monkeypatch.delattr(sys.modules[__name__], "_Gone")
    with pytest.raises(M.LinkMismatch) as err:
        M.decode(envelope, "the front end")
    assert str(err.value).startswith("the front end sent a link message 'dead' this process cannot read "
                                     "(AttributeError: ") and "\n" not in str(err.value)


def _fields(cls) -> list:
    return [f.name for f in dataclasses.fields(cls)]


# The fields of link version 1. A change to any of them is a new version: change VERSION with it
# (a peer of the old version is then refused in one line, not misread), and this table.
PINNED = {
    1: {
        "hello": ["pid", "machine", "limits", "info"],
        "welcome": [],
        "refused": ["reason"],
        "assigned": ["placed"],
        "publish": ["updates", "stats"],
        "beat": ["pulse"],
        "drain": [],
        "dead": ["reason"],
        "commands": ["submits", "cancels", "stop"],
        "Limits": ["context", "vocab_size", "max_request_tokens", "max_logprobs"],
        "TokenUpdate": ["request_id", "tokens", "finished", "failed", "status", "logprobs", "prompt_logprobs"],
        "Submit": ["request_id", "prompt", "max_tokens", "sampling", "ignore_eos"],
        "RequestSampling": ["temperature", "top_k", "top_p", "seed", "logprobs", "prompt_logprobs"],
        "Pulse": ["age_s", "recent_s", "intervals", "started", "pause", "pause_limit_s"],
    },
}


def test_the_fields_are_pinned_to_the_version():
    carried = {cls.__name__: _fields(cls) for cls in (P.Limits, TokenUpdate, Submit, RequestSampling, Pulse)}
    now = {**{kind: _fields(cls) for kind, cls in M.MESSAGES.items()}, **carried}
    assert now == PINNED.get(M.VERSION), "a link message's fields changed: change link_messages.VERSION too"
