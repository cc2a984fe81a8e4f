"""Layout-free model weights: the state dict a TP=1, EP=1 model would have.

``gather_global_state_dict`` assembles full tensors from any TP/EP layout (local experts renamed to
their global index, tensor-parallel shards concatenated along their partition dimension, SwiGLU
``linear_fc1`` halves gathered separately), and ``load_global_state_dict`` slices such a dict back
into a model built at any layout. Tests use it to compare layouts; checkpoint conversion and the
Sem-MoE placement pass use it as their interchange format. Checkpoints for training use
megatron-core ``dist_checkpointing`` instead (``megatron.components.checkpointing``), which reshards
without ever holding full tensors.

Grouped-GEMM experts (``moe_variants.common.experts.GroupedExperts``) appear under
``SequentialMLP``'s per-expert names (``...experts.local_experts.{i}.linear_fc1.weight``): each is a
slice of the stacked parameter, so both expert paths share one layout-free format (``named_weights``).

Pipeline parallelism is not handled here: each stage holds different layers (names are global
already via megatron-core's layer offsets); call this per stage.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import torch
import torch.distributed as dist
from megatron.common import collectives

from moe_variants.common.experts import GroupedExperts

__all__ = [
    "gather_global_state_dict",
    "gather_global_grads",
    "load_global_state_dict",
    "global_param_name",
    "Weight",
    "named_weights",
    "local_weights",
]

_LOCAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)")


def _moe_info(model):
    """{module prefix -> (num_local_experts, ep_rank)} for every MoE layer."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    info = {}
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            info[name] = (module.num_local_experts, module.local_expert_indices[0] // module.num_local_experts)
    return info


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight of this rank under its state-dict name: a parameter, or expert ``index`` of a
    stacked grouped-experts parameter (whose expert axis is dimension 0)."""

    name: str
    param: torch.nn.Parameter
    index: Optional[int] = None

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This weight's part of ``tensor`` (shaped like ``param``: its data, gradient, ...)."""
        return tensor if self.index is None else tensor[self.index]

    @property
    def tensor_model_parallel(self) -> bool:
        return bool(getattr(self.param, "tensor_model_parallel", False))

    @property
    def partition_dim(self) -> int:
        return self.param.partition_dim - (0 if self.index is None else 1)


def named_weights(model) -> list[Weight]:
    """This rank's weights in ``named_parameters`` order, grouped experts split per expert."""
    stacked = {}
    for prefix, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for name, param, index in module.expert_weights():
                stacked.setdefault(id(param), []).append(Weight(f"{prefix}.{name}", param, index))
    out = []
    for name, param in model.named_parameters():
        out.extend(stacked.get(id(param), [Weight(name, param)]))
    return out


def local_weights(model) -> dict[str, torch.Tensor]:
    """``{state-dict name: tensor}`` of this rank's weights (``named_weights``); a grouped expert's
    entry is a view of its stacked parameter, so copying into it sets the parameter."""
    return {w.name: w.param if w.index is None else w.param.detach()[w.index] for w in named_weights(model)}


def global_param_name(name: str, moe_info: dict) -> str:
    """Rename ``...experts.local_experts.{local}...`` to the expert's global index."""
    match = _LOCAL_EXPERT.search(name)
    if not match:
        return name
    prefix = name[: match.start()]
    num_local, ep_rank = moe_info[prefix]
    global_index = ep_rank * num_local + int(match.group(2))
    return name[: match.start()] + match.group(1) + str(global_index) + match.group(3) + name[match.end():]


def _is_gated_fc1(name: str, model) -> bool:
    return name.endswith("linear_fc1.weight") and bool(getattr(model.config, "gated_linear_unit", False))


def _tp_group_for(name: str, pg_collection):
    return pg_collection.expt_tp if ".experts." in name else pg_collection.tp


def _all_gather_cat(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world)]
    collectives.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _gather_tp(weight: Weight, data, model, pg_collection):
    name = weight.name
    if not weight.tensor_model_parallel:
        return data
    group = _tp_group_for(name, pg_collection)
    dim = weight.partition_dim
    if _is_gated_fc1(name, model) and dim == 0:
        gate, up = torch.chunk(data, 2, dim=0)
        return torch.cat([_all_gather_cat(gate, group, 0), _all_gather_cat(up, group, 0)], dim=0)
    return _all_gather_cat(data, group, dim)


def gather_global_state_dict(model, pg_collection=None) -> dict[str, torch.Tensor]:
    """Full, layout-free parameters on every rank (CPU copies), keyed by TP=1/EP=1 names.

    Collective over the model-parallel groups: every rank must call it.
    """
    return _gather_global(model, pg_collection, lambda p: p.detach())


def gather_global_grads(model, pg_collection=None) -> dict[str, torch.Tensor]:
    """Full gradients summed over data-parallel replicas, keyed by TP=1/EP=1 names.

    This is the gradient a single-device model would get for the concatenation of every
    replica's batch (with a summed loss). Sequence-parallel replicated parameters (norms, router)
    hold partial gradients per TP rank and are summed over TP first. Reads ``main_grad`` when
    megatron-core's DDP wraps the model, else ``grad``.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()

    def grad_of(param):
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        grad = torch.zeros_like(param) if grad is None else grad.detach().clone()
        if getattr(param, "sequence_parallel", False) and not getattr(param, "tensor_model_parallel", False):
            collectives.all_reduce(grad, group=pg_collection.tp)
        return grad

    grads = _gather_global(model, pg_collection, grad_of)
    expert_dp = pg_collection.expt_dp
    for key in sorted(grads):
        group = expert_dp if _LOCAL_EXPERT.search(key) else pg_collection.dp
        collectives.all_reduce(grads[key], group=group)
    return grads


def _gather_global(model, pg_collection, tensor_of) -> dict[str, torch.Tensor]:
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    moe_info = _moe_info(model)
    out: dict[str, torch.Tensor] = {}
    # expert parameters: gather across EP so every rank sees all experts
    ep_group = pg_collection.ep
    ep_world = dist.get_world_size(ep_group)
    values = {}  # one tensor_of per parameter (a stacked one serves all its experts)
    for weight in named_weights(model):
        name = weight.name
        if id(weight.param) not in values:
            values = {id(weight.param): tensor_of(weight.param)}
        full = _gather_tp(weight, weight.of(values[id(weight.param)]), model, pg_collection)
        if _LOCAL_EXPERT.search(name) and ep_world > 1:
            gathered = [torch.empty_like(full) for _ in range(ep_world)]
            collectives.all_gather(gathered, full.contiguous(), group=ep_group)
            match = _LOCAL_EXPERT.search(name)
            prefix = name[: match.start()]
            num_local, _ = moe_info[prefix]
            local = int(match.group(2))
            for rank, tensor in enumerate(gathered):
                global_name = (
                    name[: match.start()] + match.group(1) + str(rank * num_local + local)
                    + match.group(3) + name[match.end():]
                )
                out[global_name] = tensor.cpu().clone()
        else:
            out[global_param_name(name, moe_info)] = full.cpu().clone()
    return out


def _tp_slice(weight: Weight, full, model, pg_collection):
    name = weight.name
    if not weight.tensor_model_parallel:
        return full
    group = _tp_group_for(name, pg_collection)
    world = dist.get_world_size(group)
    if world == 1:
        return full
    rank = dist.get_rank(group)
    dim = weight.partition_dim
    if _is_gated_fc1(name, model) and dim == 0:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, world, 0)[rank], torch.chunk(up, world, 0)[rank]], 0)
    return torch.chunk(full, world, dim)[rank]


_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _pad_vocab(key, full, param, pg_collection):
    """Zero-pad vocabulary rows up to this layout's padded size (Megatron pads to a multiple of
    ``make_vocab_size_divisible_by x TP``, so the padded size depends on TP)."""
    if key not in _VOCAB_PARAMS or not getattr(param, "tensor_model_parallel", False):
        return full
    rows = param.shape[0] * dist.get_world_size(pg_collection.tp)
    if full.shape[0] < rows:
        pad = full.new_zeros((rows - full.shape[0],) + tuple(full.shape[1:]))
        return torch.cat([full, pad], 0)
    return full


def load_global_state_dict(
    model, state: dict[str, torch.Tensor], pg_collection=None, strict: bool = True
) -> list[str]:
    """Copy full tensors from ``state`` into this rank's shards. Returns the unused keys.

    With ``strict``, a parameter missing from ``state`` or a shape mismatch raises ``KeyError`` /
    ``ValueError`` naming the tensor.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    moe_info = _moe_info(model)
    used = set()
    missing = []
    with torch.no_grad():
        for weight in named_weights(model):
            key = global_param_name(weight.name, moe_info)
            if key not in state:
                missing.append(key)
                continue
            target = weight.of(weight.param)
            full = _pad_vocab(key, state[key], weight.param, pg_collection)
            local = _tp_slice(weight, full, model, pg_collection)
            if tuple(local.shape) != tuple(target.shape):
                raise ValueError(
                    f"{key}: checkpoint shape {tuple(state[key].shape)} gives a local shard "
                    f"{tuple(local.shape)}, but the model expects {tuple(target.shape)}"
                )
            target.copy_(local.to(target.dtype))
            used.add(key)
    if strict and missing:
        raise KeyError(f"missing from the state dict: {', '.join(missing)}")
    return sorted(set(state) - used)
