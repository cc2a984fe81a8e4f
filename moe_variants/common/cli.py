"""The error skeleton every command line shares: a user error is one line, never a traceback.

``run_cli(prog, body)`` runs ``body()``; argparse's own exits (``--help``, a malformed flag, which
argparse already reported in one line) return their code; an exception in ``user_errors`` prints
``prog: error: <first line>`` on rank 0 only (under torchrun every rank raises the same error) and
returns 2; ``cleanup`` runs in every case. Standard library only, so torch-free tools use it too.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional

__all__ = ["run_cli", "one_line"]


def one_line(err: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def run_cli(
    prog: str,
    body: Callable[[], Optional[int]],
    *,
    user_errors: tuple = (ValueError,),
    cleanup: Optional[Callable[[], None]] = None,
) -> int:
    """Run a command's body and map its outcome to an exit code (0, argparse's code, or 2)."""
    try:
        return int(body() or 0)
    except SystemExit as e:  # argparse: --help (0) or a bad command line (2), already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except user_errors as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {one_line(e)}", file=sys.stderr, flush=True)
        return 2
    finally:
        if cleanup is not None:
            cleanup()
