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

from moe_variants.config import ParallelConfig
from tools.spawn import run_distributed
from tests.helpers import batch, build_and_load, forward_loss, tiny_model_config


def _count(rank, world):
    from moe_variants.common.moe_layer import moe_layers
    from moe_variants.common.moe_layer import comm_counters
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


def test_busy_time_is_the_union_of_intervals_in_any_order():
    import random

    from moe_variants.common.comm import BusyTime

    rng = random.Random(0)
    for _ in range(200):
        intervals = [(a, a + rng.choice([0.0, 0.5, 1.0, 3.0])) for a in (rng.randrange(20) / 2 for _ in range(8))]
        busy = BusyTime()
        for start, end in intervals:
            busy.add(start, end)
        covered = sum(any(s <= x / 100 < e for s, e in intervals) for x in range(0, 2500)) / 100
        assert abs(busy.total - covered) < 1e-9, intervals
        assert all(a[1] < b[0] for a, b in zip(busy.spans, busy.spans[1:]))  # disjoint, sorted


def test_concurrent_collectives_count_once_in_time_but_waits_add_up():
    """Two collectives in flight together (an overlapped dispatch and its probabilities) occupy
    the wall time once; a blocking one after them adds its own; totals take the union across
    layers, so the overlap fraction 1 - exposed / time is not inflated by concurrency."""
    from moe_variants.common.comm import CommCounters

    a, b = CommCounters(), CommCounters()
    a.add_time(False, 0.0, 1.0, 0.25)  # dispatch, waited for its last quarter
    a.add_time(False, 0.1, 0.9, 0.0)  # probabilities, inside the dispatch's interval
    a.add_time(False, 2.0, 3.0, 1.0)  # blocking
    b.add_time(False, 2.5, 3.5, 0.5)  # another layer, half overlapping the blocking one
    b.add_time(True, 0.0, 2.0, 0.0)
    assert a.time_fwd_s == 2.0 and a.exposed_fwd_s == 1.25
    total = CommCounters.total([a, b])
    assert total["time_fwd_s"] == 2.5 and total["exposed_fwd_s"] == 1.75
    assert total["time_bwd_s"] == 2.0
    a.reset()
    assert a.time_fwd_s == 0.0 and CommCounters.total([a])["time_fwd_s"] == 0.0
