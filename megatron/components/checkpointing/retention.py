"""What stays in a save directory: ``--keep-last-checkpoints`` pruning (of the saving run's lineage
only), the temporary directories interrupted saves leave, and bad checkpoints moved aside (never
deleted)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Optional

from megatron.components.checkpointing.manifest import TMP_PREFIX, iteration_of, read_manifest_quietly

logger = logging.getLogger(__name__)

__all__ = ["move_aside", "prune", "leftover_temporaries"]


def move_aside(path: str, why: str) -> str:
    """Rename a bad checkpoint directory to ``iter_N.corrupt-<time>`` (never deleted); returns the
    new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = f"{path}.corrupt-{stamp}"
    n = 1
    while os.path.exists(target):
        target = f"{path}.corrupt-{stamp}-{n}"
        n += 1
    os.rename(path, target)
    logger.warning("checkpoint %s is %s: moved aside to %s", path, why, os.path.basename(target))
    return target


def prune(save_dir: str, keep_last: int, lineage: str, keep: Optional[str] = None) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints of ``lineage`` in ``save_dir``
    (never ``keep``, never another lineage's). A checkpoint is first renamed to a ``.tmp-`` name,
    so a crash mid-delete leaves a temporary directory (cleaned at the next start), not a
    half-deleted ``iter_N``. Returns the deleted paths."""
    ours = []
    for name in os.listdir(save_dir):
        iteration = iteration_of(name)
        path = os.path.join(save_dir, name)
        if iteration is None or not os.path.isdir(path):
            continue
        manifest = read_manifest_quietly(path)
        if manifest is not None and manifest.get("lineage") == lineage:
            ours.append((iteration, path))
    ours.sort()
    deleted = []
    for _, path in ours[:-keep_last] if keep_last > 0 else []:
        if keep is not None and os.path.abspath(path) == os.path.abspath(keep):
            continue
        doomed = os.path.join(save_dir, f"{TMP_PREFIX}{os.path.basename(path)[len('iter_'):]}-pruned")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(path)
    return deleted


def leftover_temporaries(directory: str) -> list[str]:
    """The ``.tmp-iter_*`` directories interrupted saves (or prunes) left in a run directory."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, n) for n in names
                  if n.startswith(TMP_PREFIX) and os.path.isdir(os.path.join(directory, n)))
