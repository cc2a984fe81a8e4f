"""The asynchronous all-to-all keeps the tensor it sends alive until it has been waited on
(moe_variants/common/comm.py): on a GPU the caching allocator could otherwise reuse the block of a
``.contiguous()`` copy that only the launching frame held while NCCL still reads it (torch >= 2.7's
ProcessGroupNCCL no longer records streams; ``_launch`` also calls ``record_stream``, which a CPU
cannot show). Checked on 2 gloo ranks with weak references: the copy outlives the caller's
references, is released by ``wait()``, and the received rows are the ones sent (exact).
"""

from tools.spawn import run_distributed


def _rank(rank, world_size):
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from moe_variants.common.comm import all_to_all

    group = dist.new_group(list(range(world_size)))
    base = torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * rank
    sent = base.t()  # [4, 3], not contiguous: the collective sends a copy only _launch holds
    output, handles = all_to_all(group, sent, [2, 2], [2, 2], async_op=True)
    pending = handles["forward"]
    copy = weakref.ref(pending.source)
    assert pending.source is not sent and pending.source.is_contiguous()
    expected_from_peer = (torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * (1 - rank)).t()
    del sent, base
    gc.collect()
    alive_before_wait = copy() is not None
    received = pending.wait()
    gc.collect()
    released_after_wait = copy() is None and pending.source is None
    mine = slice(2 * rank, 2 * rank + 2)
    peer_rows = received[2 * (1 - rank):2 * (1 - rank) + 2]
    return alive_before_wait, released_after_wait, bool(torch.equal(peer_rows, expected_from_peer[mine]))


def test_async_all_to_all_keeps_its_input_until_waited():
    for alive, released, exact in run_distributed(_rank, 2, timeout_s=120):
        assert alive and released and exact
