"""Grouped-GEMM experts compute what the SequentialMLP loop computes, on every variant and layout.

For each variant (standard, non-gated GeLU experts, BigMac's latent experts, FarSkip with its
deferred expert weight gradients, a Sem-MoE expert placement) and EP = 1 and 2 on 2 gloo ranks: the
loop model and the grouped model, loaded with the same layout-free weights, give the same per-token
losses and the same data-parallel-summed gradients of every parameter (read per expert by
``moe_variants.global_state``, so both paths have the same names). At expert tensor parallelism 2
(each expert's FFN split over the 2 ranks) the same holds for SwiGLU and GeLU experts, and the two
paths draw the same initial weights from the same seed.

Tolerance: exact (fp32). On the CPU torch's grouped_mm runs one GEMM per expert on the same rows
with the same operands as the loop's per-expert matmuls, the activation and probability products
are the same code, and the dispatcher is shared, so the results are bit-identical (observed); a
routing, offset or weight-layout bug moves losses by 1e-2 or more.
"""

import numpy as np
import pytest
import torch

from moe_variants.config import ParallelConfig
from tests.helpers import batch, build_and_load, forward_loss, tiny_model_config
from tools.spawn import run_distributed

VARIANTS = {
    "standard": {},
    "gelu": {"swiglu": False},
    "bigmac": {"moe_variant": "bigmac"},
    "farskip": {"farskip": "all", "farskip_impl": "overlapped", "farskip_defer_wgrad": True},
    "semmoe": {},  # the standard layer with its experts placed by a permutation
}


def _placement(num_layers: int, num_experts: int) -> np.ndarray:
    """[L, N] a fixed non-trivial physical-to-logical map per MoE layer."""
    rng = np.random.default_rng(5)
    return np.stack([rng.permutation(num_experts) for _ in range(num_layers)])


def _run(rank, world, name):
    from moe_variants.common.experts import GroupedExperts
    from moe_variants.common.moe_layer import moe_layers
    from moe_variants.global_state import gather_global_grads, gather_global_state_dict
    from moe_variants.semmoe.placement import moe_layer_prefixes, permute_expert_state, permute_model_experts

    out = {}
    state = None
    for ep in (1, 2):
        for grouped in (False, True):
            cfg = tiny_model_config(moe_layer_freq=1, moe_grouped_gemm=grouped, **VARIANTS[name])
            model, pgc = build_and_load(cfg, ParallelConfig(expert_model_parallel_size=ep), state)
            experts = [layer.experts for layer in moe_layers(model)]
            assert all(isinstance(e, GroupedExperts) == grouped for e in experts), name
            if state is None:
                state = gather_global_state_dict(model, pgc)
            if name == "semmoe":
                p2l = _placement(len(experts), cfg.num_experts)
                permute_model_experts(model, pgc, p2l)
                placed = gather_global_state_dict(model, pgc)
                expected = permute_expert_state(state, moe_layer_prefixes(state), p2l)
                assert placed.keys() == expected.keys()
                for key in placed:
                    assert torch.equal(placed[key], expected[key]), (grouped, ep, key)
            tokens, labels = batch(rank)
            loss = forward_loss(model, tokens, labels)
            loss.sum().backward()
            out[(ep, grouped)] = loss.detach(), gather_global_grads(model, pgc)
    return out


def _assert_equal(loop, grouped, what: str) -> None:
    """The same per-token losses and gradients, exactly."""
    (loop_loss, loop_grads), (loss, grads) = loop, grouped
    torch.testing.assert_close(loss, loop_loss, rtol=0, atol=0, msg=lambda m: f"{what} loss: {m}")
    assert grads.keys() == loop_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], loop_grads[key], rtol=0, atol=0, msg=lambda m: f"{what} {key}: {m}")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_grouped_equals_loop(name):
    results = run_distributed(_run, 2, name, timeout_s=240)
    for rank_out in results:
        for ep in (1, 2):
            _assert_equal(rank_out[(ep, False)], rank_out[(ep, True)], f"EP={ep}")
        # the layouts agree too (gradients summed over data-parallel replicas at EP=1, EP ranks at EP=2)
        torch.testing.assert_close(rank_out[(2, True)][0], rank_out[(1, True)][0], rtol=1e-5, atol=1e-6)


def _run_etp2(rank, world):
    from moe_variants.common.experts import GroupedExperts
    from moe_variants.common.moe_layer import moe_layers
    from moe_variants.global_state import gather_global_grads, gather_global_state_dict

    parallel = ParallelConfig(expert_tensor_parallel_size=2)
    out = {}
    for name in ("standard", "gelu"):
        fresh, state = {}, None
        for grouped in (False, True):
            cfg = tiny_model_config(moe_layer_freq=1, moe_grouped_gemm=grouped, **VARIANTS[name])
            model, pgc = build_and_load(cfg, parallel)
            experts = moe_layers(model)[0].experts
            assert isinstance(experts, GroupedExperts) == grouped, name
            if grouped:  # each rank holds half of every expert's FFN
                assert experts.fc2_weight.shape[2] == cfg.moe_ffn_hidden_size // 2
            fresh[grouped] = gather_global_state_dict(model, pgc)
            state = fresh[False] if state is None else state
            model, pgc = build_and_load(cfg, parallel, state)
            tokens, labels = batch(rank)
            loss = forward_loss(model, tokens, labels)
            loss.sum().backward()
            out[(name, grouped)] = loss.detach(), gather_global_grads(model, pgc)
        out[(name, "init")] = fresh
    return out


def test_grouped_equals_loop_at_expert_tensor_parallel_2():
    """ETP = 2 on 2 ranks (TP = EP = 1): each expert's fc1 rows (SwiGLU: its gate and up halves)
    and fc2 columns are split over the ranks and the dispatcher sums the partial outputs. Exact,
    as above; the initial weights are equal too (``_initialize`` slices the same master matrix)."""
    for rank_out in run_distributed(_run_etp2, 2, timeout_s=240):
        for name in ("standard", "gelu"):
            _assert_equal(rank_out[(name, False)], rank_out[(name, True)], name)
            init = rank_out[(name, "init")]
            assert init[True].keys() == init[False].keys()
            for key in init[False]:
                assert torch.equal(init[True][key], init[False][key]), (name, key)
