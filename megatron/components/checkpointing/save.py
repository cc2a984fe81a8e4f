"""``save_checkpoint``: a collective save into a temporary directory, published as ``iter_N`` by
``writer`` (now, or when an asynchronous save is finalized)."""

from __future__ import annotations

import os
import secrets
import shutil
from typing import Optional, Union

import torch.distributed as dist

from megatron.components.checkpointing.errors import CheckpointError, broadcast_object, one_line_error
from megatron.components.checkpointing.hashing import verify_mode
from megatron.components.checkpointing.manifest import MANIFEST, iter_name, new_lineage
from megatron.components.checkpointing.retention import move_aside
from megatron.components.checkpointing.state import sharded_state
from megatron.components.checkpointing.writer import finalize_pending_save, start_pending_save, write_save
from megatron.components.config import VerifyCheckpoint

__all__ = ["save_checkpoint"]


def save_checkpoint(
    save_dir: str,
    iteration: int,
    model_chunks,
    optimizer=None,
    scheduler=None,
    *,
    consumed_samples: int = 0,
    layout: dict,
    configs: dict,
    keep_last: Optional[int] = None,
    tokenizer_files: Optional[dict] = None,
    lineage: Optional[str] = None,
    verify: Union[bool, str, VerifyCheckpoint] = VerifyCheckpoint.full,
    async_save: bool = False,
) -> str:
    """Save a checkpoint collectively (every rank calls it). Returns the final directory.

    ``configs`` (plain, JSON-serialisable dicts: model, parallel, training, data...) is stored in the
    manifest so other tools (evaluation, distillation, placement) can rebuild the model from the
    checkpoint alone. ``tokenizer_files`` ({role: path}, e.g. ``{"tokenizer_model": ...}``) are
    copied into ``iter_N/tokenizer/`` so the checkpoint is self-contained. ``lineage`` (default: a
    new one) is recorded in the manifest; ``keep_last`` then prunes older checkpoints of that
    lineage only. ``verify`` is what the manifest records besides every file's size (full: every
    file's sha256, sizes: the ``.metadata`` file's, off: none), hashed by all ranks in parallel. A
    complete ``iter_N`` that already exists is never overwritten (an error); an incomplete one is
    moved aside first. Any failure (a full disk, a read-only directory) is a one-line
    ``CheckpointError`` on every rank, and the temporary directory is removed.

    ``async_save``: the state is planned and copied to host memory now, written by a background
    thread while training goes on, and becomes ``iter_N`` (manifest, rename, latest pointer,
    pruning) only when ``finalize_pending_save`` is called on every rank; the returned path does
    not exist before that. A save first finalizes the one in flight, so at most one is.
    """
    from megatron.compat.dist_ckpt import start_save

    finalize_pending_save()
    rank, world = dist.get_rank(), dist.get_world_size()
    lineage = lineage or new_lineage()
    final = os.path.join(save_dir, iter_name(iteration))
    error = None
    tmp = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            if os.path.exists(final):
                if os.path.isfile(os.path.join(final, MANIFEST)):
                    error = f"refusing to overwrite the existing checkpoint {final}"
                else:
                    move_aside(final, "incomplete (no manifest.json)")
            if error is None:
                tmp = os.path.join(save_dir, f".tmp-{iter_name(iteration)}-{secrets.token_hex(4)}")
                os.makedirs(tmp)
        except OSError as e:
            error = f"cannot save checkpoint {final}: {one_line_error(e)}"
    error, tmp = broadcast_object((error, tmp))
    if error:
        raise CheckpointError(error)
    state = sharded_state(
        model_chunks, optimizer, scheduler, is_loading=False, rank=rank, world=world,
        with_optimizer=optimizer is not None, with_rng=True,
    )
    state["iteration"] = iteration
    state["consumed_samples"] = consumed_samples
    finish = dict(save_dir=save_dir, tmp=tmp, final=final, iteration=iteration,
                  consumed_samples=consumed_samples, layout=layout, configs=configs,
                  has_optimizer=optimizer is not None, tokenizer_files=tokenizer_files, lineage=lineage,
                  keep_last=keep_last, mode=verify_mode(verify))
    try:
        try:
            request, finalize = start_save(state, tmp)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # torch's CheckpointException is a BaseException
            raise CheckpointError(f"cannot save checkpoint {final}: {one_line_error(e)}") from e
        if async_save:
            start_pending_save(request, finalize, finish)
            return final
        write_save(request, finalize, finish)
    except BaseException:
        if rank == 0 and tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
