"""What a checkpoint was saved as versus what this run builds: the parallel layout (which decides
whether optimizer state can be restored) and the model's tensor names and shapes (a different
architecture is one line naming the differing config fields, before any tensor is read)."""

from __future__ import annotations

import re
from typing import Optional

from megatron.components.checkpointing.manifest import config_differences

__all__ = ["layout_of", "same_parallel_layout", "model_tensor_shapes", "architecture_problem"]

_OPTIMIZER_KEY = re.compile(r"(^|\.)optimizer\.")
# the sizes that place a rank (its TP, PP, EP, expert-TP and DP position); the distributed
# optimizer changes the optimizer state's structure, not where a rank sits
_PARALLEL_SIZES = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "expert_model_parallel_size", "expert_tensor_parallel_size")


def layout_of(parallel, train_cfg, world_size: int) -> dict:
    """The parallel layout that determines whether optimizer state can be restored."""
    return {
        "world_size": world_size,
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "expert_model_parallel_size": parallel.expert_model_parallel_size,
        "expert_tensor_parallel_size": parallel.expert_tensor_parallel_size,
        "use_distributed_optimizer": bool(getattr(train_cfg, "use_distributed_optimizer", False)),
    }


def same_parallel_layout(saved: dict, layout: Optional[dict]) -> bool:
    """Whether every rank of ``layout`` sits where the same rank sat when ``saved`` (a manifest's
    layout) was written: same world, TP, PP, EP and expert-TP sizes, hence the same DP size. Only
    then are a rank's saved RNG streams its own."""
    return layout is not None and all(saved.get(k) == layout.get(k) for k in _PARALLEL_SIZES)


def model_tensor_shapes(model_sd) -> dict:
    """``{key: global shape or None}`` of a model sharded state dict's tensors (None where a
    factory builds the stored tensors: only the key is compared)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for value in nested_values(model_sd):
        if isinstance(value, ShardedTensor):
            out[value.key] = tuple(value.global_shape)
        elif isinstance(value, ShardedTensorFactory):
            out.setdefault(value.key, None)
    return out


def architecture_problem(path: str, manifest: dict, ckpt_shapes: dict, model_shapes: dict,
                         expected_configs: Optional[dict]) -> Optional[str]:
    """One line when the checkpoint's model tensors do not match the model's, naming the config
    fields that differ (from the manifest) and the first tensor that does not fit."""
    stored = {k: s for k, s in ckpt_shapes.items() if not _OPTIMIZER_KEY.search(k)}
    first = None
    for key in sorted(model_shapes):
        if key not in stored:
            first = f"{key} is not in the checkpoint"
            break
        if model_shapes[key] is not None and tuple(stored[key]) != tuple(model_shapes[key]):
            first = f"{key} is {list(stored[key])} there, {list(model_shapes[key])} here"
            break
    if first is None:
        extra = sorted(set(stored) - set(model_shapes))
        if not extra:
            return None
        first = f"{extra[0]} is in the checkpoint but not in this model"
    fields = config_differences(manifest.get("configs") or {}, expected_configs or {}) if expected_configs else []
    what = f": {', '.join(fields)} (checkpoint vs this run)" if fields else ""
    return f"checkpoint {path} holds a different model{what}; {first}"
