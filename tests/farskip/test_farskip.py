"""FarSkip-Collective: the overlapped execution equals the simple reference, and the machinery
(split attention, asynchronous collectives, backward reordering, checkpoints) does what it claims.

Tolerances: the forward of ``overlapped`` is bit-identical to ``simple`` (same operations, same
addition order A_k = residual + shared, o_k = A_k + routed). Gradients are compared at atol 2e-6:
the reordered backward accumulates some gradients (e.g. of the embedding, reached through both
streams) in a different order, which moves fp32 sums by a few ulps.
"""

import pytest
import torch

from moe_variants.config import ParallelConfig
from tools.spawn import run_distributed
from moe_variants.farskip.config import FarSkipConfig, LayerSelection
from tests.helpers import batch, build_and_load, forward_loss, tiny_model_config


def _loss_and_grads(rank, world, cfg, ep):
    model, _ = build_and_load(cfg, ParallelConfig(expert_model_parallel_size=ep))
    tokens, labels = batch(rank)
    loss = forward_loss(model, tokens, labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# multi-latent attention (DeepSeek-V2/V3): latent projections, decoupled RoPE heads, latent norms
MLA = dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
           qk_layernorm=True)

CASES = [
    dict(farskip="all"),
    dict(farskip="all", **MLA),
    dict(farskip="all", q_lora_rank=16, **MLA),
    dict(farskip="all", moe_layer_freq=[0, 1], **MLA),  # DeepSeek's dense first layer
    dict(farskip="all", moe_shared_expert_intermediate_size=None),
    dict(farskip="first:1", num_layers=3),
    dict(farskip="last:2", num_layers=3, moe_layer_freq=[0, 1, 1]),
    dict(farskip="last:1"),  # reference connectivity: layer 0 is the range's lead-in
    dict(farskip="all", moe_layer_freq=[0, 1]),  # a dense layer inside the FarSkip range
    dict(farskip="all", moe_variant="bigmac", bigmac_ratio=0.25),
    dict(farskip="all", farskip_mode="attn-only"),
    dict(farskip="all", farskip_mode="mlp-only"),
]


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_overlapped_equals_simple(case, ep):
    simple = run_distributed(_loss_and_grads, 2, tiny_model_config(farskip_impl="simple", **case), ep)
    overlapped = run_distributed(_loss_and_grads, 2, tiny_model_config(farskip_impl="overlapped", **case), ep)
    for rank in range(2):
        assert torch.equal(simple[rank][0], overlapped[rank][0])
        for name, grad in simple[rank][1].items():
            torch.testing.assert_close(overlapped[rank][1][name], grad, rtol=1e-5, atol=2e-6, msg=name)


def test_farskip_changes_the_function_but_not_the_parameters():
    std = run_distributed(_loss_and_grads, 1, tiny_model_config(), 1)[0]
    far = run_distributed(_loss_and_grads, 1, tiny_model_config(farskip="all"), 1)[0]
    none = run_distributed(_loss_and_grads, 1, tiny_model_config(farskip="none"), 1)[0]
    assert std[1].keys() == far[1].keys()
    assert all(std[1][k].shape == far[1][k].shape for k in std[1])
    assert not torch.equal(std[0], far[0])  # same weights (same seed), different connectivity
    assert torch.equal(std[0], none[0])


def test_layer_selection():
    assert LayerSelection.parse("none").indices(4) == frozenset()
    assert LayerSelection.parse("all").indices(4) == {0, 1, 2, 3}
    assert LayerSelection.parse("first:2").indices(4) == {0, 1}
    assert LayerSelection.parse("last:1").indices(4) == {3}
    assert LayerSelection.parse("1-2").indices(4) == {1, 2}
    for bad in ("last:5", "3-1", "half", "first:0"):
        with pytest.raises(ValueError, match="--farskip"):
            LayerSelection.parse(bad).indices(4)


def test_lead_in_layer():
    """With ``reference`` connectivity the standard MoE layer right before the range hands it two
    streams; there is none for a range from layer 0 or right after a dense layer, in ``mlp-only``
    mode (its attention reads the full stream) or with ``paper-text``."""
    def lead_in(selection, pattern, **kw):
        return FarSkipConfig(farskip=selection, **kw).lead_in_layer(pattern)

    assert lead_in("last:2", [1, 1, 1, 1]) == 1
    assert lead_in("last:2", [1, 1, 1, 1], farskip_mode="attn-only") == 1
    assert lead_in("2-2", [0, 1, 1, 1]) == 1
    for selection, pattern, kw in [("1-2", [0, 0, 1, 1], {}), ("first:2", [1, 1, 1, 1], {}), ("all", [0, 1, 1, 1], {}),
                                   ("none", [1, 1, 1, 1], {}), ("last:2", [1, 1, 1, 1], {"farskip_mode": "mlp-only"}),
                                   ("last:2", [1, 1, 1, 1], {"farskip_connectivity": "paper-text"})]:
        assert lead_in(selection, pattern, **kw) is None, (selection, pattern, kw)


def test_stored_configs_keep_their_connectivity():
    """A stored config with FarSkip layers written before ``--farskip-connectivity`` existed loads as
    ``paper-text``, the wiring it was trained with; one without FarSkip layers gets the default
    ``reference`` (a standard teacher converted later takes today's wiring); a stored value stays."""
    from moe_variants.config import ModelConfig

    def connectivity(dump):
        return FarSkipConfig.of(ModelConfig.from_dump(dump)).farskip_connectivity.value

    assert FarSkipConfig().farskip_connectivity.value == "reference"
    assert connectivity({"model": {"farskip": "last:1"}}) == "paper-text"  # before the variant registry
    assert connectivity({"model": {}, "farskip": {"farskip": "last:1"}}) == "paper-text"
    assert connectivity({"model": {}, "farskip": {"farskip": "none"}}) == "reference"
    assert connectivity({"model": {}, "farskip": {"farskip": "last:1", "farskip_connectivity": "reference"}}) == "reference"
    assert connectivity(tiny_model_config(farskip="last:1", farskip_connectivity="paper-text").dump()) == "paper-text"


def test_lead_in_layer_on_the_previous_pipeline_stage_is_refused():
    """Only one residual stream crosses a pipeline stage: a range whose lead-in layer sits on the
    previous stage is refused (with ``paper-text`` it is not)."""
    from types import SimpleNamespace

    from moe_variants.farskip.block import check_farskip_supported

    config = SimpleNamespace(recompute_granularity=None, cuda_graph_impl="none", overlap_moe_expert_parallel_comm=False,
                             fp8=None, fp4=None, cpu_offloading=False)
    check_farskip_supported(config, {2, 3}, 2, 4, lead_in=None)
    with pytest.raises(ValueError, match="layer 2 starts a pipeline stage.*hands it two streams"):
        check_farskip_supported(config, {2, 3}, 2, 4, lead_in=1)


def _split_vs_whole(rank, world, overrides):
    from moe_variants.builder import causal_attention_mask
    from moe_variants.farskip.attention import (
        attention_out,
        attention_proj,
        attention_qkv,
        can_split,
        core_attention_rows,
    )

    model, _ = build_and_load(tiny_model_config(**overrides), ParallelConfig())
    attn = model.decoder.layers[0].self_attention
    assert can_split(attn)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(1))
    rope = None if overrides else model.rotary_pos_emb(16)  # MLA computes its own rotary embedding
    mask = causal_attention_mask(16)
    whole, _ = attn(x, attention_mask=mask, rotary_pos_emb=rope)
    qkv = attention_qkv(attn, x, rope)
    split, _ = attention_out(attn, *qkv, mask)
    halves, _ = attention_proj(attn, [core_attention_rows(attn, *qkv, mask, 0, 1),
                                      core_attention_rows(attn, *qkv, mask, 1, 2)])
    return torch.equal(whole, split), torch.equal(whole, halves)


@pytest.mark.parametrize("overrides", [{}, MLA, dict(q_lora_rank=16, **MLA)], ids=["self-attention", "mla", "mla-q-lora"])
def test_split_attention_is_bit_identical_to_megatron_core(overrides):
    """Self-attention and multi-latent attention run in stages (projections, then core attention,
    whole or by halves of the micro-batch, then the output projection) equal the upstream module."""
    assert run_distributed(_split_vs_whole, 1, overrides)[0] == (True, True)


def _backward_order(rank, world, reorder):
    from moe_variants.common.moe_layer import moe_layers
    from moe_variants.common import comm

    if not reorder:  # this rank process only: the priorities are not set, autograd's own order runs
        comm.set_tensor_grad_fn_sequence_sr = lambda tensor, sequence_nr: None
    cfg = tiny_model_config(farskip="all", farskip_impl="overlapped", num_layers=2, moe_layer_freq=1)
    model, _ = build_and_load(cfg, ParallelConfig(expert_model_parallel_size=2))
    timeline = comm.TimelineRecorder()
    for layer in moe_layers(model):
        layer.token_dispatcher.comm.timeline = timeline
    tokens, labels = batch(rank)
    loss = forward_loss(model, tokens, labels)
    timeline.events.clear()  # keep the backward only
    loss.sum().backward()

    def triples(kind, marker):
        def starts(pred):
            return sorted(e[2] for e in timeline.events if pred(e))

        launches = starts(lambda e: e[1] == "comm" and e[0] == f"{kind} bwd")
        waits = starts(lambda e: e[1] == "wait" and e[0] == f"wait {kind} bwd")
        marks = starts(lambda e: e[0].startswith(marker))
        return list(zip(launches, marks, waits))

    return triples("dispatch", "qkv bwd"), triples("combine", "attention bwd")


def test_backward_reordering_moves_attention_between_launch_and_wait():
    """With the sequence numbers, each layer's attention backward is split over its two gradient
    all-to-alls (paper Fig. 10): the output projection and core attention run after the combine's
    gradient all-to-all is launched and before the hook waits for it, the QKV projection likewise
    inside the dispatch's. Without them autograd's default order waits first (the consumers of
    the collectives were created later in the forward, so they run earlier)."""
    for dispatch, combine in run_distributed(_backward_order, 2, True):
        for triples in (dispatch, combine):
            assert len(triples) == 2 and all(launch < mark < wait for launch, mark, wait in triples), triples
    for dispatch, combine in run_distributed(_backward_order, 2, False):
        for triples in (dispatch, combine):
            assert len(triples) == 2 and all(not (launch < mark < wait) for launch, mark, wait in triples), triples


def _collective_order(rank, world):
    from moe_variants.common.moe_layer import moe_layers
    from moe_variants.common import comm

    cfg = tiny_model_config(farskip="all", farskip_impl="overlapped", num_layers=3, moe_layer_freq=1)
    model, _ = build_and_load(cfg, ParallelConfig(expert_model_parallel_size=2))
    timeline = comm.TimelineRecorder()
    for layer in moe_layers(model):
        layer.token_dispatcher.comm.timeline = timeline
    tokens, labels = batch(rank)
    forward_loss(model, tokens, labels).sum().backward()
    return [name for name, lane, start, _ in sorted(timeline.events, key=lambda e: e[2]) if lane == "comm"]


def test_collective_order_is_identical_on_every_rank():
    """Every rank issues its collectives in the same order (a mismatch deadlocks; the harness
    timeout turns that into a failure rather than a hang)."""
    orders = run_distributed(_collective_order, 2, timeout_s=120)
    assert orders[0] == orders[1] and len(orders[0]) >= 12


def _ep1_no_collectives(rank, world):
    from moe_variants.common.moe_layer import comm_counters

    cfg = tiny_model_config(farskip="all", farskip_impl="overlapped")
    model, _ = build_and_load(cfg, ParallelConfig(expert_model_parallel_size=1))
    tokens, labels = batch(0)
    forward_loss(model, tokens, labels).sum().backward()
    return sum(c.calls for c in comm_counters([model]))


def test_ep1_issues_no_collectives():
    assert run_distributed(_ep1_no_collectives, 1) == [0]


def _build_refused(rank, world, overrides):
    build_and_load(tiny_model_config(**{"farskip": "all", **overrides}), ParallelConfig())


@pytest.mark.parametrize("overrides,needle", [
    (dict(farskip_impl="overlapped", moe_token_dispatcher_type="allgather"), "alltoall"),
    (dict(farskip="first:9"), "--farskip first:9"),
])
def test_unsupported_combinations_are_refused(overrides, needle):
    from tools.spawn import DistributedTestError

    with pytest.raises(DistributedTestError, match=needle):
        run_distributed(_build_refused, 1, overrides)
