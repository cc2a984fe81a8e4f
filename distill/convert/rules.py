"""Tensor rules: how one of our tensors is made from Hugging Face tensors, and split back.

Our side is the layout-free state dict (``moe_variants.global_state``: TP=1/EP=1 names and full
tensors, local Transformer-Engine-free modules); the HF side is the model's safetensors names. A
``Rule`` is exact in both directions (concatenations and reshapes only), so HF -> ours -> HF gives
back identical tensors. Shapes: ``H`` hidden, ``F`` FFN width, ``d`` head dim, ``G`` query groups.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

__all__ = [
    "Rule",
    "copy",
    "concat_rows",
    "fused_qkv",
    "swiglu",
    "gqa_attention",
    "embeddings_and_head",
    "layer_norms",
    "hf_shapes",
]

HF_LAYER = "model.layers.{i}."
OUR_LAYER = "decoder.layers.{i}."


@dataclasses.dataclass(frozen=True)
class Rule:
    """``ours = join([hf tensors in order])`` and ``split(ours) == [hf tensors in order]``."""

    ours: str
    hf: tuple[str, ...]
    join: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    split: Callable[[torch.Tensor], Sequence[torch.Tensor]]


def copy(ours: str, hf: str) -> Rule:
    return Rule(ours, (hf,), lambda ts: ts[0], lambda t: (t,))


def concat_rows(ours: str, hf: Sequence[str], sizes: Sequence[int]) -> Rule:
    """Row blocks stacked in order (megatron's SwiGLU ``linear_fc1`` is ``[gate; up]``)."""
    sizes = tuple(int(s) for s in sizes)
    return Rule(ours, tuple(hf), lambda ts: torch.cat(list(ts), dim=0), lambda t: torch.split(t, sizes, dim=0))


def fused_qkv(ours: str, q: str, k: str, v: str, num_heads: int, num_groups: int, head_dim: int) -> Rule:
    """megatron-core's ``linear_qkv``: per query group g, the rows of its ``num_heads / G`` query
    heads, then its key head, then its value head: [G x (num_heads/G + 2) x d, H]."""
    per_group = num_heads // num_groups

    def join(ts):
        wq, wk, wv = ts
        hidden = wq.shape[-1]
        parts = (wq.reshape(num_groups, per_group * head_dim, hidden), wk.reshape(num_groups, head_dim, hidden),
                 wv.reshape(num_groups, head_dim, hidden))
        return torch.cat(parts, dim=1).reshape(-1, hidden)

    def split(t):
        hidden = t.shape[-1]
        wq, wk, wv = torch.split(t.reshape(num_groups, (per_group + 2) * head_dim, hidden),
                                 [per_group * head_dim, head_dim, head_dim], dim=1)
        return wq.reshape(-1, hidden), wk.reshape(-1, hidden), wv.reshape(-1, hidden)

    return Rule(ours, (q, k, v), join, split)


def swiglu(ours_prefix: str, hf_prefix: str, ffn: int, names=("gate_proj", "up_proj", "down_proj")) -> list[Rule]:
    """A SwiGLU MLP: ``linear_fc1 = [gate; up]`` [2F, H], ``linear_fc2 = down`` [H, F]."""
    gate, up, down = names
    return [
        concat_rows(f"{ours_prefix}linear_fc1.weight", (f"{hf_prefix}{gate}.weight", f"{hf_prefix}{up}.weight"),
                    (ffn, ffn)),
        copy(f"{ours_prefix}linear_fc2.weight", f"{hf_prefix}{down}.weight"),
    ]


def gqa_attention(i: int, num_heads: int, num_groups: int, head_dim: int, qk_norm: bool) -> list[Rule]:
    """Llama-style q/k/v/o projections (+ Qwen3's per-head q_norm/k_norm) of layer ``i``.

    Both sides use half-split (non-interleaved) rotary embeddings, so no row permutation is needed.
    """
    ours, hf = OUR_LAYER.format(i=i) + "self_attention.", HF_LAYER.format(i=i) + "self_attn."
    rules = [
        fused_qkv(f"{ours}linear_qkv.weight", f"{hf}q_proj.weight", f"{hf}k_proj.weight", f"{hf}v_proj.weight",
                  num_heads, num_groups, head_dim),
        copy(f"{ours}linear_proj.weight", f"{hf}o_proj.weight"),
    ]
    if qk_norm:
        rules += [copy(f"{ours}q_layernorm.weight", f"{hf}q_norm.weight"),
                  copy(f"{ours}k_layernorm.weight", f"{hf}k_norm.weight")]
    return rules


def layer_norms(i: int) -> list[Rule]:
    ours, hf = OUR_LAYER.format(i=i), HF_LAYER.format(i=i)
    return [copy(f"{ours}input_layernorm.weight", f"{hf}input_layernorm.weight"),
            copy(f"{ours}pre_mlp_layernorm.weight", f"{hf}post_attention_layernorm.weight")]


def embeddings_and_head(untied: bool) -> list[Rule]:
    rules = [copy("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
             copy("decoder.final_layernorm.weight", "model.norm.weight")]
    if untied:
        rules.append(copy("output_layer.weight", "lm_head.weight"))
    return rules


def hf_shapes(rule: Rule, our_shape: Sequence[int]) -> list[tuple]:
    """The HF tensor shapes a rule expects, given our tensor's shape (computed on the meta device)."""
    return [tuple(t.shape) for t in rule.split(torch.empty(tuple(our_shape), device="meta"))]
