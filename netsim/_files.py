"""Atomic file writes: a temporary file in the same directory, renamed into place."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

__all__ = ["atomic_write", "write_json", "write_text"]


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None], mode: str = "w") -> Path:
    """Write ``path`` by calling ``write(fileobj)`` on a temporary file next to it, then renaming it
    into place, so readers never see a partial file and a crash leaves the old one intact."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, expected a file path")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
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


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1) -> Path:
    return atomic_write(path, lambda f: json.dump(obj, f, indent=indent, sort_keys=False))


def write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text))
