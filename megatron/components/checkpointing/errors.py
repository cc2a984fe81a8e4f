"""Checkpoint errors, and how the ranks agree on them: a save or load that fails is the same one-line
``CheckpointError`` on every rank, never one rank raising while the others wait in a collective."""

from __future__ import annotations

import os

import torch.distributed as dist

from megatron.common import collectives

__all__ = ["CheckpointError", "one_line_error", "broadcast_object", "from_rank0", "agreed_on_rank0"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, incomplete, corrupt, incompatible, unsafe) or
    cannot be written (full disk, read-only directory)."""


def one_line_error(err: BaseException) -> str:
    """The most useful single line of an exception from a save or load: the operating-system error
    at its root when there is one (``[Errno 28] No space left on device``), else its first line."""
    seen = set()
    cur = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return f"{os.strerror(cur.errno)} ({cur.filename})" if cur.filename else os.strerror(cur.errno)
        failures = getattr(cur, "failures", None)  # torch's CheckpointException: {rank: exception}
        if isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
            if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
                inner = inner[0]  # torch's WRAPPED_EXCEPTION: (exception, stack summary)
            if isinstance(inner, BaseException):
                return one_line_error(inner)
        cur = cur.__cause__ or cur.__context__
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def broadcast_object(obj, src: int = 0):
    """``obj`` of rank ``src`` on every rank (collective)."""
    box = [obj]
    collectives.broadcast_object_list(box, src=src)
    return box[0]


def from_rank0(fn, *, user_errors: bool = False):
    """``fn()`` run on rank 0, its (picklable) result on every rank; a ``CheckpointError`` (or an
    ``OSError``) there is the same one-line ``CheckpointError`` on all ranks, and with
    ``user_errors`` a ``ValueError`` there is the same ``UserError`` on all ranks, so a refusal
    never leaves the other ranks waiting in a collective (collective)."""
    from megatron.common.cli import UserError

    out = None
    if dist.get_rank() == 0:
        try:
            out = ("ok", fn())
        except CheckpointError as e:
            out = ("checkpoint", str(e))
        except OSError as e:
            out = ("checkpoint", one_line_error(e))
        except ValueError as e:
            if not user_errors:
                raise
            out = ("user", str(e))
    status, value = broadcast_object(out)
    if status == "checkpoint":
        raise CheckpointError(value)
    if status == "user":
        shared = UserError(value)
        shared.agreed = True  # every rank raises it; rank 0 reports it
        raise shared
    return value


def agreed_on_rank0(fn, what: str) -> None:
    """``fn()`` on rank 0, its outcome agreed before any rank goes on: whatever it raises (torch's
    ``CheckpointException`` is a ``BaseException``) is the same one-line ``CheckpointError``
    ``"{what}: {line}"`` on every rank, so no rank waits in a later collective for one that failed
    (collective). For rank 0's writes that must not fail alone (a checkpoint's ``.metadata``)."""
    error, cause = None, None
    if dist.get_rank() == 0:
        try:
            fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            error, cause = f"{what}: {one_line_error(e)}", e
    error = broadcast_object(error)
    if error:
        raise CheckpointError(error) from cause
