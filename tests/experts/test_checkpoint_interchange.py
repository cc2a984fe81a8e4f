"""Checkpoints move between the grouped experts and the SequentialMLP loop, both ways.

A training run on one expert path saves a dist-checkpoint (``checkpointing.save_checkpoint``, the
trainer's format, with the optimizer and scheduler) at EP = 2 on 2 gloo ranks; a run on the other
path loads it at the same layout, so the optimizer state loads too. The loaded model gives the
saver's logits, and the next training step gives the loss and the parameters the saver's own next
step gives: the weights and the optimizer state (Adam moments, fp32 main parameters; the
distributed optimizer's fully reshardable format or the plain one) were restored. The grouped
module's sharded state dict has ``SequentialMLP``'s keys and global shapes, chunked per rank
instead of per expert, and the loader reshards. The same holds at expert tensor parallelism 2
(each expert's FFN split over the 2 ranks) with SwiGLU experts (fc1's gate and up halves stored
apart) and with non-gated GeLU experts.

Tolerance: exact. Both paths compute the same fp32 arithmetic on the CPU
(``test_grouped_equivalence``), and a checkpoint restores bits.
"""

import pytest
import torch

from tools.spawn import run_distributed


# name: (ParallelConfig fields, model overrides, training overrides). At ETP = 2 gradient clipping
# is off: its norm sums fp32 squares per parameter (one stacked tensor of 4 experts, or 4), whose
# different association moves the norm by an ulp, so the next step would differ by ~1e-7
LAYOUTS = {
    "ep2": ({"expert_model_parallel_size": 2}, {}, {}),
    "etp2": ({"expert_tensor_parallel_size": 2}, {}, {"clip_grad": 0.0}),
    "etp2-gelu": ({"expert_tensor_parallel_size": 2}, {"swiglu": False}, {"clip_grad": 0.0}),
}


def _setup(grouped: bool, distributed_optimizer: bool, layout: str = "ep2"):
    from megatron.components.checkpointing import layout_of
    from megatron.components.config import TrainingConfig
    from megatron.components.parallel import initialize_parallel
    from megatron.training.step import setup_model_and_optimizer
    from moe_variants.config import ParallelConfig
    from tests.helpers import VOCAB, tiny_model_config

    parallel_fields, overrides, training = LAYOUTS[layout]
    parallel = ParallelConfig(**parallel_fields)
    model_cfg = tiny_model_config(moe_grouped_gemm=grouped, **overrides)
    if distributed_optimizer:  # its norm sums each rank's shard of a flat buffer the two paths lay out apart
        training = {"clip_grad": 0.0, **training}
    train_cfg = TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=10, lr=1e-2, lr_warmup_iters=1,
                               use_distributed_optimizer=distributed_optimizer, **training)
    pgc = initialize_parallel(parallel, seed=3)
    chunks, optimizer, scheduler = setup_model_and_optimizer(model_cfg, parallel, train_cfg, vocab_size=VOCAB,
                                                             pg_collection=pgc)
    return model_cfg, train_cfg, pgc, chunks, optimizer, scheduler, layout_of(parallel, train_cfg, 2)


def _step(run, rank):
    import itertools

    from megatron.training.step import train_step
    from tests.helpers import batch

    model_cfg, train_cfg, pgc, chunks, optimizer, scheduler, _ = run
    tokens, labels = batch(rank)
    micro = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(tokens, dtype=torch.float),
             "position_ids": torch.arange(tokens.shape[1])[None].expand_as(tokens)}
    return train_step(chunks, optimizer, scheduler, itertools.repeat(micro), model_cfg=model_cfg,
                      train_cfg=train_cfg, num_microbatches=1, pg_collection=pgc).lm_loss


def _logits_and_weights(run, rank):
    from megatron.core.utils import unwrap_model

    from moe_variants.global_state import gather_global_state_dict
    from tests.helpers import batch, forward_loss

    model = unwrap_model(run[3][0])
    tokens, labels = batch(100 + rank)
    with torch.no_grad():
        loss = forward_loss(model, tokens, labels)
    return loss, gather_global_state_dict(model, run[2])


def _rank(rank, world, save_dir, saver_grouped, distributed_optimizer, layout="ep2"):
    import megatron.components.checkpointing as ck

    from moe_variants.common.experts import GroupedExperts

    saver = _setup(saver_grouped, distributed_optimizer, layout)
    _step(saver, rank)
    _step(saver, rank)
    ck.save_checkpoint(save_dir, 2, saver[3], saver[4], saver[5], consumed_samples=8, layout=saver[6],
                       configs={"model": {}})
    saved = _logits_and_weights(saver, rank)
    saver_next = _step(saver, rank), _logits_and_weights(saver, rank)

    loader = _setup(not saver_grouped, distributed_optimizer, layout)
    grouped = [isinstance(m, GroupedExperts) for m in loader[3][0].modules()]
    assert any(grouped) == (not saver_grouped)
    loaded = ck.load_checkpoint(save_dir, loader[3], loader[4], loader[5], layout=loader[6])
    assert loaded.optimizer_loaded
    restored = _logits_and_weights(loader, rank)
    loader_next = _step(loader, rank), _logits_and_weights(loader, rank)
    return saved, restored, saver_next, loader_next


def _assert_same(got, ref, what):
    (loss, weights), (ref_loss, ref_weights) = got, ref
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0, msg=lambda m: f"{what} logits' loss: {m}")
    assert weights.keys() == ref_weights.keys()
    for key in weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=0, atol=0, msg=lambda m: f"{what} {key}: {m}")


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "distributed-optimizer"])
@pytest.mark.parametrize("saver_grouped", [False, True], ids=["loop-to-grouped", "grouped-to-loop"])
def test_checkpoint_loads_in_the_other_expert_path(tmp_path, saver_grouped, distributed_optimizer):
    """Weights, optimizer state and the next step carry over exactly; with the distributed optimizer
    too (its reload raised ``KeyError: 'step'`` before ``compat._fix_distributed_optimizer_step``)."""
    results = run_distributed(_rank, 2, str(tmp_path), saver_grouped, distributed_optimizer, timeout_s=300)
    for saved, restored, (saver_loss, saver_after), (loader_loss, loader_after) in results:
        _assert_same(restored, saved, "restored")
        assert loader_loss == saver_loss
        _assert_same(loader_after, saver_after, "after one more step")


@pytest.mark.parametrize("layout,saver_grouped", [("etp2", False), ("etp2-gelu", True)],
                         ids=["loop-to-grouped-etp2", "grouped-to-loop-etp2-gelu"])
def test_checkpoint_loads_in_the_other_expert_path_at_expert_tensor_parallel_2(tmp_path, saver_grouped, layout):
    """ETP = 2 (TP = EP = 1) on 2 ranks: each rank's half of every expert's FFN is stored at its
    place in the global tensors and the other path loads it; logits, weights and the next step
    carry over exactly. SwiGLU is loaded into the grouped path (its gate/up chunks built and merged
    back), GeLU saved from it (its fc1 rows chunked per rank); the other directions run the same
    code."""
    results = run_distributed(_rank, 2, str(tmp_path), saver_grouped, False, layout, timeout_s=300)
    for saved, restored, (saver_loss, saver_after), (loader_loss, loader_after) in results:
        _assert_same(restored, saved, "restored")
        assert loader_loss == saver_loss
        _assert_same(loader_after, saver_after, "after one more step")


def _save_with_distributed_optimizer(rank, world, save_dir, grouped):
    import megatron.components.checkpointing as ck

    run = _setup(grouped, True)
    _step(run, rank)
    _step(run, rank)
    return ck.save_checkpoint(save_dir, 2, run[3], run[4], run[5], consumed_samples=8, layout=run[6],
                              configs={"model": {}})


def test_distributed_optimizer_checkpoints_of_both_paths_hold_the_same_tensors(tmp_path):
    """With megatron-core's distributed optimizer (fully reshardable format) the two paths, trained
    alike, write the same tensors under the same keys: model weights, fp32 main parameters and Adam
    moments, compared in the files (the reload is tested above)."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    paths = {grouped: run_distributed(_save_with_distributed_optimizer, 2, str(tmp_path / str(grouped)), grouped,
                                      timeout_s=300)[0]
             for grouped in (False, True)}
    # read in a forked one-rank world: no process group is ever created in the test process
    [(loop, grouped)] = run_distributed(lambda rank, world: (load_plain_tensors(paths[False]),
                                                             load_plain_tensors(paths[True])), 1)
    assert loop.keys() == grouped.keys()
    assert any("optimizer.state.exp_avg." in k and k.endswith("experts.experts.linear_fc1.weight") for k in loop)
    for key in loop:
        if torch.is_tensor(loop[key]):
            torch.testing.assert_close(grouped[key], loop[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
        else:
            assert grouped[key] == loop[key], key
