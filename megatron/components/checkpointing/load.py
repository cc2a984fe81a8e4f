"""``load_checkpoint``: pick and verify the checkpoint (``verify``), compare its tensors with the
model's (``layout``), then read it. Model weights reshard across TP/EP/PP; optimizer state and RNG
states are restored only where the layout allows (see the package doc)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Union

import torch.distributed as dist

from megatron.common import collectives
from megatron.components.checkpointing.errors import CheckpointError, broadcast_object, one_line_error
from megatron.components.checkpointing.layout import architecture_problem, model_tensor_shapes, same_parallel_layout
from megatron.components.checkpointing.rng import set_rng_state
from megatron.components.checkpointing.state import load_model_state, sharded_state
from megatron.components.checkpointing.verify import pick_and_verify
from megatron.components.config import VerifyCheckpoint

logger = logging.getLogger(__name__)

__all__ = ["LoadedCheckpoint", "load_checkpoint"]


@dataclasses.dataclass
class LoadedCheckpoint:
    path: str
    iteration: int
    consumed_samples: int
    manifest: dict
    optimizer_loaded: bool
    skipped: list = dataclasses.field(default_factory=list)  # newer bad checkpoints passed over (fallback)


def load_checkpoint(
    load_dir: str,
    model_chunks,
    optimizer=None,
    scheduler=None,
    *,
    layout: Optional[dict] = None,
    load_optimizer: bool = True,
    load_rng: bool = True,
    verify: Union[bool, str, VerifyCheckpoint] = VerifyCheckpoint.full,
    fallback: bool = False,
    offer_fallback: bool = False,
    expected_configs: Optional[dict] = None,
) -> Optional[LoadedCheckpoint]:
    """Load the newest checkpoint under ``load_dir`` collectively. None if there is none.

    Rank 0 picks the checkpoint and reads its manifest, every rank checks a share of its files
    (``verify``: ``VerifyCheckpoint`` full, sizes or off; ``True``/``False`` mean full/off), rank 0
    reads its pickled parts through the restricted readers (``fallback`` past bad newer ones) and
    every rank learns the verdict; the model's tensor names
    and shapes are then compared with the checkpoint's (``expected_configs``, the run's configs
    dict, names the differing fields). So a corrupt, unsafe or different-architecture checkpoint
    fails on all ranks with the same one-line ``CheckpointError`` before any tensor is read; a
    corrupt or incomplete one's names the remedy: the complete checkpoint before it, and
    ``--load-fallback`` where the command has that flag (``offer_fallback``).

    ``load_rng``: each rank's RNG states are restored only at the saved TP/PP/EP/DP layout
    (``same_parallel_layout``); at another, a rank's saved streams are another position's (TP1xDP2
    to TP2 would hand both TP ranks one tensor-parallel stream), so the states stay those
    ``parallel.initialize_parallel`` seeded for this layout from the seed, as in a fresh run.
    """
    from megatron.core import dist_checkpointing

    rank, world = dist.get_rank(), dist.get_world_size()
    path, manifest, ckpt_shapes, skipped = pick_and_verify(load_dir, verify=verify, fallback=fallback,
                                                           offer_fallback=offer_fallback)
    if path is None:
        return None
    same_layout = layout is not None and manifest["layout"] == layout
    with_optimizer = bool(load_optimizer and optimizer is not None and manifest["has_optimizer"])
    if with_optimizer and not same_layout:
        if rank == 0:
            logger.warning(
                "checkpoint %s was saved at layout %s; this run is %s: loading weights, iteration "
                "and data position, and restarting the optimizer state",
                path, manifest["layout"], layout,
            )
        with_optimizer = False
    with_rng = load_rng and same_parallel_layout(manifest["layout"], layout)
    if load_rng and layout is not None and not with_rng and rank == 0:
        logger.warning(
            "checkpoint %s was saved at layout %s; this run is %s: not restoring its RNG states (they "
            "belong to other ranks' positions); each rank keeps the ones seeded for this layout at "
            "start-up, as a fresh run would", path, manifest["layout"], layout,
        )
    state = sharded_state(
        model_chunks, optimizer, scheduler, is_loading=True, rank=rank, world=world,
        with_optimizer=with_optimizer, with_rng=with_rng,
    )
    gathered = [None] * world if rank == 0 else None
    collectives.gather_object(model_tensor_shapes(state["model"]), gathered, dst=0)
    problem = None
    if rank == 0:
        model_shapes = {}
        for shapes in gathered:
            for key, shape in shapes.items():
                if model_shapes.get(key) is None:
                    model_shapes[key] = shape
        problem = architecture_problem(path, manifest, ckpt_shapes, model_shapes, expected_configs)
    problem = broadcast_object(problem)
    if problem:
        raise CheckpointError(problem)
    try:
        loaded = dist_checkpointing.load(state, path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {one_line_error(e)}") from e
    load_model_state(model_chunks, loaded["model"])
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        if scheduler is not None and "scheduler" in loaded:
            scheduler.load_state_dict(loaded["scheduler"])
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()
    if with_rng and loaded.get("rng_state") is not None:
        set_rng_state(loaded["rng_state"])
    collectives.barrier()
    return LoadedCheckpoint(
        path=path,
        iteration=int(manifest["iteration"]),
        consumed_samples=int(manifest["consumed_samples"]),
        manifest=manifest,
        optimizer_loaded=with_optimizer,
        skipped=[p for p, _ in skipped],
    )
