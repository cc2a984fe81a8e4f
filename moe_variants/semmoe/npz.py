"""The npz container of the profile and table formats: written atomically with a JSON ``meta``
entry, loaded with one-line errors for anything that is not such a file."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from megatron.common.files import atomic_write

__all__ = ["save_npz", "load_npz"]


def save_npz(path: str | os.PathLike, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> Path:
    """Atomically write an uncompressed npz with a JSON ``meta`` entry."""
    payload = dict(arrays)
    payload["meta_json"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    return atomic_write(path, lambda f: np.savez(f, **payload), mode="wb")


def load_npz(path: str | os.PathLike, kind: str, required: tuple[str, ...]) -> tuple[dict[str, np.ndarray], dict]:
    """Load an npz written by :func:`save_npz`; any problem becomes a one-line ``ValueError``.

    ``kind`` names the expected format (``meta["format"]``) in the error message.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such {kind} file")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a {kind} file (not an npz archive; truncated or overwritten?)")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays.pop("meta_json").tobytes().decode())
    except KeyError:
        raise ValueError(f"{path}: not a {kind} file (no metadata entry)") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, UnicodeDecodeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}: unreadable or corrupt {kind} file ({msg})") from None
    if meta.get("format") != kind:
        raise ValueError(f"{path}: not a {kind} file (format={meta.get('format')!r})")
    missing = [k for k in required if k not in arrays]
    if missing:
        raise ValueError(f"{path}: corrupt {kind} file, missing arrays {missing}")
    return arrays, meta
