"""What ``--verify-checkpoint`` records and checks for each file, and which rank hashes which file:
the files are hashed by all ranks at once, each a share (``hash_shares``), at save and at load."""

from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Union

from megatron.components.checkpointing.errors import one_line_error
from megatron.components.checkpointing.manifest import MANIFEST, METADATA_FILE
from megatron.components.config import VerifyCheckpoint

__all__ = ["verify_mode", "hashed", "hash_shares", "list_files", "hash_files", "file_problem", "first_problem"]

_RANK_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


def verify_mode(verify: Union[bool, str, VerifyCheckpoint, None]) -> VerifyCheckpoint:
    """A ``VerifyCheckpoint`` from the value callers pass (``True``/``None``: full, ``False``: off)."""
    if verify is None or verify is True:
        return VerifyCheckpoint.full
    if verify is False:
        return VerifyCheckpoint.off
    return VerifyCheckpoint(verify)


def hashed(rel: str, mode: VerifyCheckpoint) -> bool:
    """Whether a file's sha256 is recorded (save) or checked (load) under ``mode``."""
    return mode is VerifyCheckpoint.full or (mode is VerifyCheckpoint.sizes and rel == METADATA_FILE)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_shares(sizes: dict, world: int) -> list:
    """Split a checkpoint's files between ``world`` ranks for hashing (a pure function).

    ``sizes``: ``{relative path: bytes}``. A ``__R_*.distcp`` shard goes to rank R (the rank that
    wrote it, when the world size is the saving one); every other file, largest first, to the rank
    with the fewest bytes so far (ties: the lowest rank). Returns ``world`` sorted lists of paths,
    disjoint, covering every file; deterministic.
    """
    shares = [[] for _ in range(world)]
    loads = [0] * world
    rest = []
    for rel, size in sizes.items():
        match = _RANK_SHARD.match(rel)
        if match and int(match.group(1)) < world:
            shares[int(match.group(1))].append(rel)
            loads[int(match.group(1))] += size
        else:
            rest.append(rel)
    for rel in sorted(rest, key=lambda r: (-sizes[r], r)):
        rank = min(range(world), key=lambda i: (loads[i], i))
        shares[rank].append(rel)
        loads[rank] += sizes[rel]
    return [sorted(share) for share in shares]


def list_files(directory: str) -> dict:
    """``{relative path: bytes}`` of a checkpoint directory's files (the manifest excepted)."""
    sizes = {}
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, directory)
            if rel != MANIFEST:
                sizes[rel] = os.path.getsize(full)
    return sizes


def hash_files(directory: str, rels: list) -> dict:
    """``{rel: sha256}``, a few files at a time (hashlib releases the GIL on large buffers)."""
    if len(rels) <= 1:
        return {rel: _sha256(os.path.join(directory, rel)) for rel in rels}
    with ThreadPoolExecutor(max_workers=min(4, len(rels))) as pool:
        return dict(zip(rels, pool.map(lambda rel: _sha256(os.path.join(directory, rel)), rels)))


def file_problem(path: str, rel: str, info: dict, mode: VerifyCheckpoint) -> Optional[str]:
    """Why one file of a checkpoint fails its manifest entry under ``mode``; None if it passes."""
    if mode is VerifyCheckpoint.off:
        return None
    full = os.path.join(path, rel)
    if not os.path.isfile(full):
        return f"checkpoint {path} is incomplete: {rel} is missing"
    size = os.path.getsize(full)
    if size != info["bytes"]:
        return f"checkpoint {path} is corrupt: {rel} has {size} bytes, expected {info['bytes']}"
    if hashed(rel, mode) and "sha256" in info and _sha256(full) != info["sha256"]:
        return f"checkpoint {path} is corrupt: {rel} fails its sha256 check"
    return None


def first_problem(path: str, files: dict, rels: list, mode: VerifyCheckpoint) -> Optional[tuple]:
    """``(rel, message)`` of the first file of ``rels`` (by name) that fails its check, or None."""
    for rel in sorted(rels):
        try:
            problem = file_problem(path, rel, files[rel], mode)
        except OSError as e:
            problem = f"checkpoint {path}: {rel}: {one_line_error(e)}"
        if problem:
            return rel, problem
    return None
