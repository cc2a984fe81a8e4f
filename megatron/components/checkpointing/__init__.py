"""Checkpoints: megatron-core ``dist_checkpointing`` written atomically, verified on load.

The package, one module per concern (every name below is imported from the package itself):
``manifest`` the on-disk format (names, latest pointer, manifest, config hash); ``hashing`` what
``--verify-checkpoint`` records and which rank hashes which file; ``verify`` the choice of
checkpoint and the checks before a tensor is read; ``safety`` the restricted readers of its
pickled parts; ``layout`` the saved layout and architecture versus this run's; ``rng`` the per-rank
RNG states; ``state`` the sharded state dict; ``writer`` publication and the asynchronous writer;
``retention`` pruning, leftovers and moving aside; ``save`` and ``load`` the two collectives;
``errors`` the one-line errors every rank agrees on.

Layout on disk::

    SAVE/
      latest_checkpointed_iteration.txt    written (temp + rename) after a checkpoint is complete
      writer.lock                          the running writer's pid/host (save_dir.py)
      iter_0000100/
        .metadata, __*_*.distcp, common.pt, metadata.json    megatron-core torch_dist format
        manifest.json                      ours: iteration, layout, configs, lineage, config hash,
                                           every file's size (and sha256, per --verify-checkpoint)
      iter_0000200.corrupt-20250101-120000 a bad checkpoint moved aside (never deleted)

A checkpoint is written into a hidden temporary directory (``.tmp-iter_N-*``) by this process
(``megatron/compat/dist_ckpt.py``: no writer processes a signal could kill) and renamed to
``iter_N`` only when every rank has finished and the manifest is written, so an interrupted save
never leaves a directory that looks complete, and an existing ``iter_N`` is never written into.
The latest pointer is written after the rename and only ever names a complete checkpoint.

Every run has a *lineage* (a random id recorded in its manifests and inherited when it resumes);
``--keep-last-checkpoints`` prunes only checkpoints of the saving run's lineage, so another run's
checkpoints in the same directory are never deleted (``save_dir.prepare_save_dir`` refuses such a
directory at start-up anyway).

The files are hashed by all ranks at once, each a share (``hash_shares``: the shards it wrote,
and the other files balanced by size), and rank 0 writes the digests into the manifest;
``--verify-checkpoint`` (``VerifyCheckpoint``, default ``full``) chooses what is recorded and
checked: ``full`` every file's sha256, ``sizes`` every file's size and the ``.metadata`` file's
sha256, ``off`` nothing (sizes are recorded anyway). Manifests of any mode, and of earlier
versions (every file hashed), load under any mode: a check the manifest has no hash for is skipped.

``save_checkpoint(..., async_save=True)`` plans the save and copies the state to host memory in
the training thread, writes the shards from a daemon thread, and returns; the checkpoint is
completed (hashes, manifest, rename, latest pointer) by ``finalize_pending_save``, a collective
that the next save and the end of the run call on every rank, so at most one save is in flight
and the write-then-rename rule is the synchronous save's. Both end the same way (``writer``):
every rank's write, then rank 0's ``.metadata`` and ``metadata.json``, are agreed on before the
next collective, so a failure of either is the same one-line error on every rank, not a hang, and
the previous checkpoint and the latest pointer stay as they were.

The RNG state saved per rank holds python's, numpy's, torch's and CUDA's generators and, when it
has any, megatron-core's CUDA RNG tracker states (the tensor/expert-parallel streams dropout under
TP/EP draws from), restored on load only at the same TP/PP/EP/DP layout; at another, every rank
keeps the states seeded for its new position at start-up (``parallel.set_seed``), as a fresh run.

On load the newest checkpoint is checked before anything is read: its manifest (file sizes and
hashes, checked by all ranks in parallel, each a share; a bad file is the same one-line error on
every rank), its pickled parts through restricted readers (``safety``: a crafted
``.metadata`` fails instead of running code) and its model tensors' names and shapes against the
model being loaded (a different architecture is one line naming the differing config fields). An
incomplete or corrupt newest checkpoint is an error naming it; an older one is used only when
``--load`` names it or with ``fallback`` (``--load-fallback``).

Model weights reshard across TP/EP/PP through ``dist_checkpointing``. Optimizer state is restored
only at the same parallel layout: megatron-core 0.16.1 splits expert and dense parameters into two
optimizers only when EP > 1 (``optimizer/__init__.py:645-690``), so the state's structure itself
depends on the layout. At a different layout the weights, iteration and data position load and the
optimizer restarts, with a warning.
"""

from megatron.components.checkpointing.errors import CheckpointError, broadcast_object, from_rank0, one_line_error
from megatron.components.checkpointing.hashing import hash_shares
from megatron.components.checkpointing.layout import layout_of
from megatron.components.checkpointing.load import LoadedCheckpoint, load_checkpoint
from megatron.components.checkpointing.manifest import (
    FORMAT_VERSION,
    LATEST_FILE,
    MANIFEST,
    METADATA_FILE,
    TMP_PREFIX,
    checkpoint_candidates,
    config_differences,
    config_hash,
    iteration_of,
    new_lineage,
    read_manifest_quietly,
    write_latest,
)
from megatron.components.checkpointing.retention import leftover_temporaries, move_aside, prune
from megatron.components.checkpointing.save import save_checkpoint
from megatron.components.checkpointing.verify import find_latest_checkpoint, read_manifest, verify_checkpoint
from megatron.components.checkpointing.writer import PendingSave, finalize_pending_save, pending_save
from megatron.components.config import VerifyCheckpoint

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "find_latest_checkpoint",
    "checkpoint_candidates",
    "read_manifest",
    "verify_checkpoint",
    "LoadedCheckpoint",
    "config_hash",
    "config_differences",
    "new_lineage",
    "iteration_of",
    "layout_of",
    "move_aside",
    "prune",
    "leftover_temporaries",
    "write_latest",
    "one_line_error",
    "broadcast_object",
    "from_rank0",
    "read_manifest_quietly",
    "VerifyCheckpoint",
    "PendingSave",
    "pending_save",
    "finalize_pending_save",
    "hash_shares",
    "FORMAT_VERSION",
    "LATEST_FILE",
    "MANIFEST",
    "METADATA_FILE",
    "TMP_PREFIX",
]
