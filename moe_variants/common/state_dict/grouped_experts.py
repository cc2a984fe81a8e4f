"""``GroupedExperts``' stacked parameters in ``SequentialMLP``'s checkpoint layout, both ways.

``GroupedExperts`` (``moe_variants/common/experts.py``) holds ``fc1_weight`` [E, 2F/tp, H_in] and
``fc2_weight`` [E, H_in, F/tp]; expert ``e`` of each is ``SequentialMLP``'s
``local_experts.e.linear_fc1.weight`` / ``linear_fc2.weight`` ([out, in], the same tensor-parallel
slice). Checkpoints are interchangeable with ``SequentialMLP``:

- ``state_dict()`` has ``SequentialMLP``'s keys (``local_experts.{i}.linear_fc1.weight``, ...,
  and the linears' ``_extra_state``); ``load_state_dict`` takes those or the stacked names
  (``install``: torch's public state-dict hooks);
- ``sharded_state_dict`` (megatron-core dist-checkpointing) writes the same keys with the same
  global shapes ([E, 2F, H] under ``experts.experts.linear_fc1.weight``, the SwiGLU halves as
  separate chunks) chunked per rank instead of per expert; the loader reshards either way, and the
  optimizer state follows the parameter's sharding, so it moves between the two paths too.

Shape legend: E local experts, H_in expert input/output width, F expert FFN width, tp expert-TP size.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

__all__ = ["LINEARS", "install", "sharded_state_dict"]

# (stacked parameter, SequentialMLP's linear) of each projection
LINEARS = (("fc1_weight", "linear_fc1"), ("fc2_weight", "linear_fc2"))


def install(module) -> None:
    """Give a ``GroupedExperts`` module ``SequentialMLP``'s ``state_dict()`` keys, and let its
    ``load_state_dict`` take them."""
    module.register_state_dict_post_hook(_per_expert_keys)
    module.register_load_state_dict_pre_hook(_stacked_keys)


def _per_expert_keys(module, state_dict, prefix, local_metadata) -> None:
    """``state_dict()`` post-hook: each stacked parameter as ``SequentialMLP``'s per-expert
    weights (views of it), with the linears' empty ``_extra_state``."""
    stacked = {name: state_dict.pop(prefix + name) for name, _ in LINEARS}
    for e in range(module.num_local_experts):
        for name, linear in LINEARS:
            state_dict[f"{prefix}local_experts.{e}.{linear}.weight"] = stacked[name][e]
            state_dict[f"{prefix}local_experts.{e}.{linear}._extra_state"] = None


def _stacked_keys(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                  error_msgs) -> None:
    """``load_state_dict`` pre-hook: per-expert weights (``SequentialMLP``'s keys) stacked into
    the parameters' own keys; a stacked tensor (a dist-checkpoint load) passes as it is."""
    for e in range(module.num_local_experts):
        for _, linear in LINEARS:
            state_dict.pop(f"{prefix}local_experts.{e}.{linear}._extra_state", None)
    for name, linear in LINEARS:
        keys = [f"{prefix}local_experts.{e}.{linear}.weight" for e in range(module.num_local_experts)]
        present = [k for k in keys if k in state_dict]
        if not present:
            continue
        if len(present) < len(keys):
            missing_keys.extend(k for k in keys if k not in state_dict)
        parts = [state_dict.pop(k) for k in present]
        if len(parts) == len(keys) and prefix + name not in state_dict:
            state_dict[prefix + name] = torch.stack(parts)


def sharded_state_dict(module, prefix="", sharded_offsets=(), metadata=None) -> dict:
    """``GroupedExperts.sharded_state_dict``: ``SequentialMLP``'s dist-checkpoint keys and global
    shapes; one sharded tensor per stacked parameter, so the optimizer maps its state to it."""
    if (metadata or {}).get("singleton_local_shards", False):
        raise ValueError("singleton_local_shards checkpoints need the SequentialMLP experts "
                         "(--no-moe-grouped-gemm)")
    ep_size, ep_rank = module.ep_group.size(), module.ep_group.rank()
    tp_size, tp_rank = module.tp_group.size(), module.tp_group.rank()
    dp_rank = module.dp_group.rank()
    axis = len(sharded_offsets)  # the expert axis, in front of [out, in]
    replica_id = (0, 0, dp_rank)
    out = {}
    fc1_key = f"{prefix}experts.linear_fc1.weight"
    if module.config.gated_linear_unit:
        out[f"{prefix}fc1_weight"] = _swiglu_factory(fc1_key, module.fc1_weight, sharded_offsets, axis,
                                                     (ep_rank, ep_size), (tp_rank, tp_size), replica_id)
    else:
        out[f"{prefix}fc1_weight"] = ShardedTensor.from_rank_offsets(
            fc1_key, module.fc1_weight, *sharded_offsets, (axis, ep_rank, ep_size),
            (axis + 1, tp_rank, tp_size), replica_id=replica_id, prepend_axis_num=axis)
    out[f"{prefix}fc2_weight"] = ShardedTensor.from_rank_offsets(
        f"{prefix}experts.linear_fc2.weight", module.fc2_weight, *sharded_offsets, (axis, ep_rank, ep_size),
        (axis + 2, tp_rank, tp_size), replica_id=replica_id, prepend_axis_num=axis)
    num_global = ep_size * module.num_local_experts
    for e in range(module.num_local_experts):
        offsets = (*sharded_offsets, (axis, ep_rank * module.num_local_experts + e, num_global))
        for _, linear in LINEARS:
            out[f"{prefix}local_experts.{e}.{linear}._extra_state"] = make_sharded_object_for_checkpoint(
                None, f"{prefix}experts.{linear}._extra_state", offsets, (0, tp_rank, dp_rank))
    return out


def _swiglu_factory(key, weight, sharded_offsets, axis, ep, tp, replica_id):
    """The stacked SwiGLU fc1 [E, 2F/tp, H] as ``SequentialMLP`` stores it: the gate and up halves
    of each rank's slice at their places in the global [E_total, 2F, H] (gate rows first)."""
    (ep_rank, ep_size), (tp_rank, tp_size) = ep, tp

    @torch.no_grad()
    def build(key, data, replica_id, flattened_range):
        assert flattened_range is None, "flattened optimizer formats are not supported"
        gate, up = torch.chunk(data, 2, dim=1)
        return [ShardedTensor.from_rank_offsets(key, half, *sharded_offsets, (axis, ep_rank, ep_size),
                                                (axis + 1, offset, 2 * tp_size), replica_id=replica_id,
                                                prepend_axis_num=axis)
                for half, offset in ((gate, tp_rank), (up, tp_size + tp_rank))]

    @torch.no_grad()
    def merge(parts):
        return torch.cat(parts, dim=1)

    return ShardedTensorFactory(key, weight, build, merge, replica_id)
