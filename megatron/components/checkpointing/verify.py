"""Which checkpoint to load, and everything checked before a tensor of it is read: its manifest, its
files' sizes and hashes (all ranks at once, each a share) and its pickled parts (the restricted
readers of ``safety``). An incomplete or corrupt newest checkpoint is an error naming it and the
remedy (the complete checkpoint before it, by path); an older one is used only when ``--load``
names it or with ``fallback``."""

from __future__ import annotations

import logging
import os
from typing import Optional, Union

import torch.distributed as dist

from megatron.common import collectives
from megatron.components.checkpointing.errors import CheckpointError, from_rank0, one_line_error
from megatron.components.checkpointing.hashing import first_problem, hash_shares, verify_mode
from megatron.components.checkpointing.manifest import (
    MANIFEST, checkpoint_candidates, is_checkpoint_dir, iteration_of, parse_manifest,
)
from megatron.components.checkpointing.retention import leftover_temporaries
from megatron.components.checkpointing.safety import UnsafeCheckpoint, check_checkpoint_files, tensor_shapes
from megatron.components.config import VerifyCheckpoint

logger = logging.getLogger(__name__)

__all__ = ["read_manifest", "verify_checkpoint", "find_latest_checkpoint", "pick_and_verify", "older_checkpoint",
           "remedy"]


def read_manifest(path: str, verify: Union[bool, str, VerifyCheckpoint] = True) -> dict:
    """Read a checkpoint's manifest and check its files in this process (``verify``: a
    ``VerifyCheckpoint`` mode, ``True`` full, ``False`` off); raises ``CheckpointError``. A
    collective load checks the files in parallel instead (``pick_and_verify``)."""
    manifest = parse_manifest(path)
    problem = first_problem(path, manifest["files"], list(manifest["files"]), verify_mode(verify))
    if problem:
        raise CheckpointError(problem[1])
    return manifest


def _safety_check(path: str, manifest: dict) -> dict:
    """The checkpoint's pickled parts through the restricted readers; ``{tensor key: shape}``."""
    try:
        metadata = check_checkpoint_files(path, set(manifest["files"]))
    except UnsafeCheckpoint as e:
        raise CheckpointError(f"unsafe checkpoint: {e}") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: {one_line_error(e)}") from None
    return tensor_shapes(metadata)


def verify_checkpoint(path: str, *, verify: Union[bool, str, VerifyCheckpoint] = True):
    """Everything checked before a checkpoint's tensors are read, in this process: the manifest
    (its files checked per ``verify``) and its pickled parts through the restricted readers.
    Returns ``(manifest, {tensor key: shape})``; raises ``CheckpointError``."""
    manifest = read_manifest(path, verify=verify)
    return manifest, _safety_check(path, manifest)


def find_latest_checkpoint(load_dir: str, *, fallback: bool = False, offer_fallback: bool = False) -> Optional[str]:
    """Directory of the newest checkpoint under ``load_dir`` (or ``load_dir`` itself if it is a
    checkpoint directory); None if there is none.

    An incomplete newest checkpoint (no manifest, or named by the latest pointer but missing) is a
    ``CheckpointError`` naming it and the remedy (``remedy``; ``offer_fallback``: the command has
    ``--load-fallback``); with ``fallback`` it is reported and the next older complete one is
    returned. Leftover temporary directories of interrupted saves are reported.
    """
    path, _ = _select(load_dir, fallback=fallback, offer_fallback=offer_fallback)
    return path


def older_checkpoint(bad: str) -> Optional[str]:
    """The newest complete checkpoint older than ``bad`` in its run directory, or None."""
    iteration = iteration_of(os.path.basename(os.path.normpath(bad)))
    try:
        candidates = checkpoint_candidates(os.path.dirname(os.path.normpath(bad))) if iteration is not None else []
    except OSError:
        return None
    return next((p for it, p, problem in candidates if problem is None and it < iteration), None)


def remedy(bad: str, *, offer_fallback: bool = False) -> str:
    """What to do about the unusable checkpoint ``bad``, for its error: load the complete one before
    it (named), or ``--load-fallback`` where the command has it (``offer_fallback``)."""
    older = older_checkpoint(bad)
    if older is None:
        return "no older checkpoint beside it: restore it from a copy, or save it again"
    fallback = ", or pass --load-fallback to use the newest good one" if offer_fallback else ""
    return f"load the one before it with --load {older}{fallback}"


def _select(load_dir: str, *, fallback: bool, offer_fallback: bool = False):
    """(path or None, [(bad path, problem)...] passed over)."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    if is_checkpoint_dir(load_dir):
        if not os.path.isfile(os.path.join(load_dir, MANIFEST)):
            raise CheckpointError(f"checkpoint {load_dir} is incomplete (no {MANIFEST}): {remedy(load_dir)}")
        return load_dir, []
    for tmp in leftover_temporaries(load_dir):
        logger.warning("%s is a leftover of an interrupted save (not a checkpoint; the next run "
                       "saving to %s removes it)", tmp, load_dir)
    skipped = []
    for _, path, problem in checkpoint_candidates(load_dir):
        if problem is None:
            return path, skipped
        if not fallback:
            raise CheckpointError(f"newest checkpoint {path} is {problem}: {remedy(path, offer_fallback=offer_fallback)}")
        logger.warning("checkpoint %s is %s: skipped (--load-fallback)", path, problem)
        skipped.append((path, problem))
    return None, skipped


def _verify_collective(path: str, mode: VerifyCheckpoint):
    """``verify_checkpoint`` on all ranks at once: rank 0 reads the manifest, every rank checks
    its share of the files (``hash_shares``: sizes, and hashes per ``mode``) in parallel, and the
    first bad file by name is the same one-line ``CheckpointError`` on every rank; rank 0 then
    reads the pickled parts through the restricted readers. Returns ``(manifest, shapes)``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest = from_rank0(lambda: read_manifest(path, verify=VerifyCheckpoint.off))
    files = manifest["files"]
    share = hash_shares({rel: info["bytes"] for rel, info in files.items()}, world)[rank]
    gathered = [None] * world
    collectives.all_gather_object(gathered, first_problem(path, files, share, mode))
    bad = min((p for p in gathered if p), default=None)
    if bad:
        raise CheckpointError(bad[1])
    return manifest, from_rank0(lambda: _safety_check(path, manifest))


def pick_and_verify(load_dir: str, *, verify, fallback: bool, offer_fallback: bool = False):
    """Collective: the checkpoint to load, verified, and the bad newer ones passed over
    (fallback): ``(path, manifest, {tensor key: shape}, [(bad path, problem)...])``, path None
    when there is none. Rank 0 reads the directory; the files are checked by all ranks. A bad
    checkpoint's error names the remedy (``remedy``; ``offer_fallback``: the command has
    ``--load-fallback``)."""
    mode = verify_mode(verify)
    path, skipped, explicit = from_rank0(
        lambda: (*_select(load_dir, fallback=fallback, offer_fallback=offer_fallback), is_checkpoint_dir(load_dir)))
    while path is not None:
        try:
            manifest, shapes = _verify_collective(path, mode)
            return path, manifest, shapes, skipped
        except CheckpointError as e:
            if explicit or not fallback:
                offer = offer_fallback and not explicit  # an explicit iter_ directory never falls back
                raise CheckpointError(f"{e} ({remedy(path, offer_fallback=offer)})") from None
            if dist.get_rank() == 0:
                logger.warning("%s: skipped (--load-fallback)", e)
            skipped.append((path, str(e)))
            bad = path
            path = from_rank0(lambda: next((p for it, p, problem in checkpoint_candidates(load_dir)
                                             if problem is None and it < iteration_of(bad)), None))
    return None, None, None, skipped
