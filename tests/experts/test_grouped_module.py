"""``GroupedExperts`` on one rank: the path choice, the flag, state-dict keys, the autograd edges.

Each test body runs in a forked one-rank world (``run_distributed(fn, 1)``): megatron-core's
process groups are never created in the test process itself, whose later forks would otherwise
inherit them half torn down.

Tolerances: exact throughout (fp32 on the CPU, where torch's grouped_mm runs each expert's GEMM
with the operands of the per-expert matmul it is compared with), except the references written
out with ``torch.matmul`` per expert, whose fused SwiGLU products may round differently: 1e-6.
"""

import copy
import functools

import pytest
import torch

from moe_variants.config import ParallelConfig
from tests.helpers import batch, build_and_load, forward_loss, tiny_model_config
from tools.spawn import run_distributed


def one_rank(test):
    """Run ``test`` in a forked world of one gloo rank."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        run_distributed(lambda rank, world: test(*args, **kwargs), 1, timeout_s=120)

    return run


def _model(seed=7, **overrides):
    return build_and_load(tiny_model_config(moe_layer_freq=[0, 1], **overrides), ParallelConfig(), seed=seed)


def _experts(model):
    from moe_variants.common.moe_layer import moe_layers

    return moe_layers(model)[0].experts


@one_rank
def test_default_is_grouped_and_the_flag_selects_the_loop():
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron.components.arguments import parse_configs
    from moe_variants.common.experts import GroupedExperts, describe

    assert parse_configs([]).model.moe_grouped_gemm is True
    assert parse_configs(["--no-moe-grouped-gemm"]).model.moe_grouped_gemm is False
    grouped, _ = _model()
    assert isinstance(_experts(grouped), GroupedExperts)
    assert describe(grouped) == "grouped GEMM (torch grouped_mm, torch.float32 on cpu)"
    loop, _ = _model(moe_grouped_gemm=False)
    assert type(_experts(loop)) is SequentialMLP
    assert describe(loop) == "SequentialMLP loop (--no-moe-grouped-gemm)"


@one_rank
def test_unaligned_widths_fall_back_to_the_loop_with_the_reason():
    """An expert FFN of 30 fp32 values (120 bytes) breaks grouped_mm's 16-byte stride rule."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from moe_variants.common.experts import describe

    model, _ = _model(moe_ffn_hidden_size=30)
    assert type(_experts(model)) is SequentialMLP
    assert describe(model) == ("SequentialMLP loop (the expert FFN width per expert-TP rank 30 x 4 bytes is "
                               "not a multiple of 16 bytes (grouped_mm's stride rule))")
    forward_loss(model, *batch(0)).sum().backward()  # the fallback trains


@one_rank
def test_bigmac_latent_experts_take_the_grouped_path_or_the_latent_loop():
    from moe_variants.bigmac.layer import LatentSequentialMLP
    from moe_variants.common.experts import GroupedExperts

    grouped = _experts(_model(moe_variant="bigmac")[0])
    assert isinstance(grouped, GroupedExperts) and grouped.probs_on_output
    assert grouped.fc1_weight.shape[2] == grouped.input_size < 32  # the latent width
    loop = _experts(_model(moe_variant="bigmac", moe_grouped_gemm=False)[0])
    assert type(loop) is LatentSequentialMLP


@one_rank
def test_state_dict_keys_are_sequential_mlps_and_load_both_ways():
    grouped, _ = _model()
    loop, _ = _model(moe_grouped_gemm=False, seed=11)  # other weights
    assert list(grouped.state_dict()) == list(loop.state_dict())
    loop.load_state_dict(grouped.state_dict(), strict=True)
    for (name, a), b in zip(grouped.state_dict().items(), loop.state_dict().values()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name
    fresh, _ = _model(seed=12)
    fresh.load_state_dict(loop.state_dict(), strict=True)
    assert torch.equal(forward_loss(fresh, *batch(1)), forward_loss(loop, *batch(1)))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*local_experts\.3\.linear_fc2\.weight"):
        fresh.load_state_dict({k: v for k, v in loop.state_dict().items() if "local_experts.3.linear_fc2.weight" not in k})


@one_rank
def test_sharded_state_dict_has_sequential_mlps_keys_and_global_shapes():
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    def stored(model):
        out = {}
        for value in nested_values(model.sharded_state_dict()):
            parts = value.build() if isinstance(value, ShardedTensorFactory) else [value]
            for part in parts:
                if isinstance(part, (ShardedTensor, ShardedObject)):
                    out.setdefault(part.key, []).append(part)
        return out

    grouped, loop = stored(_model()[0]), stored(_model(moe_grouped_gemm=False)[0])
    assert grouped.keys() == loop.keys()
    for key in loop:
        assert {tuple(p.global_shape) for p in grouped[key]} == {tuple(p.global_shape) for p in loop[key]}, key
    # the grouped chunks cover exactly the loop's: every element once
    fc1 = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"
    covered = torch.zeros(loop[fc1][0].global_shape, dtype=torch.int)
    for part in grouped[fc1]:
        index = tuple(slice(o, o + n) for o, n in zip(part.global_offset, part.local_shape))
        covered[index] += 1
    assert torch.equal(covered, torch.ones_like(covered))


def _layer_inputs(experts, counts, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), experts.input_size, generator=gen, requires_grad=True)
    probs = torch.rand(sum(counts), generator=gen, requires_grad=True)
    return x, torch.tensor(counts), probs


def _reference(experts, x, counts, probs):
    """Each expert's MLP written out with matmuls (SwiGLU, probabilities on the activation)."""
    outs = []
    for e, (xe, pe) in enumerate(zip(x.split(counts), probs.split(counts))):
        gate, up = torch.chunk(xe @ experts.fc1_weight[e].t(), 2, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up * pe[:, None]) @ experts.fc2_weight[e].t())
    return torch.cat(outs)


@one_rank
def test_empty_experts_and_a_broadcast_gradient():
    """Experts with no tokens get zero gradients; ``y.sum().backward()`` (a zero-stride gradient,
    which the kernels reject as such) works."""
    experts = _experts(_model()[0])
    counts = [3, 0, 5, 0]
    x, tokens_per_expert, probs = _layer_inputs(experts, counts)
    out, bias = experts(x, tokens_per_expert, probs)
    assert bias is None
    out.sum().backward()
    grads = [p.grad.clone() for p in (x, probs, experts.fc1_weight, experts.fc2_weight)]
    for t in (x, probs, experts.fc1_weight, experts.fc2_weight):
        t.grad = None
    ref = _reference(experts, x, counts, probs)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    ref.sum().backward()
    for got, want in zip(grads, (x.grad, probs.grad, experts.fc1_weight.grad, experts.fc2_weight.grad)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not grads[2][1].any() and not grads[2][3].any() and not grads[3][1].any()


@one_rank
def test_gradient_accumulation_fusion_adds_into_main_grad():
    """megatron-core's fused accumulation semantics: the weight gradient goes into ``main_grad`` and
    DDP is told (``grad_added_to_main_grad``) through a placeholder gradient."""
    experts = _experts(_model()[0])
    counts = [2, 3, 1, 2]
    x, tokens_per_expert, probs = _layer_inputs(experts, counts, seed=1)
    expected = {}
    out, _ = experts(x, tokens_per_expert, probs)
    out.square().sum().backward()
    for p in (experts.fc1_weight, experts.fc2_weight):
        expected[id(p)] = p.grad.clone() + 1
        p.grad = None
        p.main_grad = torch.ones_like(p)
        p.grad_added_to_main_grad = False
    experts.config = copy.copy(experts.config)
    experts.config.gradient_accumulation_fusion = True
    out, _ = experts(x, tokens_per_expert, probs)
    out.square().sum().backward()
    for p in (experts.fc1_weight, experts.fc2_weight):
        assert p.grad_added_to_main_grad
        assert torch.equal(p.main_grad, expected[id(p)])


MODES = ("eager", "deferred", "main_grad")


def _run_mode(experts, counts, mode, seed=2):
    """Forward and backward of ``experts`` on ``counts`` rows per expert with its weight gradients
    computed ``mode``'s way: in the backward (``.grad``), deferred (``wgrad``: queued, run when the
    backward ends) or accumulated into megatron-core DDP's ``main_grad``. Returns the output and the
    gradients of the input, the probabilities and both stacked weights."""
    weights = (experts.fc1_weight, experts.fc2_weight)
    for p in weights:
        p.grad = None
        p.main_grad = torch.zeros_like(p) if mode == "main_grad" else None
        p.grad_added_to_main_grad = False
    experts.defer_wgrad = mode == "deferred"
    experts.config = copy.copy(experts.config)
    experts.config.gradient_accumulation_fusion = mode == "main_grad"
    x, tokens_per_expert, probs = _layer_inputs(experts, counts, seed)
    out, _ = experts(x, tokens_per_expert, probs)
    out.square().sum().backward()
    grads = [p.main_grad if mode == "main_grad" else p.grad for p in weights]
    return (out.detach(), x.grad, probs.grad, *grads)


def _edge_kernel(grouped_mm):
    """``grouped_mm`` as some GPUs' kernels behave at the edges: a weight-gradient group of an expert
    with no rows is left unwritten (NaN here; non-zero values on B200s, pytorch/pytorch#172439), and a
    call with no rows at all is refused."""

    def edge(a, b, offs=None, **kwargs):
        rows = a.shape[1] if b.dim() == 2 else a.shape[0]  # wgrad's rows are its contraction
        if rows == 0:
            raise RuntimeError("grouped_mm: no rows (emulated refusal)")
        out = grouped_mm(a, b, offs=offs, **kwargs)
        if out.dim() == 3:  # a weight gradient [E, out, in]
            out[torch.diff(offs, prepend=offs.new_zeros(1)) == 0] = float("nan")
        return out

    return edge


@one_rank
def test_empty_experts_get_exactly_zero_weight_gradients_whatever_the_kernel_leaves():
    """Counts [3, 0, 5, 0] under a kernel that leaves empty experts' weight-gradient groups
    unwritten (``_edge_kernel``): in each of the three weight-gradient modes the empty experts'
    gradients are exactly 0 and everything else equals the plain kernel's results exactly (the
    guard only overwrites empty groups)."""
    experts = _experts(_model()[0])
    counts = [3, 0, 5, 0]
    plain = {mode: _run_mode(experts, counts, mode) for mode in MODES}
    grouped_mm = torch.nn.functional.grouped_mm
    torch.nn.functional.grouped_mm = _edge_kernel(grouped_mm)
    try:
        for mode in MODES:
            got = _run_mode(experts, counts, mode)
            for name, a, b in zip(("output", "x grad", "probs grad", "fc1 grad", "fc2 grad"), got, plain[mode]):
                assert torch.equal(a, b), (mode, name)
            for grad in got[3:]:
                assert torch.equal(grad[[1, 3]], torch.zeros_like(grad[[1, 3]])), mode
                assert grad[[0, 2]].abs().sum() > 0, mode
    finally:
        torch.nn.functional.grouped_mm = grouped_mm


@one_rank
def test_no_tokens_at_all_calls_no_kernel():
    """N = 0 (every count 0, e.g. an EP rank that received no tokens) under a kernel that refuses
    a problem with no rows: the forward gives [0, H], the input and probability gradients are
    empty, and every weight gradient is exactly 0 in each of the three modes."""
    experts = _experts(_model()[0])
    grouped_mm = torch.nn.functional.grouped_mm
    torch.nn.functional.grouped_mm = _edge_kernel(grouped_mm)
    try:
        for mode in MODES:
            out, x_grad, probs_grad, fc1_grad, fc2_grad = _run_mode(experts, [0, 0, 0, 0], mode)
            assert out.shape == x_grad.shape == (0, experts.input_size) and probs_grad.shape == (0,), mode
            for grad, param in ((fc1_grad, experts.fc1_weight), (fc2_grad, experts.fc2_weight)):
                assert torch.equal(grad, torch.zeros_like(param)), mode
    finally:
        torch.nn.functional.grouped_mm = grouped_mm
