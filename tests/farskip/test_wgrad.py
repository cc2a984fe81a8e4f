"""Deferred expert weight gradients (moe_variants/common/wgrad.py): same gradients, computed later.

Tolerance: exact. Deferral runs the very matmul megatron-core's local linear runs
(``grad_output.t() @ input`` on the 2-D views), or the grouped experts' grouped weight-gradient GEMM,
and accumulates it the way autograd / megatron-core DDP would; only when it runs changes.
"""

import pytest
import torch

from moe_variants.config import ParallelConfig
from tools.spawn import run_distributed
from moe_variants.common import wgrad
from tests.helpers import batch, build_and_load, forward_loss, tiny_model_config


def test_deferred_linear_gives_autograds_gradients_at_the_end_of_backward():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(6, 8))
    seen = {}

    def probe(grad):  # runs inside the backward, after the linear's backward node
        seen["weight_grad_during_backward"] = w.grad
        seen["queued"] = wgrad.pending()
        return grad

    y = wgrad._DeferredWgradLinear.apply(x, w)
    x.register_hook(probe)
    (y.sin().sum()).backward()
    assert seen == {"weight_grad_during_backward": None, "queued": 1}  # deferred...
    assert wgrad.pending() == 0  # ...and flushed when the backward ended

    x2 = x.detach().clone().requires_grad_(True)
    w2 = w.detach().clone().requires_grad_(True)
    torch.matmul(x2, w2.t()).sin().sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_work_of_a_backward_that_raised_is_dropped():
    """A backward that fails after queuing leaves work behind (its end callback never ran); the
    next backward must not add that stale gradient to its own."""
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(6, 8))

    def fail(grad):  # x's gradient comes after the linear's backward queued its weight gradient
        raise RuntimeError("boom")

    handle = x.register_hook(fail)
    try:
        wgrad._DeferredWgradLinear.apply(x, w).sum().backward()
    except RuntimeError as e:
        assert "boom" in str(e)
    assert wgrad.pending() == 1 and w.grad is None
    handle.remove()
    wgrad._DeferredWgradLinear.apply(x, w).sum().backward()
    assert wgrad.pending() == 0
    assert torch.equal(w.grad, torch.ones(4, 6).t().matmul(x.detach()))  # once, not twice


def test_deferred_gradient_accumulates_into_main_grad():
    """With megatron-core DDP the gradient goes to ``main_grad`` (as DDP's hook would add it)."""
    x = torch.randn(4, 8)
    w = torch.nn.Parameter(torch.randn(6, 8))
    w.main_grad = torch.ones(6, 8)
    out = wgrad._DeferredWgradLinear.apply(x.requires_grad_(True), w)
    out.sum().backward()
    assert w.grad is None
    assert torch.equal(w.main_grad, 1 + torch.ones(6).unsqueeze(1) * x.sum(0))


def _grads_and_queue(rank, world, defer, grouped):
    from moe_variants.common.moe_layer import moe_layers

    cfg = tiny_model_config(farskip="all", farskip_impl="overlapped", farskip_defer_wgrad=defer, num_layers=2,
                            moe_layer_freq=1, moe_grouped_gemm=grouped)
    model, _ = build_and_load(cfg, ParallelConfig(expert_model_parallel_size=world))
    if grouped:  # one GroupedExperts module per layer
        deferring = [layer.experts for layer in moe_layers(model)]
    else:
        deferring = [lin for layer in moe_layers(model) for e in layer.experts.local_experts
                     for lin in (e.linear_fc1, e.linear_fc2)]
    switched = sum(wgrad.is_deferred(m) for m in deferring + [model.output_layer])
    if defer:  # wrapping is idempotent: a second pass switches nothing
        assert sum(wgrad.defer_expert_wgrad(layer) for layer in moe_layers(model)) == 0
        assert not wgrad.defer_wgrad(model.output_layer)
    ran_in_windows = []
    original = wgrad.run_while

    def counting_run_while(busy):
        before = wgrad.pending()
        original(busy)
        ran_in_windows.append(before - wgrad.pending())

    wgrad.run_while = counting_run_while
    try:
        tokens, labels = batch(rank)
        forward_loss(model, tokens, labels).sum().backward()
    finally:
        wgrad.run_while = original
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return switched, sum(ran_in_windows), wgrad.pending(), grads


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
def test_overlapped_farskip_defers_expert_wgrad_with_identical_gradients(grouped):
    """EP=2: every expert module (the grouped experts, or each local expert linear of the loop) and
    the output layer is switched, the queue is empty after the backward, and the gradients equal
    the eager ones bit for bit. (Whether a task runs inside a window or at the final flush depends
    on timing, so only the total is pinned, not the split.)"""
    deferred = run_distributed(_grads_and_queue, 2, True, grouped)
    eager = run_distributed(_grads_and_queue, 2, False, grouped)
    # 2 MoE layers x (one grouped module | 2 local experts (4 on EP=2) x fc1/fc2), + the output layer
    expected = 2 * 1 + 1 if grouped else 2 * 2 * 2 + 1
    for (switched, _, left, grads), (eager_switched, eager_ran, _, eager_grads) in zip(deferred, eager):
        assert switched == expected
        assert eager_switched == 0 and eager_ran == 0
        assert left == 0
        assert grads.keys() == eager_grads.keys()
        for name in grads:
            assert torch.equal(grads[name], eager_grads[name]), name


def _train_with_overlap(rank, world, overlap_grad_reduce):
    import itertools
    import logging

    from megatron.components.config import TrainingConfig
    from megatron.components.parallel import initialize_parallel
    from megatron.training.step import setup_model_and_optimizer, train_step
    from tests.helpers import VOCAB

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("megatron.training").addHandler(handler)
    parallel = ParallelConfig(expert_model_parallel_size=world)
    model_cfg = tiny_model_config(farskip="all", farskip_impl="overlapped", num_layers=2, moe_layer_freq=1)
    train_cfg = TrainingConfig(micro_batch_size=2, global_batch_size=4 * world, train_iters=3, lr=1e-2,
                               overlap_grad_reduce=overlap_grad_reduce)
    pgc = initialize_parallel(parallel, seed=3)
    chunks, optimizer, scheduler = setup_model_and_optimizer(model_cfg, parallel, train_cfg, vocab_size=VOCAB,
                                                             pg_collection=pgc)
    deferred = sum(wgrad.is_deferred(m) for m in chunks[0].modules())
    micro = []
    for i in range(2):
        tokens, labels = batch(10 * rank + i)
        micro.append({"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(tokens, dtype=torch.float),
                      "position_ids": torch.arange(tokens.shape[1])[None].expand_as(tokens)})
    losses = []
    for _ in range(3):
        m = train_step(chunks, optimizer, scheduler, itertools.cycle(micro), model_cfg=model_cfg,
                       train_cfg=train_cfg, num_microbatches=2, pg_collection=pgc)
        losses.append(m.lm_loss)
    return deferred, losses, [msg for msg in messages if "overlap-grad-reduce" in msg]


def test_overlap_grad_reduce_turns_the_deferral_off_with_a_warning():
    """megatron-core DDP's overlapped gradient reduction (its backward hooks launch each bucket as
    soon as its parameters' gradients are in) cannot wait for deferred weight gradients, so the
    deferral is switched off, with one warning, and training follows the deferred run (the same
    gradients, reduced in buckets instead of at the end: fp32 sums may reorder, rel 1e-5)."""
    overlapped = run_distributed(_train_with_overlap, 2, True, timeout_s=240)
    deferred = run_distributed(_train_with_overlap, 2, False, timeout_s=240)
    for (n_on, losses_on, warn_on), (n_off, losses_off, warn_off) in zip(overlapped, deferred):
        assert n_on == 0 and n_off == 2 * 1 + 1  # 2 layers' grouped experts + the output layer
        assert len(warn_on) == 1 and warn_off == []
        assert losses_on == pytest.approx(losses_off, rel=1e-5)
