"""Shuffled reduce-scatter / all-gather on 2 gloo ranks equal plain collectives plus a permutation.

Reference: torch.distributed.nn's differentiable reduce_scatter / all_gather on the explicitly
permuted tensor, and the inverse permutation after the gather. Values are float64 partial sums of
two ranks, so forward results are compared exactly (a + b is the same either way round); the
gradients go through the same two-term sums and are compared exactly as well.
"""

import torch

from tools.spawn import run_distributed


def _worker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_gather as ag_nn
    from torch.distributed.nn.functional import reduce_scatter as rs_nn

    from moe_variants.semmoe.scheduling import (
        align_to_ranks,
        inverse_permutation,
        rebatch_permutation,
        shuffle_local,
        shuffled_all_gather,
        shuffled_reduce_scatter,
    )

    group = dist.new_group(list(range(world_size)))  # an explicit group, not the default one
    gen = torch.Generator().manual_seed(0)  # same draws on every rank
    n, h = 12, 3
    partial = torch.randn(world_size, n, h, generator=gen, dtype=torch.float64)  # per-rank partial sums
    pred = torch.randint(-1, world_size, (n,), generator=gen)
    conf = torch.rand(n, generator=gen)
    weights = torch.randn(n, h, generator=gen, dtype=torch.float64)
    perm = rebatch_permutation(align_to_ranks(pred, conf, world_size), world_size)
    n_local = n // world_size
    rows = perm[rank * n_local : (rank + 1) * n_local]

    # Fused path.
    x = partial[rank].clone().requires_grad_(True)
    local = shuffled_reduce_scatter(x, perm, group)
    moe_out = local * (rank + 2.0)  # a rank-specific stand-in for the MoE layer
    full = shuffled_all_gather(moe_out, perm, group)
    (full * weights).sum().backward()

    # Reference: permute, plain reduce-scatter, plain all-gather, inverse permutation.
    x_ref = partial[rank].clone().requires_grad_(True)
    send = x_ref[perm]
    local_ref = rs_nn(torch.empty(n_local, h, dtype=torch.float64), list(send.chunk(world_size)), group=group)
    gathered = torch.cat(ag_nn(local_ref * (rank + 2.0), group=group))
    full_ref = gathered[inverse_permutation(perm)]
    (full_ref * weights).sum().backward()

    positions = torch.arange(n) + 1000
    (pos_local,) = shuffle_local(perm, rank, world_size, positions)
    return {
        "local": local.detach(),
        "local_ref": local_ref.detach(),
        "summed_rows": partial.sum(0)[rows],
        "full": full.detach(),
        "full_ref": full_ref.detach(),
        "grad": x.grad,
        "grad_ref": x_ref.grad,
        "pos_local": pos_local,
        "pos_expect": positions[rows],
        "perm": perm,
    }


def test_shuffled_collectives_match_reference():
    outs = run_distributed(_worker, 2, timeout_s=120)
    assert torch.equal(outs[0]["perm"], outs[1]["perm"])
    assert not torch.equal(outs[0]["perm"], torch.arange(12))  # the shuffle is not a no-op
    for o in outs:
        assert torch.equal(o["local"], o["local_ref"])
        assert torch.equal(o["local"], o["summed_rows"])  # rank r holds the summed rows perm[r-slice]
        assert torch.equal(o["full"], o["full_ref"])
        assert torch.equal(o["grad"], o["grad_ref"])
        assert torch.equal(o["pos_local"], o["pos_expect"])
    # the all-gather restores the original order: row i is the MoE output of token i
    perm, n_local = outs[0]["perm"], outs[0]["perm"].numel() // 2
    for r, o in enumerate(outs):
        rows = perm[r * n_local : (r + 1) * n_local]
        assert torch.equal(outs[0]["full"][rows], o["local"] * (r + 2.0))
