"""The dispatcher's byte counters equal a hand computation from the routing actually taken.

Each MoE layer's router reports its routing map (tokens x experts); expert e lives on EP rank
e // (E / EP). A routed copy (token, expert) is a row of the all-to-all; it crosses the network iff
the expert's rank is not the token's rank. Then per rank: dispatch bytes = rows sent off-rank x H x
4 (fp32), combine bytes = rows received from other ranks x H x 4 (the combine returns them),
backward = both again (the gradients retrace the rows), and metadata = one fp32 probability per
row of the dispatch only (the combine carries no probabilities): sent rows forward, received rows
backward.
"""

import torch
import torch.distributed as dist

from megatron.training.config import ParallelConfig
from megatron.training.testing import run_distributed
from tests.helpers import batch, build_and_load, forward_loss, tiny_model_config


def _count(rank, world):
    from megatron.training.model_builder import moe_layers
    from megatron.training.training import comm_counters
    from moe_variants.common.comm import CommCounters

    cfg = tiny_model_config(moe_layer_freq=1)
    model, pgc = build_and_load(cfg, ParallelConfig(expert_model_parallel_size=2))
    maps = {}
    for layer in moe_layers(model):
        layer.router.routing_observer = lambda n, routing_map, probs: maps.__setitem__(n, routing_map.clone())
    tokens, labels = batch(rank)
    forward_loss(model, tokens, labels).sum().backward()
    measured = CommCounters.total(comm_counters([model]))
    per_rank_experts = cfg.num_experts // world
    sent = received = 0
    for n, routing_map in maps.items():
        gathered = [torch.empty_like(routing_map) for _ in range(world)]
        dist.all_gather(gathered, routing_map)
        owner = torch.arange(cfg.num_experts) // per_rank_experts
        for src, rmap in enumerate(gathered):
            rows_to = torch.zeros(world, dtype=torch.long)
            for dst in range(world):
                rows_to[dst] = rmap[:, owner == dst].sum()
            if src == rank:
                sent += int(rows_to.sum() - rows_to[rank])
            else:
                received += int(rows_to[rank])
    return measured, sent, received, cfg.hidden_size


def test_byte_counters_match_routing():
    for measured, sent, received, hidden in run_distributed(_count, 2):
        assert sent > 0 and received > 0
        assert measured["bytes_dispatch"] == sent * hidden * 4
        assert measured["bytes_combine"] == received * hidden * 4
        assert measured["bytes_backward"] == (sent + received) * hidden * 4
        assert measured["bytes_meta"] == (sent + received) * 4
        assert measured["time_fwd_s"] > 0 and measured["time_bwd_s"] > 0
