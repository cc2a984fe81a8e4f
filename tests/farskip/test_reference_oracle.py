"""Our FarSkip model against an oracle of the authors' connectivity, written here in plain torch.

The oracle follows the authors' reference layers as read in docs/design/farskip.md ("Connectivity: ours
beside the authors' reference"): AMD-AGI/FarSkip-Collective's SGLang
``DeepseekV2ReferenceFarSkipDecoderLayer.forward`` and ``DeepseekV2Model.forward``
(``inference/sglang/python/sglang/srt/models/deepseek_v2.py``), its Instella top-k
(``grouped_topk_gpu_instella``, ``.../layers/moe/topk.py``), and Instella-MoE's
``FarSkipDecoderLayer`` / ``FarSkipMoE`` / ``InstellaMoEModel`` for FarSkip ranges that do not start
at layer 0. Per layer k, with the full stream o and the routed-free stream A:

    FarSkip layer:  x = o + attn(LN1(A));  routed, shared = MoE(LN2(o))
                    A' = x + shared;  o' = A' + routed            (dense: o' = A' = x + mlp(LN2(o)))
    standard layer: x = o + attn(LN1(o));  routed, shared = MoE(LN2(x))
                    A' = x + shared;  o' = A' + routed            (dense: o' = A' = x + mlp(LN2(x)))
    final:          logits = output(LNf(o_L))

The model is DeepSeek-V3-shaped and tiny: multi-latent attention with query compression and the
latent norms, a dense first layer, MoE layers with 8 routed experts (sigmoid scores, a selection
bias, renormalised top-k weights times a routed scaling factor) and a shared expert. The oracle
takes our model's weights by name (EP=2: gathered to their global names).

The weights are initialised with a standard deviation of 0.2 (megatron's default 0.02 makes every
sub-block's output a thousandth of the residual stream, so a moved wire would hardly show).

Tolerance ``rtol=atol=1e-5`` on logits of magnitude up to about 4: both sides are float32, but the
oracle's attention, norms and expert sums are separate torch calls in another order than
megatron-core's batched ones, which moves the last bits (measured: at most 5e-6).

Sensitivity: every wire of the oracle can be moved (``Wiring``); moving any one of them must move
the logits by more than ``MOVED`` (100x the tolerance) away from our model's, so the equality above
cannot hold for a model wired differently.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from moe_variants.config import ParallelConfig
from tests.helpers import batch, build_and_load, tiny_model_config
from tools.spawn import run_distributed

TOL = 1e-5
MOVED = 100 * TOL

# DeepSeek-V3's shape, tiny: MLA with query compression, a dense first layer, sigmoid routing with a
# selection bias and a routed scaling factor, a shared expert
DSV3 = dict(
    num_layers=5, moe_layer_freq=[0, 1, 1, 1, 1], hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
    multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
    v_head_dim=8, qk_layernorm=True,
    num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=32,
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
    moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", init_method_std=0.2,
)
# DeepSeek-V3's group-limited routing (groups ranked by their top-2 sum): 4 groups, 2 kept, top-4
GROUPED = dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2)


@dataclasses.dataclass(frozen=True)
class Wiring:
    """The oracle's wires; the defaults are the authors' reference. Each field moves one."""

    attn_reads_full: bool = False  # FarSkip attention reads o, not A (Instella's mlp_only_farskip)
    mlp_reads_post_attention: bool = False  # FarSkip MLP/MoE reads x, not o (Instella's attn_only_farskip)
    attn_adds_onto_routed_free: bool = False  # FarSkip residual x = A + attn instead of o + attn
    shared_into_main_only: bool = False  # A' = x (the shared expert feeds only the main stream)
    routed_into_both: bool = False  # A' = x + shared + routed (the routed experts feed both streams)
    standard_hands_on_full: bool = False  # a standard MoE layer hands on A' = o' (our paper-text wiring)
    final_from_routed_free: bool = False  # the last layer's combine skipped: logits from LNf(A_L)
    dense_mlp_post_attention: bool = False  # a dense FarSkip layer's MLP reads x (sequential), not o
    bias_in_weights: bool = False  # the selection bias also enters the routing weights
    unscaled: bool = False  # the routed scaling factor left out


# ------------------------------------------------------------------------------------------------
# the oracle: plain torch, [batch, seq, hidden] throughout


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _swiglu(x, fc1, fc2):
    gate, up = (x @ fc1.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ fc2.t()


def _rope(t, base):
    """RoPE on [b, s, heads, d] at positions 0..s-1, in megatron-core's MLA layout (the even then
    the odd dimensions, rotated as two halves)."""
    d = t.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(t.shape[1], dtype=torch.float32)[:, None] * inv_freq[None]  # [s, d/2]
    angles = torch.cat([angles, angles], -1)[None, :, None, :]
    t = torch.cat([t[..., 0::2], t[..., 1::2]], -1)
    first, second = t.chunk(2, dim=-1)
    return t * angles.cos() + torch.cat([-second, first], -1) * angles.sin()


def _mla(w, p, x, cfg):
    """Multi-latent attention (causal) of [b, s, h]."""
    b, s, _ = x.shape
    nh, dq, dr, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    eps = cfg.norm_epsilon
    q = _rms(x @ w[p + "linear_q_down_proj.weight"].t(), w[p + "q_layernorm.weight"], eps)
    q = (q @ w[p + "linear_q_up_proj.weight"].t()).view(b, s, nh, dq + dr)
    q_nope, q_pe = q.split([dq, dr], -1)
    latent, k_pe = (x @ w[p + "linear_kv_down_proj.weight"].t()).split([cfg.kv_lora_rank, dr], -1)
    latent = _rms(latent, w[p + "kv_layernorm.weight"], eps)
    k_nope, v = (latent @ w[p + "linear_kv_up_proj.weight"].t()).view(b, s, nh, dq + dv).split([dq, dv], -1)
    query = torch.cat([q_nope, _rope(q_pe, cfg.rotary_base)], -1)
    key = torch.cat([k_nope, _rope(k_pe[:, :, None, :], cfg.rotary_base).expand(b, s, nh, dr)], -1)
    scores = torch.einsum("bshd,bthd->bhst", query, key) / math.sqrt(dq + dr)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    out = torch.einsum("bhst,bthd->bshd", probs, v).reshape(b, s, nh * dv)
    return out @ w[p + "linear_proj.weight"].t()


def _moe(w, p, x, cfg, wiring):
    """(routed, shared) of [b, s, h]: the Instella / DeepSeek-V3 top-k (selection on sigmoid scores
    plus the bias, group-limited by the groups' top-2 sums; weights the chosen unbiased scores,
    renormalised and times the routed scaling factor)."""
    tokens = x.reshape(-1, x.shape[-1])
    scores = torch.sigmoid(tokens @ w[p + "router.weight"].t())
    choice = scores + w[p + "router.expert_bias"]
    groups = cfg.moe_router_num_groups or 1
    if groups > 1:
        group_scores = choice.view(len(tokens), groups, -1).topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_scores).scatter(1, group_scores.topk(cfg.moe_router_group_topk, -1).indices, 1)
        choice = choice.masked_fill(~kept.bool().repeat_interleave(cfg.num_experts // groups, 1), float("-inf"))
    chosen = choice.topk(cfg.moe_router_topk, dim=-1).indices  # [T, K]
    weights = (scores + w[p + "router.expert_bias"] if wiring.bias_in_weights else scores).gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True)
    if not wiring.unscaled:
        weights = weights * cfg.moe_router_topk_scaling_factor
    routed = torch.zeros_like(tokens)
    for e in range(cfg.num_experts):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        if len(rows):
            expert = p + f"experts.local_experts.{e}."
            out = _swiglu(tokens[rows], w[expert + "linear_fc1.weight"], w[expert + "linear_fc2.weight"])
            routed.index_add_(0, rows, weights[rows, slot, None] * out)
    shared = _swiglu(tokens, w[p + "shared_experts.linear_fc1.weight"], w[p + "shared_experts.linear_fc2.weight"])
    return routed.view_as(x), shared.view_as(x)


def oracle_logits(w: dict, cfg, farskip_layers, tokens, wiring: Wiring = Wiring()):
    """Logits [b, s, vocab] of the reference connectivity; ``w``: our global state dict."""
    eps = cfg.norm_epsilon
    full = routed_free = w["embedding.word_embeddings.weight"][tokens]
    moe = cfg.moe_layer_freq
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        far = i in farskip_layers
        attn_in = full if not far or wiring.attn_reads_full else routed_free
        base = routed_free if far and wiring.attn_adds_onto_routed_free else full
        x = base + _mla(w, p + "self_attention.", _rms(attn_in, w[p + "input_layernorm.weight"], eps), cfg)
        post_attention = not far or wiring.mlp_reads_post_attention or (not moe[i] and wiring.dense_mlp_post_attention)
        mlp_in = _rms(x if post_attention else full, w[p + "pre_mlp_layernorm.weight"], eps)
        if not moe[i]:
            full = routed_free = x + _swiglu(mlp_in, w[p + "mlp.linear_fc1.weight"], w[p + "mlp.linear_fc2.weight"])
            continue
        routed, shared = _moe(w, p + "mlp.", mlp_in, cfg, wiring)
        routed_free = x if wiring.shared_into_main_only else x + shared
        full = routed_free + routed if not wiring.shared_into_main_only else x + shared + routed
        if wiring.routed_into_both:
            routed_free = full
        if not far and wiring.standard_hands_on_full:
            routed_free = full
    last = routed_free if wiring.final_from_routed_free else full
    return _rms(last, w["decoder.final_layernorm.weight"], eps) @ w["output_layer.weight"].t()


# ------------------------------------------------------------------------------------------------
# our model


def _ours(rank, world, overrides, ep):
    """This rank's logits on its batch, its tokens, and the global weights (selection biases set)."""
    from moe_variants.builder import causal_attention_mask
    from moe_variants.common.moe_layer import moe_layers
    from moe_variants.global_state import gather_global_state_dict

    model, pgc = build_and_load(tiny_model_config(**{**DSV3, **overrides}), ParallelConfig(expert_model_parallel_size=ep))
    model.eval()
    gen = torch.Generator().manual_seed(3)
    biases = {}
    for layer in moe_layers(model):  # a nonzero selection bias, the same on every rank
        layer.router.expert_bias.copy_(0.05 * torch.randn(layer.router.expert_bias.shape, generator=gen))
        biases[f"decoder.layers.{layer.layer_number - 1}.mlp.router.expert_bias"] = layer.router.expert_bias.clone()
    tokens, _ = batch(rank)
    seq = tokens.shape[1]
    with torch.no_grad():
        logits = model(tokens, torch.arange(seq)[None].expand_as(tokens), causal_attention_mask(seq))
    weights = {**gather_global_state_dict(model, pgc), **biases}
    return logits, tokens, weights if rank == 0 else None


@functools.lru_cache(maxsize=None)
def _run(items: tuple, ep: int):
    overrides = dict(items)
    results = run_distributed(_ours, ep, overrides, ep)
    weights = results[0][2]
    return [(logits, tokens) for logits, tokens, _ in results], weights, tiny_model_config(**{**DSV3, **overrides})


def _case(ep=1, **overrides):
    return _run(tuple(sorted(overrides.items())), ep)


def _assert_equals_oracle(case, wiring=Wiring()):
    ranks, weights, cfg = case
    layers = cfg.variants["farskip"].layers(cfg.num_layers) if "farskip" in cfg.variants else frozenset()
    for logits, tokens in ranks:
        torch.testing.assert_close(logits, oracle_logits(weights, cfg, layers, tokens, wiring), rtol=TOL, atol=TOL)


CASES = [
    dict(farskip="none"),  # the oracle's building blocks, no FarSkip layer
    dict(farskip="all", farskip_impl="simple"),
    dict(farskip="all", farskip_impl="overlapped"),
    dict(farskip="all", farskip_impl="simple", **GROUPED),
    # a range after a standard MoE layer (its lead-in) and before another: layers 1 and 4 standard
    dict(farskip="2-3", farskip_impl="overlapped"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_ours_equals_the_reference_oracle(case):
    _assert_equals_oracle(_case(**case))


@pytest.mark.parametrize("case", [dict(farskip="all", farskip_impl="overlapped"),
                                  dict(farskip="2-3", farskip_impl="overlapped")], ids=["all", "2-3"])
def test_ours_equals_the_reference_oracle_at_ep2(case):
    _assert_equals_oracle(_case(ep=2, **case))


@pytest.mark.parametrize("overrides,wiring", [
    (dict(farskip_mode="attn-only"), Wiring(mlp_reads_post_attention=True)),
    (dict(farskip_mode="mlp-only"), Wiring(attn_reads_full=True)),
    (dict(farskip_connectivity="paper-text"), Wiring(standard_hands_on_full=True)),
], ids=["attn-only", "mlp-only", "paper-text"])
def test_modes_and_paper_text_equal_their_moved_wire(overrides, wiring):
    """Instella's attn_only/mlp_only_farskip are ours attn-only/mlp-only; ``paper-text`` is the
    reference with the lead-in layer handing on one collapsed stream."""
    _assert_equals_oracle(_case(farskip="2-3", farskip_impl="simple", **overrides), wiring)


# the moves, on the model of CASES[1] (every layer FarSkip) or CASES[4] (the range 2-3)
MOVES = {
    "all": [Wiring(attn_reads_full=True), Wiring(mlp_reads_post_attention=True), Wiring(attn_adds_onto_routed_free=True),
            Wiring(shared_into_main_only=True), Wiring(routed_into_both=True), Wiring(final_from_routed_free=True),
            Wiring(dense_mlp_post_attention=True), Wiring(bias_in_weights=True), Wiring(unscaled=True)],
    "2-3": [Wiring(standard_hands_on_full=True)],
}


@pytest.mark.parametrize("selection,wiring", [(s, w) for s, moves in MOVES.items() for w in moves],
                         ids=lambda v: v if isinstance(v, str) else
                         ",".join(f.name for f in dataclasses.fields(v) if getattr(v, f.name)))
def test_the_oracle_is_sensitive_to_every_wire(selection, wiring):
    """Each moved wire moves the oracle's logits by more than ``MOVED`` (100x the tolerance) away
    from our model's, which equal the unmoved oracle's."""
    ranks, weights, cfg = _case(farskip=selection, farskip_impl="simple" if selection == "all" else "overlapped")
    layers = cfg.variants["farskip"].layers(cfg.num_layers)
    (logits, tokens), = ranks
    moved = oracle_logits(weights, cfg, layers, tokens, wiring)
    assert (moved - logits).abs().max() > MOVED
