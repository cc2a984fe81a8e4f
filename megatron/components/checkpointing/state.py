"""What each rank contributes to a checkpoint (its model chunks' sharded state, the optimizer's and
scheduler's, its RNG state) and how the loaded model state goes back into the chunks."""

from __future__ import annotations

from megatron import compat
from megatron.components.checkpointing.rng import rng_state

__all__ = ["sharded_state", "load_model_state"]


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def sharded_state(model_chunks, optimizer, scheduler, *, is_loading: bool, rank: int, world: int,
                  with_optimizer: bool, with_rng: bool) -> dict:
    """The sharded state dict that ``dist_checkpointing`` saves or fills: ``model`` (chunk ``i``'s
    keys prefixed ``chunk{i}.`` when there are several), ``optimizer`` and ``scheduler`` (with
    ``with_optimizer``) and ``rng_state`` (one item per rank, with ``with_rng``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {}
    model_sd = {}
    for i, chunk in enumerate(model_chunks):
        model_sd.update(_unwrap(chunk).sharded_state_dict(prefix="" if len(model_chunks) == 1 else f"chunk{i}."))
    state["model"] = model_sd
    if with_optimizer and optimizer is not None:
        if is_loading:
            compat.prepare_optimizer_for_load(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable"},
        )
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = ShardedObject(
            "rng_state", rng_state() if not is_loading else None, (world,), (rank,), replica_id=0
        )
    return state


def load_model_state(model_chunks, model_sd: dict) -> None:
    """The loaded ``model`` state into the chunks (strict: every parameter and no other)."""
    if len(model_chunks) == 1:
        _unwrap(model_chunks[0]).load_state_dict(model_sd, strict=True)
        return
    for i, chunk in enumerate(model_chunks):
        prefix = f"chunk{i}."
        _unwrap(chunk).load_state_dict(
            {k[len(prefix):]: v for k, v in model_sd.items() if k.startswith(prefix)}, strict=True
        )
