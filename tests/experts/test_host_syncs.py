"""Host syncs of one MoE layer's forward and backward at EP = 1.

The grouped path is held to zero: the router, the dispatcher's sorted permutation, the grouped
GEMMs (offsets from ``tokens_per_expert`` on the device) and the unpermutation read nothing on the
host. The loop path keeps one: ``SequentialMLP`` splits its input by ``tokens_per_expert.tolist()``.
On the CPU the count is ``tools.bench.host_syncs.HostSyncCounter`` (the calls that would wait for a
GPU), itself checked here on snippets that sync and snippets that do not; on a GPU it is CUDA's
sync debug mode (skipped on CPU-only machines). Counts are exact.
"""

import pytest
import torch

from moe_variants.config import ParallelConfig
from tests.helpers import build_and_load, requires_gpu, tiny_model_config
from tools.bench.host_syncs import HostSyncCounter, count_cuda_syncs
from tools.spawn import run_distributed

GROUPED_SYNCS = 0  # per MoE layer, forward + backward, EP = 1
LOOP_SYNCS = 1  # SequentialMLP's tokens_per_expert.tolist()

x = torch.arange(6.0) - 2
mask = x > 0
ints = torch.tensor([0, 2, 2, 1])

SYNCING = {
    "item": lambda: x.sum().item(),
    "tolist": lambda: x.tolist(),
    "numpy": lambda: x.numpy(),
    "cpu": lambda: x.cpu(),
    "to(cpu)": lambda: x.to("cpu"),
    "bool": lambda: 1 if x.any() else 0,
    "int": lambda: int(ints[1]),
    "float": lambda: float(x[0]),
    "index": lambda: list(range(ints[1])),
    "nonzero": lambda: torch.nonzero(x),
    "nonzero method": lambda: x.nonzero(),
    "argwhere": lambda: torch.argwhere(x),
    "masked_select": lambda: x.masked_select(mask),
    "unique": lambda: torch.unique(ints),
    "unique_consecutive": lambda: torch.unique_consecutive(ints),
    "bincount": lambda: torch.bincount(ints),
    "where(condition)": lambda: torch.where(mask),
    "repeat_interleave": lambda: torch.repeat_interleave(x[:4], ints),
    "boolean-mask read": lambda: x[mask],
    "boolean-mask write": lambda: x.clone().__setitem__(mask, 0.0),
}
NOT_SYNCING = {
    "arithmetic": lambda: (x + 1).sum(),
    "device-generic move": lambda: x.to(x.device),
    "dtype cast": lambda: x.to(torch.float64),
    "where(c, a, b)": lambda: torch.where(mask, x, -x),
    "slice and index": lambda: (x[1:3], x[ints]),
    "sort and top-k": lambda: (x.argsort(stable=True), x.topk(2)),
    "cumsum": lambda: torch.cumsum(ints, 0, dtype=torch.int32),
    "repeat_interleave by an int": lambda: x.repeat_interleave(2),
}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_counter_sees_a_call_that_syncs(name):
    with HostSyncCounter() as syncs:
        SYNCING[name]()
    assert syncs.count == 1, syncs.calls
    assert syncs.calls[0][1].endswith(".py:" + syncs.calls[0][1].rsplit(":", 1)[1])  # a file:line


def test_counter_ignores_calls_that_do_not_sync():
    with HostSyncCounter() as syncs:
        for fn in NOT_SYNCING.values():
            fn()
    assert syncs.calls == []


def _layer(grouped: bool, bf16: bool = False):
    from moe_variants.common.moe_layer import moe_layers

    cfg = tiny_model_config(moe_layer_freq=[0, 1], moe_grouped_gemm=grouped, bf16=bf16)
    model, _ = build_and_load(cfg, ParallelConfig())
    layer = moe_layers(model)[0]
    param = next(layer.parameters())
    hidden = torch.randn(16, 2, 32, device=param.device, dtype=param.dtype, requires_grad=True)
    return layer, hidden


def _forward_backward(layer, hidden):
    out, _ = layer(hidden)
    out.sum().backward()


def _counted_syncs(rank, world, grouped):
    layer, hidden = _layer(grouped)
    with HostSyncCounter() as syncs:
        _forward_backward(layer, hidden)
    assert hidden.grad is not None and layer.router.weight.grad is not None
    return syncs.calls


@pytest.mark.parametrize("grouped,expected", [(True, GROUPED_SYNCS), (False, LOOP_SYNCS)], ids=["grouped", "loop"])
def test_moe_layer_syncs_at_ep1(grouped, expected):
    [calls] = run_distributed(_counted_syncs, 1, grouped, timeout_s=120)  # one forked rank
    assert len(calls) == expected, calls


def _cuda_syncs(rank, world):
    from moe_variants.common.experts import GroupedExperts

    layer, hidden = _layer(True, bf16=True)
    assert isinstance(layer.experts, GroupedExperts) and hidden.is_cuda
    _forward_backward(layer, hidden)  # warm-up: kernels, autotuning, allocator
    return count_cuda_syncs(lambda: _forward_backward(layer, hidden))


@requires_gpu
@pytest.mark.gpu
def test_moe_layer_cuda_syncs_at_ep1():
    """The same budget on a GPU, by CUDA's sync debug mode, for the grouped path in bf16 (one
    spawned NCCL rank)."""
    [(count, messages)] = run_distributed(_cuda_syncs, 1, backend="nccl", timeout_s=300)
    assert count == GROUPED_SYNCS, messages
