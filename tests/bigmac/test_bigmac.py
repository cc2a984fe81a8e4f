"""BigMac (DCCA) layer: equivalences, upstream compatibility, communication volume and accounting."""

import pytest
import torch

from moe_variants.bigmac.config import BigMacConfig
from moe_variants.config import ParallelConfig
from tools.spawn import run_distributed
from moe_variants.bigmac.accounting import a2a_bytes_uniform, model_accounting, paper_table3
from tests.foundation.test_ep_equivalence import _assert_grads_close, _run
from tests.helpers import VOCAB, batch, build_and_load, forward_loss, tiny_model_config


def test_paper_table4_gpt3_xl():
    """GPT3-XL, 64 experts, top-8, r=0.25, EP=32, 2^19-token batch, bf16 (BigMac Table 4).

    FLOPs use the padded vocabulary 50,304 (what Megatron trains GPT-2's 50,257 with); the
    parameter count is the same at either size to the table's 3 digits.
    """
    kw = dict(h=2048, l=24, e=64, r=0.25, v=50304, tokens=2**19, s=2048, top_k=8, ep=32)
    fg, bm = paper_table3(bigmac=False, **kw), paper_table3(bigmac=True, **kw)
    assert round(fg["params"] / 1e9, 2) == 3.73 and round(bm["params"] / 1e9, 2) == 3.78
    assert round(100 * (bm["params"] / fg["params"] - 1), 2) == 1.35
    assert round(fg["flops"] / 1e12, 2) == 3490.67 and round(bm["flops"] / 1e12, 2) == 3649.00
    assert round(100 * (bm["flops"] / fg["flops"] - 1), 2) == 4.54
    assert fg["a2a_bytes"] / 2**30 == pytest.approx(1488.0) and bm["a2a_bytes"] / 2**30 == pytest.approx(372.0)


def _param_count(rank, world, cfg):
    from moe_variants.builder import padded_vocab_size

    model, _ = build_and_load(cfg, ParallelConfig())
    return sum(p.numel() for p in model.parameters()), padded_vocab_size(VOCAB, cfg, ParallelConfig())


@pytest.mark.parametrize("variant", ["standard", "bigmac"])
def test_accounting_matches_built_model(variant):
    cfg = tiny_model_config(moe_variant=variant, bigmac_ratio=0.25, moe_layer_freq=[0, 1])
    real, vocab = run_distributed(_param_count, 1, cfg)[0]
    acc = model_accounting(cfg, vocab)
    assert acc.params == real
    if variant == "bigmac":
        base = model_accounting(tiny_model_config(moe_layer_freq=[0, 1]), vocab)
        # parameter-matched experts (F = f / r): only the two projections are added
        assert acc.params_by_part["experts"] == base.params_by_part["experts"]
        assert acc.params - base.params == 2 * cfg.hidden_size * BigMacConfig.of(cfg).latent_size(cfg.hidden_size)
        bytes_bm = a2a_bytes_uniform(acc, tokens=1024, top_k=2, ep=4)["total"]
        bytes_fg = a2a_bytes_uniform(base, tokens=1024, top_k=2, ep=4)["total"]
        assert bytes_bm / bytes_fg == pytest.approx(0.25)


def _up_projection_std(rank, world, cfg):
    model, _ = build_and_load(cfg, ParallelConfig())
    ups = [m.fc2_latent_proj.weight for m in model.modules() if hasattr(m, "fc2_latent_proj")]
    downs = [m.fc1_latent_proj.weight for m in model.modules() if hasattr(m, "fc1_latent_proj")]
    return torch.cat([w.flatten() for w in ups]).std().item(), torch.cat([w.flatten() for w in downs]).std().item()


def test_up_projection_init_ablation():
    """``--bigmac-up-init``: output_scaled draws the up-projection with std / sqrt(2 x layers) (megatron-core's
    output-layer init), plain with std itself; the down-projection is std either way."""
    std, layers = 0.02, 8
    kw = dict(moe_variant="bigmac", bigmac_ratio=0.25, num_layers=layers, hidden_size=64, init_method_std=std)
    scaled_up, scaled_down = run_distributed(_up_projection_std, 1, tiny_model_config(**kw))[0]
    plain_up, plain_down = run_distributed(_up_projection_std, 1, tiny_model_config(bigmac_up_init="plain", **kw))[0]
    # 8 layers x 16 x 64 weights each: the sample std is within a few percent of the drawn one
    assert plain_up == pytest.approx(std, rel=0.05) and plain_down == pytest.approx(std, rel=0.05)
    assert scaled_up == pytest.approx(std / (2 * layers) ** 0.5, rel=0.05)
    assert scaled_down == pytest.approx(std, rel=0.05)
    with pytest.raises(ValueError, match="bigmac_up_init|bigmac-up-init"):
        tiny_model_config(bigmac_up_init="zeros", **kw)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_bigmac_ep2_equals_ep1(dispatcher):
    """Same tolerance and reasoning as tests/foundation/test_ep_equivalence.py."""
    cfg = tiny_model_config(moe_variant="bigmac", bigmac_ratio=0.25, moe_token_dispatcher_type=dispatcher)
    ref = _run(cfg, ParallelConfig(expert_model_parallel_size=1), 2)
    got = _run(cfg, ParallelConfig(expert_model_parallel_size=2), 2, state=ref[0]["state"])
    for rank in range(2):
        torch.testing.assert_close(got[rank]["loss"], ref[rank]["loss"], rtol=1e-5, atol=1e-6)
    _assert_grads_close(ref[0]["grads"], got[0]["grads"])


def test_bigmac_with_capacity_factor_ep2_equals_ep1():
    cfg = tiny_model_config(moe_variant="bigmac", bigmac_ratio=0.5, moe_expert_capacity_factor=1.0)
    ref = _run(cfg, ParallelConfig(expert_model_parallel_size=1), 2)
    got = _run(cfg, ParallelConfig(expert_model_parallel_size=2), 2, state=ref[0]["state"])
    for rank in range(2):
        torch.testing.assert_close(got[rank]["loss"], ref[rank]["loss"], rtol=1e-5, atol=1e-6)


class _PlainTELinear(torch.nn.Module):
    """Stands in for Transformer Engine's TELinear(parallel_mode="duplicated") on CPU."""

    def __init__(self, input_size, output_size, *, parallel_mode, config, init_method, bias,
                 skip_bias_add, skip_weight_param_allocation, is_expert):
        super().__init__()
        assert parallel_mode == "duplicated" and not bias
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size))
        init_method(self.weight)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


def _ours_vs_upstream(rank, world):
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import moe_layer as upstream

    from moe_variants.builder import transformer_config
    from megatron.components.parallel import initialize_parallel
    from moe_variants.bigmac.layer import BigMacMoELayer
    from moe_variants.common.moe_layer import ProjectRouter

    cfg = tiny_model_config(moe_variant="bigmac", bigmac_ratio=0.25)
    pgc = initialize_parallel(ParallelConfig(), seed=5)
    config = transformer_config(cfg, ParallelConfig())
    sub = copy.copy(get_gpt_layer_local_spec(num_experts=cfg.num_experts).submodules.mlp.submodules)
    sub.router = ProjectRouter
    ours = BigMacMoELayer(config, sub, layer_number=1, pg_collection=pgc,
                          latent_size=BigMacConfig.of(cfg).latent_size(cfg.hidden_size),
                          expert_ffn_hidden_size=BigMacConfig.of(cfg).expert_ffn(cfg))
    latent_config = copy.deepcopy(config)
    latent_config.moe_latent_size = BigMacConfig.of(cfg).latent_size(cfg.hidden_size)
    latent_config.moe_ffn_hidden_size = BigMacConfig.of(cfg).expert_ffn(cfg)
    upstream.HAVE_TE, upstream.TELinear = True, _PlainTELinear  # this process only
    theirs = upstream.MoELayer(latent_config, get_gpt_layer_local_spec(num_experts=cfg.num_experts).submodules.mlp.submodules,
                               layer_number=1, pg_collection=pgc)
    theirs.load_state_dict(ours.state_dict(), strict=True)  # same names and shapes, both ways
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(16, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    outs, grads = [], []
    for layer in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        out, _ = layer(xi)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append((xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
    return outs, grads


def _assert_close_scaled(got, ref, name=""):
    """fp32 agreement relative to the tensor's own magnitude (gradients here range 1e-8..1e-3)."""
    scale = float(ref.abs().max()) or 1.0
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{name}: {m}")


def test_matches_megatron_core_latent_moe():
    """Our layer equals megatron-core's own latent MoE path (TE's linear swapped for a plain one,
    in the test process only) on the same weights. Same operations except where the routing
    probabilities are applied (our experts scale the L-wide output, upstream the F-wide activation:
    ``LatentSequentialMLP``), which changes only fp32 rounding: ``rtol 1e-5`` and ``atol 1e-6`` of
    each tensor's largest magnitude (the observed differences are ~1e-7 relative)."""
    (out_ours, out_theirs), ((gx_o, gp_o), (gx_t, gp_t)) = run_distributed(_ours_vs_upstream, 1)[0]
    _assert_close_scaled(out_ours, out_theirs, "output")
    _assert_close_scaled(gx_o, gx_t, "input grad")
    assert gp_o.keys() == gp_t.keys()
    for name in gp_o:
        _assert_close_scaled(gp_o[name], gp_t[name], name)


def _latent_vs_sequential(rank, world, bias):
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import SequentialMLP

    from moe_variants.builder import transformer_config
    from megatron.components.parallel import initialize_parallel
    from moe_variants.bigmac.layer import LatentSequentialMLP

    cfg = tiny_model_config(moe_variant="bigmac", bigmac_ratio=0.25)
    pgc = initialize_parallel(ParallelConfig(), seed=3)
    config = copy.deepcopy(transformer_config(cfg, ParallelConfig()))
    config.moe_latent_size, config.moe_ffn_hidden_size = BigMacConfig.of(cfg).latent_size(cfg.hidden_size), BigMacConfig.of(cfg).expert_ffn(cfg)
    config.add_bias_linear = bias
    sub = get_gpt_layer_local_spec(num_experts=cfg.num_experts).submodules.mlp.submodules.experts.submodules
    num_experts = cfg.num_experts
    ours = LatentSequentialMLP(num_experts, config, sub, pg_collection=pgc)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    # upstream's expert bias path modifies a custom Function's output in place and fails in eager
    # autograd, so with biases the reference is the same formula written out (probabilities on the
    # activation, bias scaled as upstream does)
    ref = (_explicit_experts if bias else SequentialMLP)(num_experts, config, sub, pg_collection=pgc)
    ref.load_state_dict(ours.state_dict(), strict=True)
    tokens_per_expert = torch.tensor([5, 0, 9, 3])  # one expert receives nothing
    n = int(tokens_per_expert.sum())
    x = torch.randn(n, config.moe_latent_size, generator=gen)
    probs = torch.rand(n, generator=gen)
    upstream_grad = torch.randn(n, config.moe_latent_size, generator=gen)
    results = []
    for module in (ours, ref):
        xi, pi = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        out, out_bias = module(xi, tokens_per_expert, pi)
        assert out_bias is None
        (out * upstream_grad).sum().backward()
        results.append((out.detach(), xi.grad, pi.grad, {k: p.grad.clone() for k, p in module.named_parameters()}))
    return results


def _explicit_experts(*args, **kwargs):
    from megatron.core.transformer.moe.experts import SequentialMLP

    class ExplicitExperts(SequentialMLP):
        """SwiGLU experts with biases written out, probabilities on the activation (upstream's order)."""

        forward = _explicit_forward

    return ExplicitExperts(*args, **kwargs)


def _explicit_forward(self, x, tokens_per_expert, probs):
    splits = tokens_per_expert.tolist()
    outs = []
    for e, xi, pi in zip(self.local_experts, x.split(splits), probs.split(splits)):
        a, g = torch.chunk(xi @ e.linear_fc1.weight.t() + e.linear_fc1.bias, 2, dim=-1)
        act = torch.nn.functional.silu(a) * g * pi[:, None]
        outs.append(act @ e.linear_fc2.weight.t() + e.linear_fc2.bias * pi[:, None])
    return torch.cat(outs), None


@pytest.mark.parametrize("bias", [False, True])
def test_latent_experts_scale_output_like_upstream_scales_activation(bias):
    """``LatentSequentialMLP`` (probabilities scale the expert output [N, L]) computes what
    megatron-core's ``SequentialMLP`` (probabilities scale the activation [N, F]; with biases, the
    same formula written out) computes, with the same weights: output and the gradients of input,
    probabilities and every weight. The product is reassociated (fc2 is linear), so only fp32
    rounding differs: ``rtol 1e-5, atol 1e-6`` of each tensor's largest magnitude."""
    (o, gx, gp, gw), (o_r, gx_r, gp_r, gw_r) = run_distributed(_latent_vs_sequential, 1, bias)[0]
    _assert_close_scaled(o, o_r, "output")
    _assert_close_scaled(gx, gx_r, "input grad")
    _assert_close_scaled(gp, gp_r, "probs grad")
    assert gw.keys() == gw_r.keys() and len(gw) == 8 + 8 * bias
    for name in gw:
        _assert_close_scaled(gw[name], gw_r[name], name)


def _bytes(rank, world, cfg, state):
    from moe_variants.common.moe_layer import comm_counters
    from moe_variants.common.comm import CommCounters

    model, pgc = build_and_load(cfg, ParallelConfig(expert_model_parallel_size=2))
    if state is not None:
        from moe_variants.global_state import load_global_state_dict

        shared = {k: v for k, v in state.items() if ".experts." not in k}
        load_global_state_dict(model, shared, pgc, strict=False)
    tokens, labels = batch(rank)
    forward_loss(model, tokens, labels).sum().backward()
    totals = CommCounters.total(comm_counters([model]))
    if state is None:
        from moe_variants.global_state import gather_global_state_dict

        return totals, gather_global_state_dict(model, pgc)
    return totals, None


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_a2a_bytes_ratio_equals_r(ratio):
    """One MoE layer and identical router/attention weights give identical routing, so the
    hidden-state bytes of dispatch and combine (forward and backward) scale by exactly r; the
    routing-probability payload is the same in both and is reported separately."""
    base = tiny_model_config(num_layers=1, moe_layer_freq=1)
    std = run_distributed(_bytes, 2, base, None)
    state = std[0][1]
    bm = run_distributed(_bytes, 2, tiny_model_config(num_layers=1, moe_layer_freq=1, moe_variant="bigmac",
                                                      bigmac_ratio=ratio), state)
    for rank in range(2):
        s, b = std[rank][0], bm[rank][0]
        assert s["bytes_dispatch"] > 0
        for key in ("bytes_dispatch", "bytes_combine", "bytes_backward"):
            assert b[key] / s[key] == pytest.approx(ratio, rel=0.01), key
        assert b["bytes_meta"] == s["bytes_meta"]
