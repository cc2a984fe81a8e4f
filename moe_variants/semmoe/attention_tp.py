"""Sem-MoE's Algorithm 3 in a served model: attention tensor-parallel over the ranks that hold the
experts (paper App. B, its SGLang setting).

Without it (docs/design/serving.md, Layouts) every TP rank holds all of a step's tokens outside the
experts and routes and dispatches its own copy of them: the MoE layer computes, and its
all-to-all moves, every token TP times. Algorithm 3 keeps attention's activations replicated and
gives each rank a different share of the tokens inside each MoE layer:

1. before MoE layer ``l`` each real token of the step gets a predicted device: from the tokens
   table (``T[l][token id]``) or the sequence table (``A`` indexed by the devices the token was
   routed to in the previous layers), whichever is more confident; shares are aligned to equal
   per-rank slices, the engine's padding fills the free slots, and the tokens are grouped by
   device (``scheduling.rebatch_tokens``). The routed devices of a layer's tokens travel back
   with its output (one small all-gather of [T] ints per layer);
2. attention's output projection returns its un-reduced partial sum, and a reduce-scatter fused
   with that permutation (``shuffled_reduce_scatter``) gives each rank the summed rows of its own
   tokens: the same bytes as the all-reduce it replaces. The residual's rows are taken locally;
3. the MoE layer runs on those rows as it does under sequence parallelism (its shared expert
   gathers its input over TP and reduce-scatters its output); the routed tokens mostly find their
   experts on the same rank (the local activation rate the tables were solved for);
4. an all-gather fused with the inverse permutation (``shuffled_all_gather``) restores every token
   on every rank for the next layer's attention.

The arithmetic is the plain layer's, in another order of additions (the reduction and the expert
outputs): greedy tokens equal the unscheduled server's. Requires TP = EP over the same ranks (each
TP group is an EP group) and tables for that many devices. Tables without a token table (the
contiguous and EPLB baselines) give every rank its natural contiguous slice: the
sequence-parallel split, which ``tools.semmoe lar --mode tp`` measures them with. The real tokens
of a forward are the engine's ``active_token_count`` (the dynamic context packs them first), or
``num_real`` set by the caller of a plain forward. ``install`` wires it into a model and returns
its state, the ``registry.ServingModel`` the server reads: ``AttentionTP.local_rows(layer, n_real)``
tells which of a rank's rows in that MoE layer are real tokens (for counting local activations).

Shape legend: ``T`` tokens of the step (padded by the engine; all TP ranks hold the same ``T``),
``W`` TP = EP ranks, ``H`` hidden.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from megatron.compat.transformer_layer import wrap_forward_mlp
from moe_variants.common.moe_layer import moe_layers
from moe_variants.common.tp import unreduced
from moe_variants.registry import ServingModel

from .scheduling import rebatch_tokens, routed_devices, shuffle_local, shuffled_all_gather, shuffled_reduce_scatter
from .tables import Tables

__all__ = ["AttentionTP", "install"]


class AttentionTP(ServingModel):
    """Algorithm 3's state in one served model: the step's token ids and each MoE layer's
    permutation (see the module docstring)."""

    name = "semmoe-algorithm-3"

    def __init__(self, tables: Tables, group):
        self.tables = tables
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.token_ids: Optional[torch.Tensor] = None  # [T] of the current forward
        self.num_real: Optional[int] = None  # its first num_real tokens are requests' (None: all)
        self.perms: dict = {}  # MoE layer index -> [T] permutation of the current forward
        self.routed_local: dict = {}  # MoE layer index -> [T / W] routed device of this rank's rows
        self.history: list = []  # [T] routed devices of the forward's earlier MoE layers, newest first
        num_experts = int(tables.num_experts)
        # the placed checkpoint holds the tables' placement as megatron-core's contiguous split
        self.expert2device = torch.arange(num_experts) // (num_experts // self.world)

    def begin(self, token_ids: torch.Tensor, num_real: Optional[int] = None) -> None:
        """A forward starts: its tokens [T] (or [1, T]); the first ``num_real`` are real."""
        self.token_ids = token_ids.reshape(-1)
        self.num_real = num_real
        self.history = []

    def permutation(self, layer: int) -> torch.Tensor:
        lookback = self.tables.lookback
        prev = torch.stack(self.history[:lookback], dim=1) if len(self.history) >= lookback else None
        perm = rebatch_tokens(self.token_ids, self.tables, layer, prev, self.num_real)
        self.perms[layer] = perm
        return perm

    def observe_routing(self, layer: int, probs: torch.Tensor, routing_map: torch.Tensor) -> None:
        """The router's choice for this rank's rows: the device holding most of each row's top-k."""
        k = int(routing_map[0].sum()) if routing_map.shape[0] else 1
        topk = torch.topk(probs.float().masked_fill(~routing_map.bool(), float("-inf")), k, dim=1).indices
        self.routed_local[layer] = routed_devices(topk, self.expert2device.to(topk.device))

    def local_rows(self, layer: int, num_real: int) -> torch.Tensor:
        """[T / W] bool: which of this rank's rows in MoE layer ``layer``'s last forward are real
        tokens (the engine packs them first, then pads)."""
        perm = self.perms[layer]
        n_local = perm.numel() // self.world
        return perm[self.rank * n_local:(self.rank + 1) * n_local] < num_real

    # --- the layer pieces -----------------------------------------------------------------------
    def scatter_residual(self, layer: int, output_with_bias, residual, _dropout_prob=None):
        """In place of the attention's bias-dropout-add: the shuffled reduce-scatter of the partial
        attention output plus this rank's residual rows. [T, 1, H] -> [T / W, 1, H]."""
        out, bias = output_with_bias
        perm = self.permutation(layer)
        local = shuffled_reduce_scatter(out, perm, self.group)
        if bias is not None:
            local = local + bias
        (residual_local,) = shuffle_local(perm, self.rank, self.world, residual)
        return residual_local + local

    def gather_output(self, layer: int, output_local) -> torch.Tensor:
        """After the MoE layer: every token back on every rank, in the original order (and the
        devices its tokens were routed to, for the next layers' predictions)."""
        perm = self.perms[layer]
        routed = self.routed_local.pop(layer, None)
        if routed is not None:
            self.history.insert(0, shuffled_all_gather(routed.long(), perm, self.group))
        return shuffled_all_gather(output_local, perm, self.group)


def _capture_token_ids(state: AttentionTP, module, args, kwargs):
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        return
    context = kwargs.get("inference_context")
    real = getattr(context, "active_token_count", None)  # the dynamic context: real tokens first, then pads
    state.begin(ids, int(real) if real is not None else state.num_real)


def install(model, tables: Tables, group) -> AttentionTP:
    """Run every MoE layer of ``model`` (a GPTModel served at TP = EP = W, activations replicated
    outside the experts) by Algorithm 3. Returns its state."""
    state = AttentionTP(tables, group)
    layers = [layer for layer in _transformer_layers(model) if layer.mlp in set(moe_layers(model))]
    if len(layers) != tables.num_layers:
        raise ValueError(f"the tables are for {tables.num_layers} MoE layers, the model has {len(layers)}")
    if tables.num_devices != state.world:
        raise ValueError(f"the tables are for {tables.num_devices} devices, the TP group has {state.world} ranks")
    model.register_forward_pre_hook(functools.partial(_capture_token_ids, state), with_kwargs=True)
    for index, layer in enumerate(layers):
        _wire_layer(layer, state, index)
    return state


def _transformer_layers(model):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


def _wire_layer(layer, state: AttentionTP, index: int) -> None:
    attention = layer.self_attention
    attention_forward = attention.forward

    def partial_attention(*args, **kwargs):
        with unreduced(attention.linear_proj):
            return attention_forward(*args, **kwargs)

    attention.forward = partial_attention
    layer.self_attn_bda = lambda training, fused: functools.partial(state.scatter_residual, index)
    shared = getattr(layer.mlp, "shared_experts", None)
    if shared is not None:  # its rows differ per rank now: gather over TP and reduce-scatter, as under SP
        for linear in (shared.linear_fc1, shared.linear_fc2):
            linear.sequence_parallel = True
    router = layer.mlp.router
    router_forward = router.forward

    def observed_router(*args, **kwargs):
        probs, routing_map = router_forward(*args, **kwargs)
        state.observe_routing(index, probs, routing_map)
        return probs, routing_map

    router.forward = observed_router

    def mlp_then_gather(forward_mlp):
        def forward(hidden_states, *args, **kwargs):
            return state.gather_output(index, forward_mlp(hidden_states, *args, **kwargs))

        return forward

    wrap_forward_mlp(layer, mlp_then_gather)
