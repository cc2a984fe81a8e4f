"""From a planned save to a published checkpoint: this rank's shards written now (``write_save``)
or by a daemon thread (``PendingSave``, ended by ``finalize_pending_save``, which the next save and
the end of the run call on every rank, so at most one save is in flight), then the same collective
end for both (``_end_save``). Each step's outcome is agreed before the next collective: every
rank's write, then rank 0's ``.metadata`` and ``metadata.json`` (megatron-core's finalize,
``compat.dist_ckpt.SaveFinalize``), then the hashes; so a failure anywhere is the same one-line
``CheckpointError`` on every rank and nothing is published. Publishing is rank 0's manifest, the
rename of the temporary directory to ``iter_N``, the latest pointer and pruning, in that order, so
the pointer only ever names a complete checkpoint; a prune that fails after that is a warning (the
checkpoint is saved).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Optional

import torch.distributed as dist

from megatron.common import collectives
from megatron.common.files import write_json
from megatron.components.checkpointing.errors import CheckpointError, agreed_on_rank0, from_rank0, one_line_error
from megatron.components.checkpointing.hashing import hash_files, hash_shares, hashed, list_files
from megatron.components.checkpointing.manifest import MANIFEST, build_manifest, write_latest
from megatron.components.checkpointing.retention import prune

logger = logging.getLogger(__name__)

__all__ = ["PendingSave", "pending_save", "start_pending_save", "finalize_pending_save", "write_save"]

_PENDING: Optional["PendingSave"] = None


def _copy_to_host(write_buckets: list) -> list:
    """megatron-core's write buckets with every tensor copied to host memory. On CPU the planned
    tensors are the parameters and optimizer state themselves (megatron-core copies only views,
    ``filesystem_async.py:151``), which training goes on changing while the thread writes; on GPU
    this is the device-to-host copy."""
    return [(file_name, key, (bytes_data, [(item, t.detach().to("cpu", copy=True)) for item, t in tensor_data]))
            for file_name, key, (bytes_data, tensor_data) in write_buckets]


def _write_shards(request, args: list) -> None:
    """This rank's shards written by megatron-core's ``async_fn`` (the in-process writer of
    ``compat.dist_ckpt``) with ``args``; raises the writer's failure."""
    if request.async_fn is None:  # nothing to write on this rank
        return
    request.async_fn(*args, **request.async_fn_kwargs)
    results = args[2]  # the in-process results queue (megatron/compat/dist_ckpt.py)
    outcome = results.get_nowait()
    results.put(outcome)  # SaveFinalize.gather reads it again
    if isinstance(outcome, BaseException):
        raise outcome


class PendingSave:
    """An asynchronous save in flight (``save_checkpoint(..., async_save=True)``): this rank's
    shards written by a daemon thread from a host copy of the state (bytes items, ``common.pt``
    and the plan were made in the training thread). Nothing of it is a checkpoint until
    ``finalize_pending_save``; a process that dies first leaves only a ``.tmp-iter_*`` directory."""

    def __init__(self, request, finalize, finish: dict):
        self.final: str = finish["final"]
        self.iteration: int = finish["iteration"]
        self.request = request
        self.finalize = finalize
        self.finish = finish
        self.error: Optional[BaseException] = None
        self._args = list(request.async_fn_args)
        if request.async_fn is not None:
            self._args[1] = _copy_to_host(self._args[1])
        self.thread = threading.Thread(target=self._write, name=f"checkpoint-writer-{self.iteration}",
                                       daemon=True)
        self.thread.start()

    def _write(self) -> None:
        try:
            _write_shards(self.request, self._args)
        except BaseException as e:
            self.error = e

    def done(self) -> bool:
        """Whether this rank's writer has finished (the checkpoint still needs finalizing)."""
        return not self.thread.is_alive()


def pending_save() -> Optional[PendingSave]:
    """The asynchronous save in flight on this rank, if any."""
    return _PENDING


def start_pending_save(request, finalize, finish: dict) -> None:
    """Write a planned save (``compat.dist_ckpt.start_save``'s ``request`` and ``finalize``) in the
    background; ``finish``: ``_complete_save``'s arguments. Call ``finalize_pending_save`` first."""
    global _PENDING
    _PENDING = PendingSave(request, finalize, finish)


def write_save(request, finalize, finish: dict) -> None:
    """Write a planned save in this thread and complete it (collective); the synchronous save."""
    args = list(request.async_fn_args)
    if request.async_fn is not None and request.preload_fn is not None:
        args[1] = request.preload_fn()  # the tensors staged in host memory (megatron-core's sync save)
    error = None
    try:
        _write_shards(request, args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        error = e
    _end_save(error, finalize, finish)


def finalize_pending_save() -> Optional[str]:
    """Make the asynchronous save in flight a checkpoint; collective (every rank calls it, at the
    next save and at the end of the run). Waits for this rank's writer, agrees with the other ranks
    that every write succeeded, lets rank 0 finish megatron-core's files (``.metadata`` and
    ``metadata.json``), hashes, writes the manifest and renames: the write-then-rename rule of a
    synchronous save. Returns the checkpoint's path, or None when none is in flight. A failed
    write or finish is the same one-line ``CheckpointError`` on every rank and the temporary
    directory is removed."""
    global _PENDING
    pending, _PENDING = _PENDING, None
    if pending is None:
        return None
    try:
        pending.thread.join()
        _end_save(pending.error, pending.finalize, pending.finish)
    except BaseException:
        tmp = pending.finish["tmp"]
        if dist.get_rank() == 0 and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return pending.final


def _end_save(write_error: Optional[BaseException], finalize, finish: dict) -> None:
    """Collective, once this rank's writer is done (``write_error``: its failure): the ranks agree
    that every write succeeded, rank 0 finishes megatron-core's files with its outcome agreed
    (``finalize``: ``compat.dist_ckpt.SaveFinalize``), then ``_complete_save``."""
    cannot = f"cannot save checkpoint {finish['final']}"
    gathered = [None] * dist.get_world_size()
    collectives.all_gather_object(gathered, None if write_error is None else f"{cannot}: {one_line_error(write_error)}")
    first = next((e for e in gathered if e), None)
    if first:
        raise CheckpointError(first)
    results = finalize.gather()
    agreed_on_rank0(lambda: finalize.write(results), cannot)
    _complete_save(**finish)


def _complete_save(*, save_dir, tmp, final, iteration, consumed_samples, layout, configs, has_optimizer,
                   tokenizer_files, lineage, keep_last, mode) -> None:
    """Collective, once every rank's shards are written: rank 0 copies the tokenizer files and lists
    the files, every rank hashes its share (``hash_shares``), and rank 0 writes the manifest and
    renames (``_publish``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    collectives.barrier()

    def cannot(e: OSError) -> CheckpointError:
        return CheckpointError(f"cannot save checkpoint {final}: {one_line_error(e)}")

    def listing():
        try:
            return _copy_tokenizer_files(tmp, tokenizer_files), list_files(tmp)
        except OSError as e:
            raise cannot(e) from None

    copied, sizes = from_rank0(listing)
    share = hash_shares({rel: n for rel, n in sizes.items() if hashed(rel, mode)}, world)[rank]
    try:
        mine = ("ok", hash_files(tmp, share))
    except OSError as e:
        mine = ("error", str(cannot(e)))
    gathered = [None] * world
    collectives.all_gather_object(gathered, mine)
    errors = [value for status, value in gathered if status == "error"]
    if errors:
        raise CheckpointError(errors[0])
    digests = {}
    for _, value in gathered:
        digests.update(value)
    files = {rel: {"bytes": n, **({"sha256": digests[rel]} if rel in digests else {})}
             for rel, n in sorted(sizes.items())}

    def publish():
        manifest = build_manifest(iteration=iteration, consumed_samples=consumed_samples, layout=layout,
                                  has_optimizer=has_optimizer, configs=configs, lineage=lineage,
                                  tokenizer_files=copied, mode=mode, files=files)
        try:
            _publish(save_dir, tmp, final, manifest, keep_last)
        except OSError as e:
            raise cannot(e) from None

    from_rank0(publish)


def _copy_tokenizer_files(tmp: str, tokenizer_files: Optional[dict]) -> dict:
    """Rank 0: ``tokenizer_files`` ({role: path}) copied into ``tmp/tokenizer/``; {role: relative path}."""
    copied = {}
    if tokenizer_files:
        os.makedirs(os.path.join(tmp, "tokenizer"))
        for role, src in tokenizer_files.items():
            dst = os.path.join("tokenizer", os.path.basename(src))
            shutil.copyfile(src, os.path.join(tmp, dst))
            copied[role] = dst
    return copied


def _publish(save_dir: str, tmp: str, final: str, manifest: dict, keep_last: Optional[int]) -> None:
    """Rank 0, once every file is written and hashed: manifest, rename, latest pointer, pruning (in
    that order, so the pointer only ever names a complete checkpoint)."""
    write_json(os.path.join(tmp, MANIFEST), manifest, default=str)
    os.rename(tmp, final)
    _fsync_dir(save_dir)
    write_latest(save_dir, manifest["iteration"])
    if keep_last:
        try:
            prune(save_dir, keep_last, manifest["lineage"], keep=final)
        except OSError as e:  # the checkpoint is saved: a failed clean-up must not stop the run
            logger.warning("checkpoint %s saved, but pruning the older ones (--keep-last-checkpoints %d) failed: "
                           "%s; they stay on disk", final, keep_last, one_line_error(e))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
