"""Atomic file writes: a temporary file in the same directory, fsynced, then renamed into place.

Readers never see a partial file and a crash (or a full disk) leaves the previous file intact. This
is the one implementation in the project; standard library only, so the torch-free cost model
(``netsim``) uses it too.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from megatron.common.cli import UserError

__all__ = ["atomic_write", "write_json", "write_text", "refuse_existing"]


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None], mode: str = "w") -> Path:
    """Write ``path`` by calling ``write(fileobj)`` on a temporary file beside it, then renaming it
    into place. The file gets the usual permissions (``mkstemp`` would leave 0600)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, expected a file path")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_json(path: str | os.PathLike, obj: Any, *, indent: Optional[int] = 1, default=None) -> Path:
    """``obj`` as JSON (``default`` as in ``json.dump``, for values JSON cannot encode), atomically."""

    def dump(f):
        json.dump(obj, f, indent=indent, sort_keys=False, default=default)
        f.write("\n")

    return atomic_write(path, dump)


def write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text))


def refuse_existing(path: str | os.PathLike, flag: str, overwrite: bool = False) -> None:
    """``UserError`` when an output file exists and the user did not ask to replace it."""
    if os.path.exists(path) and not overwrite:
        raise UserError(f"{flag} {path} exists (pass --overwrite to replace it)")

