"""What every command line shares: the error skeleton, argparse value types, subcommands.

A user error is one line, never a traceback; anything else keeps its traceback.

A ``UserError`` (a ``ValueError``) is raised by argument, config and data validation; code that
validates with plain ``ValueError``s marks its calls with ``with user_input():``, which re-raises
them (and ``FileNotFoundError``) as ``UserError``. Only ``UserError`` (and exceptions that mean bad
input by their type, such as a corrupt checkpoint's) is reported as bad input: a plain
``ValueError`` from deep inside a command, a shape bug in a forward or at step 10,000, keeps its
traceback on the rank where it happened and exits 1.

``run_cli(prog, body)`` runs ``body()``; argparse's own exits (``--help``, a malformed flag, which
argparse already reported in one line) return their code; an exception in ``user_errors`` (default:
``UserError``) prints ``prog: error: <first line>`` and returns 2; ``cleanup`` runs in every case.
Standard library only, so torch-free tools use it too.

Under a launcher (``RANK`` set) the line is printed once. Every rank normally raises the same user
error, and rank 0 prints it; the other ranks wait ``PEER_REPORT_WAIT_S`` first, so that a launcher
that stops the ranks when one exits (torchrun) cannot end rank 0 before it has printed. A check
that can fail on one rank alone (rank 0 writing the outputs, a rank's own files) agrees on its
outcome (``megatron.common.collectives.agreed``) so that every rank raises its error and none
waits in a later collective for a rank that has exited; a user error a rank still running after
the wait raised alone, unagreed, is printed by that rank (``prog: error: rank N: ...``). The rank
that prints the line also writes it to torchrun's error file (``process.record_failure``), so that
torchrun's closing summary, the last lines on the screen, names the error, not a link to its docs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import os
import sys
from typing import Callable, Optional

from megatron.common.process import record_failure

__all__ = [
    "UserError",
    "user_input",
    "run_cli",
    "one_line",
    "did_you_mean",
    "ArgumentParser",
    "positive_int",
    "nonneg_int",
    "positive_float",
    "float_list",
    "int_list",
    "Subcommands",
]


class UserError(ValueError):
    """Bad input (a flag, a config, a file, data): reported as one line, exit code 2."""

    agreed = False  # every rank raises it and rank 0 reports it (``collectives.agreed`` sets it)


# how long a rank other than 0 waits before reporting a user error itself (see ``run_cli``)
PEER_REPORT_WAIT_S = 3.0


@contextlib.contextmanager
def user_input(*kinds: type):
    """Re-raise ``ValueError``s and ``FileNotFoundError``s (or ``kinds``) raised inside as
    ``UserError``: the block validates user input."""
    try:
        yield
    except UserError:
        raise
    except (kinds or (ValueError, FileNotFoundError)) as e:
        raise UserError(one_line(e) if isinstance(e, ValueError) else str(e)) from e


def _wait_for_rank0() -> None:
    """Give rank 0 the time to report the error every rank raised before this rank exits: a
    launcher that stops every rank when one exits (torchrun) would otherwise end rank 0 before it
    prints. A launcher's SIGTERM ends the wait (and the process) at once."""
    import signal
    import threading
    import time

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(PEER_REPORT_WAIT_S)


def one_line(err: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def did_you_mean(name: str, known) -> str:
    """`` (did you mean X?)`` naming the one of ``known`` nearest to the unknown ``name``
    (``difflib``), or "" when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose error for unrecognized arguments names the nearest known flag of each
    unknown one (``--num-layer``: did you mean ``--num-layers``?)."""

    def hinted(self, message: str) -> str:
        """``message`` with the nearest known flag of each unrecognized one."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return message
        known = [s for s in self._option_string_actions if s.startswith("--")]
        return message + "".join(did_you_mean(arg.split("=", 1)[0], known) for arg in message[len(prefix):].split()
                                 if arg.startswith("--"))

    def error(self, message):
        super().error(self.hinted(message))


def run_cli(
    prog: str,
    body: Callable[[], Optional[int]],
    *,
    user_errors: tuple | Callable[[], tuple] = (UserError,),
    cleanup: Optional[Callable[[], None]] = None,
) -> int:
    """Run a command's body and map its outcome to an exit code (0, argparse's code, or 2).
    ``user_errors``: the exception types reported as one line, or a function giving them when one
    is raised (so that a command need not import a module only to name its error class)."""
    try:
        return int(body() or 0)
    except SystemExit as e:  # argparse: --help (0) or a bad command line (2), already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except Exception as e:
        if not isinstance(e, user_errors() if callable(user_errors) else user_errors):
            raise
        rank = int(os.environ.get("RANK", "0"))
        if rank != 0:
            _wait_for_rank0()
            if getattr(e, "agreed", False):
                return 2
        line = f"{prog}: error: {f'rank {rank}: ' if rank else ''}{one_line(e)}"
        record_failure(line)  # under torchrun its closing summary shows the line, last on the screen
        print(line, file=sys.stderr, flush=True)
        return 2
    finally:
        if cleanup is not None:
            cleanup()


# ---------------------------------------------------------------------------------------------
# argparse value types (the one set every command line uses)
# ---------------------------------------------------------------------------------------------


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def nonneg_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def float_list(text: str) -> list[float]:
    """Comma-separated numbers (``1,2.5,4``)."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def int_list(text: str) -> list[int]:
    """Comma-separated integers (``1,2,4``)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# ---------------------------------------------------------------------------------------------
# subcommands (``prog <command> ...``)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Optional[int]]


class Subcommands:
    """A registry of subcommands: ``@commands.add(name, help, configure)`` registers ``run(args)``;
    ``main(argv)`` parses and runs one through :func:`run_cli`."""

    def __init__(self, prog: str, description: str = ""):
        self.prog = prog
        self.description = description
        self.commands: dict[str, Command] = {}

    def add(self, name: str, help: str, configure: Callable[[argparse.ArgumentParser], None]):
        def deco(run):
            if name in self.commands:
                raise ValueError(f"command {name!r} registered twice")
            self.commands[name] = Command(name, help, configure, run)
            return run

        return deco

    def parser(self) -> argparse.ArgumentParser:
        parser = ArgumentParser(prog=self.prog, description=self.description,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        sub = parser.add_subparsers(dest="command", required=True)
        for cmd in self.commands.values():
            cmd.configure(sub.add_parser(cmd.name, help=cmd.help, description=cmd.help))
        return parser

    def main(self, argv: list, *, user_errors: tuple | Callable[[], tuple] = (UserError,),
             prepare: Optional[Callable[[argparse.Namespace], None]] = None) -> int:
        def body():
            args = self.parser().parse_args(argv)
            if prepare is not None:
                prepare(args)
            return self.commands[args.command].run(args)

        return run_cli(self.prog, body, user_errors=user_errors)
