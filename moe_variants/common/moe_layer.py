"""The project's base MoE layer and router: megatron-core's, with our dispatcher and hooks.

``ProjectMoELayer`` is megatron-core's ``MoELayer`` (same parameters, same phase methods, so the
same checkpoints) whose token dispatcher is one of ours (counted, device-generic collectives).
BigMac and FarSkip subclass it. ``ProjectRouter`` is ``TopKRouter`` whose gating does not move its
weight to ``torch.cuda.current_device()`` (``router.py:88-92``) when running on the CPU, and which
can report its routing decisions to an observer (Sem-MoE profiling).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection, router_gating_linear
from megatron.core.transformer.moe.router import TopKRouter

from moe_variants.common.comm import CommCounters
from moe_variants.common.dispatcher import build_token_dispatcher

__all__ = ["ProjectMoELayer", "ProjectRouter", "moe_layers", "comm_counters", "reset_comm_counters", "comm_totals"]

# RoutingObserver(layer_number, routing_map [T, E] bool, probs [T, E]) -> None
RoutingObserver = Callable[[int, torch.Tensor, torch.Tensor], None]


class ProjectRouter(TopKRouter):
    """``TopKRouter`` that computes on the input's device and can report its decisions."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.routing_observer: Optional[RoutingObserver] = None

    def gating(self, input: torch.Tensor):
        if input.device.type != "cpu":
            return super().gating(input)
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            self.config.moe_router_dtype, input.dtype
        )
        return router_gating_linear(input, self.weight, self.bias, router_dtype)

    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        probs, routing_map = super().forward(input, padding_mask)
        if self.routing_observer is not None:
            self.routing_observer(self.layer_number, routing_map.detach(), probs.detach())
        return probs, routing_map


class ProjectMoELayer(MoELayer):
    """megatron-core ``MoELayer`` with the project's token dispatcher.

    ``pg_collection`` arrives through the spec's params: ``TransformerLayer`` passes it only to
    ``MoELayer`` itself, tested by equality (``transformer_layer.py:352``), not to subclasses.
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        if config.moe_shared_expert_overlap:
            raise ValueError(
                "--moe-shared-expert-overlap is not supported: it needs CUDA side streams and "
                "conflicts with the project's dispatchers (FarSkip overlaps the shared expert itself)"
            )
        super().__init__(config, submodules, layer_number, pg_collection)
        self.pg_collection = pg_collection
        self.token_dispatcher = build_token_dispatcher(
            config, self.num_local_experts, self.local_expert_indices, pg_collection
        )

    @property
    def comm_counters(self):
        return self.token_dispatcher.comm


def moe_layers(module: torch.nn.Module) -> list:
    """All MoE layers (``MoELayer`` instances) in a model, in order."""
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def _chunks(models) -> list:
    return list(models) if isinstance(models, (list, tuple)) else [models]


def comm_counters(models) -> list:
    """The ``CommCounters`` of every MoE layer of a model (or a list of model chunks) on this rank.

    A megatron-core ``MoELayer`` reports its dispatcher's ``comm``; any other module that does
    expert-parallel communication (the EP benchmark's peers, e.g. a DeepSpeed-MoE layer) reports
    by carrying a ``CommCounters`` as ``moe_comm_counters``.
    """
    out = []
    for chunk in _chunks(models):
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                counters = getattr(module.token_dispatcher, "comm", None)
            else:
                counters = getattr(module, "moe_comm_counters", None)
            if isinstance(counters, CommCounters):
                out.append(counters)
    return out


def reset_comm_counters(models) -> None:
    """Zero every MoE layer's counters (before the step or evaluation they should count)."""
    for counters in comm_counters(models):
        counters.reset()


def comm_totals(models) -> dict:
    """The counters of every MoE layer summed into one plain dict (``CommCounters.total``)."""
    return CommCounters.total(comm_counters(models))
