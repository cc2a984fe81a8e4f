"""Parameters, FLOPs and all-to-all bytes of fine-grained MoE vs BigMac (BigMac Table 3).

Two levels, both pure functions:

- ``paper_table3`` evaluates the paper's closed forms exactly (its GPT model: 4h^2 attention, a
  fine-grained expert of 2rh^2 parameters, GELU MLPs), so Table 4's GPT3-XL figures can be
  reproduced: 3.73B -> 3.78B parameters, 3,490.67T -> 3,649.00T FLOPs, 1,488 -> 372 GB all-to-all.
- ``model_accounting`` counts *this project's* model from a ``ModelConfig`` (SwiGLU experts, shared
  experts, GQA, dense-first layers, untied embeddings): parameters exactly as the built
  megatron-core module has them (tested against ``sum(p.numel())``), matmul FLOPs per token, and
  the all-to-all bytes an iteration moves under uniform routing.
"""

from __future__ import annotations

import dataclasses

from moe_variants.bigmac.config import BigMacConfig
from moe_variants.config import ModelConfig, moe_layer_pattern

__all__ = ["paper_table3", "ModelAccounting", "model_accounting", "a2a_bytes_uniform"]


def paper_table3(
    *, h: int, l: int, e: int, r: float, v: int, tokens: int, s: int, top_k: int, ep: int,
    bigmac: bool, bytes_per_element: int = 2,
) -> dict:
    """The paper's Table 3 for one model: ``params``, ``flops`` (one iteration, fwd+bwd) and
    ``a2a_bytes`` (one iteration: dispatch + combine, forward + backward).

    ``tokens`` is the global batch in tokens (b*s), ``s`` the sequence length, ``r`` the ratio
    (the fine-grained expert's intermediate size is r*h; BigMac's low dimension is r*h).
    """
    params = (4 * h * h + 8 * h + (2 * r * h * h + 2 * r * h) * e) * l + (v + e + 2) * h
    flops = 12 * tokens * l * h * h * (2 + s / h + v / (2 * l * h) + r * top_k)
    a2a = 4 * bytes_per_element * tokens * l * h * top_k * (ep - 1) / ep
    if bigmac:
        params += 2 * r * l * h * h
        flops += 12 * r * tokens * l * h * h
        a2a *= r
    return {"params": params, "flops": flops, "a2a_bytes": a2a}


@dataclasses.dataclass(frozen=True)
class ModelAccounting:
    params: int  # total parameters of the built model
    params_by_part: dict
    flops_per_token_fwd: float  # matmul FLOPs per token, forward (x3 for a training step)
    a2a_dim: int  # width of the rows the all-to-all carries (h, or r*h for BigMac)
    num_moe_layers: int

    def train_flops(self, tokens: int) -> float:
        return 3.0 * self.flops_per_token_fwd * tokens


def _attention_params(m: ModelConfig) -> tuple[int, float]:
    if m.multi_latent_attention:
        raise ValueError("model_accounting covers standard (GQA/MHA) attention, not MLA")
    h = m.hidden_size
    kv = m.kv_channels or h // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    q_out = m.num_attention_heads * kv
    qkv = h * (q_out + 2 * groups * kv)
    proj = q_out * h
    norms = 2 * kv if m.qk_layernorm else 0
    flops = 2.0 * (qkv + proj) + 4.0 * m.seq_length * q_out  # QK^T and AV over the full window
    return qkv + proj + norms, flops


def _mlp_params(h: int, ffn: int, swiglu: bool) -> int:
    return (2 if swiglu else 1) * ffn * h + h * ffn


def model_accounting(m: ModelConfig, vocab_size: int) -> ModelAccounting:
    """Exact parameter count and per-token forward matmul FLOPs of the model ``m`` builds.

    ``vocab_size`` is the padded vocabulary the model is built with.
    """
    h = m.hidden_size
    pattern = moe_layer_pattern(m)
    attn_params, attn_flops = _attention_params(m)
    dense_ffn = m.ffn_hidden_size or 4 * h
    expert_ffn = m.moe_ffn_hidden_size or dense_ffn
    bigmac = m.moe_variant.owner is not None and m.moe_variant.owner.name == "bigmac"
    latent = BigMacConfig.of(m).latent_size(h) if bigmac else None
    dim = latent if bigmac else h
    if bigmac:
        expert_ffn = BigMacConfig.of(m).expert_ffn(m)
    parts = {"embedding": vocab_size * h, "output_layer": 0 if not m.untie_embeddings_and_output_weights else vocab_size * h,
             "attention": 0, "norms": h, "dense_mlp": 0, "router": 0, "experts": 0, "shared_experts": 0,
             "latent_proj": 0}
    flops = 2.0 * vocab_size * h  # output layer
    for is_moe in pattern:
        parts["attention"] += attn_params
        parts["norms"] += 2 * h
        flops += attn_flops
        if not is_moe:
            p = _mlp_params(h, dense_ffn, m.swiglu)
            parts["dense_mlp"] += p
            flops += 2.0 * p
            continue
        expert = _mlp_params(dim, expert_ffn, m.swiglu)
        parts["router"] += m.num_experts * h
        parts["experts"] += m.num_experts * expert
        flops += 2.0 * (m.num_experts * h + m.moe_router_topk * expert)
        if m.moe_shared_expert_intermediate_size:
            p = _mlp_params(h, m.moe_shared_expert_intermediate_size, m.swiglu)
            parts["shared_experts"] += p
            flops += 2.0 * p
        if bigmac:
            parts["latent_proj"] += 2 * h * latent
            flops += 2.0 * 2 * h * latent
    return ModelAccounting(
        params=sum(parts.values()),
        params_by_part=parts,
        flops_per_token_fwd=flops,
        a2a_dim=dim,
        num_moe_layers=sum(pattern),
    )


def a2a_bytes_uniform(
    acc: ModelAccounting, *, tokens: int, top_k: int, ep: int, bytes_per_element: int = 4,
    backward: bool = True,
) -> dict:
    """Expected hidden-state bytes leaving all ranks in one iteration if routing is uniform
    (a routed copy stays local with probability 1/ep). Excludes the routing-probability payload.
    """
    per_direction = tokens * top_k * (ep - 1) / ep * acc.a2a_dim * bytes_per_element * acc.num_moe_layers
    out = {"dispatch": per_direction, "combine": per_direction}
    if backward:
        out["backward"] = 2 * per_direction
    out["total"] = sum(out.values())
    return out
