"""The on-disk format: directory names, the latest pointer, the manifest (built, parsed, read) and the
config hash that says what a checkpoint holds."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from typing import Optional

from megatron.common.files import write_text
from megatron.components.checkpointing.errors import CheckpointError
from megatron.components.config import VerifyCheckpoint

__all__ = [
    "FORMAT_VERSION", "LATEST_FILE", "MANIFEST", "TMP_PREFIX", "METADATA_FILE", "iter_name", "iteration_of",
    "new_lineage", "config_hash", "config_differences", "write_latest", "build_manifest", "parse_manifest",
    "read_manifest_quietly", "is_checkpoint_dir", "checkpoint_candidates",
]

FORMAT_VERSION = 1
LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-iter_"
METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's metadata (hashed even with --verify-checkpoint sizes)
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
# config sections that do not change what a checkpoint holds (left out of its config hash)
_RUN_SECTIONS = ("parallel", "training", "data", "checkpoint", "logging")


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_of(path: str) -> Optional[int]:
    match = _ITER_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def new_lineage() -> str:
    """A fresh lineage id (a run that does not resume another run's checkpoint starts one)."""
    return secrets.token_hex(8)


def config_hash(configs: dict) -> str:
    """A short hash of what a checkpoint holds: the model's sections and the tokenizer (not the
    optimisation, data, checkpoint or logging settings, which a resumed run may change)."""
    held = {k: v for k, v in configs.items() if k not in _RUN_SECTIONS}
    return hashlib.sha256(json.dumps(held, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_differences(a: dict, b: dict, limit: int = 5) -> list[str]:
    """``field X (there) vs Y (here)`` for the model-defining fields that differ between two
    ``configs`` dicts (as stored in manifests)."""
    out = []
    for section in sorted(set(a) | set(b)):
        if section in _RUN_SECTIONS:
            continue
        sa, sb = a.get(section) or {}, b.get(section) or {}
        if not isinstance(sa, dict) or not isinstance(sb, dict):
            continue
        for key in sorted(set(sa) | set(sb)):
            if sa.get(key) != sb.get(key):
                out.append(f"{key} {sa.get(key)!r} vs {sb.get(key)!r}")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def write_latest(save_dir: str, iteration: Optional[int]) -> None:
    """Point ``latest_checkpointed_iteration.txt`` at ``iteration`` (a complete checkpoint), or
    remove it when there is none."""
    path = os.path.join(save_dir, LATEST_FILE)
    if iteration is None:
        if os.path.exists(path):
            os.unlink(path)
        return
    write_text(path, f"{iteration}\n")


def build_manifest(*, iteration: int, consumed_samples: int, layout: dict, has_optimizer: bool, configs: dict,
                   lineage: str, tokenizer_files: dict, mode: VerifyCheckpoint, files: dict) -> dict:
    """A checkpoint's manifest: what it holds, at which layout, of which run, and its files."""
    return {
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": layout,
        "has_optimizer": has_optimizer,
        "configs": configs,
        "config_hash": config_hash(configs),
        "lineage": lineage,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "tokenizer_files": tokenizer_files,
        "verify": mode.value,
        "files": files,
    }


def parse_manifest(path: str) -> dict:
    """A checkpoint directory's manifest, its structure and format version checked (not its
    files); raises ``CheckpointError``."""
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{manifest_path} is corrupt: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or not all(
            isinstance(info, dict) and isinstance(info.get("bytes"), int) for info in manifest["files"].values()):
        raise CheckpointError(f"{manifest_path} is not a checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format {manifest.get('format_version')}")
    return manifest


def read_manifest_quietly(path: str) -> Optional[dict]:
    """A checkpoint directory's manifest, unverified; None when it is missing or unreadable."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        return manifest if isinstance(manifest, dict) else None
    except (OSError, ValueError):
        return None


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST)) or iteration_of(path) is not None


def checkpoint_candidates(load_dir: str) -> list[tuple[int, str, Optional[str]]]:
    """``(iteration, path, problem)`` of the checkpoints under a run directory, newest first.

    ``problem`` is None for a directory with a manifest (complete as far as the directory tells;
    ``read_manifest`` verifies it), else why it cannot be loaded: no manifest, or named by the
    latest pointer but missing.
    """
    found = {}
    for name in os.listdir(load_dir):
        iteration = iteration_of(name)
        path = os.path.join(load_dir, name)
        if iteration is None or not os.path.isdir(path):
            continue
        found[iteration] = (path, None if os.path.isfile(os.path.join(path, MANIFEST))
                            else f"incomplete (no {MANIFEST})")
    latest = os.path.join(load_dir, LATEST_FILE)
    if os.path.isfile(latest):
        try:
            with open(latest) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text.isdigit() and int(text) not in found:
            found[int(text)] = (os.path.join(load_dir, iter_name(int(text))),
                                f"missing (named by {LATEST_FILE})")
    return [(it, path, problem) for it, (path, problem) in sorted(found.items(), reverse=True)]
