"""megatron.compat.tp_collectives: the counter sees megatron-core's TP reductions and gathers on
its group, with their bytes, and nothing else; leaving it restores the entry points. Exact counts."""

from __future__ import annotations

from tools.spawn import run_distributed


def _count(rank, world):
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    from megatron import compat
    from megatron.compat.tp_collectives import GroupCollectives

    compat.apply()  # the mappings' CUDA allocations on the CPU

    group = dist.new_group(list(range(world)))
    saved = (dist.all_reduce, mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func)
    with GroupCollectives(group) as counter:
        x = torch.ones(8, 4)
        mappings.reduce_from_tensor_model_parallel_region(x, group=group)  # the row-parallel output's all-reduce
        y = mappings.gather_from_tensor_model_parallel_region(torch.ones(3, 5), group=group)  # the logits' gather
        dist.all_reduce(torch.ones(2))  # the world group: not counted
        taken = counter.take()
        calls = [(op, size) for op, size, _, _ in taken]
        assert all(start <= end for _, _, start, end in taken)
        assert counter.calls == []
    restored = (dist.all_reduce, mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func) == saved
    return calls, tuple(y.shape), restored


def test_group_collectives_counts_the_tp_mappings():
    for calls, shape, restored in run_distributed(_count, 2, timeout_s=120):
        assert calls == [("all_reduce", 8 * 4 * 4), ("all_gather", 3 * 5 * 4)]
        assert shape == (3, 10) and restored
