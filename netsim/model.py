"""The served model's shape, and the work (FLOPs, bytes moved) of each layer kind per GPU.

Defaults are DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3): 61 layers (3 dense, 58 MoE),
hidden 7168, MLA (128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128), 256 routed
experts of width 2048 with top-8 routing plus one shared expert, FP8 weights (671B parameters).

Serving layout assumed throughout (SGLang / DeepSeek style decode):
* attention is tensor-parallel over ``tp`` GPUs (``tp = 1`` is data-parallel attention); the MLA
  latent KV cache is not split across heads, so every GPU of a TP group holds its requests' cache;
* MoE layers are expert-parallel over ``ep`` GPUs: each GPU dispatches ``1/tp`` of its TP group's
  tokens (the all-reduce after attention is reduce-scatter + all-gather around the MoE), tokens go
  to ``top_k`` experts, balanced (EPLB-style);
* the shared expert runs on each GPU's dispatched tokens, the dense layers are TP-sharded.

Layer kinds (:class:`LayerKind`) are what the compute table is indexed by; :func:`kernel_work`
gives each kind's FLOPs and HBM bytes for the roofline and for projecting measured tables.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import Enum

import numpy as np

__all__ = ["ModelShape", "DEEPSEEK_V3", "LayerKind", "KIND_AXES", "Roof", "kernel_work"]


@dataclass(frozen=True)
class ModelShape:
    name: str = "DeepSeek-V3"
    hidden: int = 7168
    num_layers: int = 61
    num_dense_layers: int = 3
    num_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    vocab_size: int = 129280
    num_experts: int = 256
    top_k: int = 8
    moe_ffn_hidden: int = 2048
    num_shared_experts: int = 1
    dense_ffn_hidden: int = 18432
    weight_bytes: float = 1.0  # FP8 linear weights
    act_bytes: float = 2.0  # BF16 activations (and the BF16 lm_head / router)
    kv_cache_bytes: float = 2.0  # BF16 latent cache
    dispatch_bytes: float = 1.0 + 4 / 128  # FP8 payload + one fp32 scale per 128 values (DeepEP)
    combine_bytes: float = 2.0  # BF16

    def __post_init__(self):
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError("num_dense_layers must be between 0 and num_layers")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError("top_k must be between 1 and num_experts")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def kv_latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    # ---- parameter counts (one layer unless stated)
    def attention_params(self) -> tuple[int, int]:
        """(replicated, head-sharded) MLA parameters: q_a and kv_a are shared by all heads; q_b,
        kv_b (absorbed into q and the output at decode) and o are split across TP ranks."""
        h, qk = self.hidden, self.qk_nope_head_dim + self.qk_rope_head_dim
        repl = h * self.q_lora_rank + h * self.kv_latent_dim
        shard = (self.q_lora_rank * self.num_heads * qk
                 + self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
                 + self.num_heads * self.v_head_dim * h)  # fmt: skip
        return repl, shard

    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_ffn_hidden

    def dense_ffn_params(self) -> int:
        return 3 * self.hidden * self.dense_ffn_hidden

    def num_params(self) -> int:
        """All parameters (embedding and lm_head untied), 671B for DeepSeek-V3."""
        a = sum(self.attention_params()) * self.num_layers
        dense = self.dense_ffn_params() * self.num_dense_layers
        moe = (self.num_experts + self.num_shared_experts) * self.expert_params() + self.hidden * self.num_experts
        return a + dense + moe * self.num_moe_layers + 2 * self.hidden * self.vocab_size

    def num_active_params(self) -> int:
        a = sum(self.attention_params()) * self.num_layers
        dense = self.dense_ffn_params() * self.num_dense_layers
        moe = (self.top_k + self.num_shared_experts) * self.expert_params() + self.hidden * self.num_experts
        return a + dense + moe * self.num_moe_layers + 2 * self.hidden * self.vocab_size

    def kv_bytes_per_token(self) -> float:
        """Latent KV cache of one token over all layers (MLA: kv_lora + rope values per layer)."""
        return self.num_layers * self.kv_latent_dim * self.kv_cache_bytes

    def weight_bytes_per_gpu(self, tp: int, ep: int, extra_params: float = 0.0) -> float:
        """Resident weights on one GPU: experts / ep, attention and dense FFN head/column-sharded
        by tp, shared experts, router and embedding replicated, lm_head vocab-sharded."""
        repl, shard = self.attention_params()
        wb = self.weight_bytes
        experts = self.num_moe_layers * self.num_experts / ep * self.expert_params() * wb
        attn = self.num_layers * (repl + shard / tp) * wb
        dense = self.num_dense_layers * self.dense_ffn_params() / tp * wb
        shared = self.num_moe_layers * self.num_shared_experts * self.expert_params() * wb
        router = self.num_moe_layers * self.hidden * self.num_experts * self.act_bytes
        emb = self.hidden * self.vocab_size * self.act_bytes * (1 + 1 / tp)
        return experts + attn + dense + shared + router + emb + extra_params * wb

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelShape":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"model shape: unknown field(s) {', '.join(sorted(unknown))}")
        return cls(**d)


DEEPSEEK_V3 = ModelShape()


class LayerKind(str, Enum):
    MLA_PROJ = "mla_proj"
    """MLA projections of one layer (q_a, q_b, kv_a, absorbed kv_b, o) for ``tokens`` on one TP rank."""
    MLA_CORE = "mla_core"
    """Decode attention over the latent cache: ``requests`` x ``q_len`` queries, ``ctx`` cached tokens."""
    MOE_EXPERTS = "moe_experts"
    """Routed experts of one layer on one GPU: ``routed_tokens`` token-expert pairs over ``experts``."""
    SHARED_EXPERT = "shared_expert"
    DENSE_FFN = "dense_ffn"
    ROUTER = "router"
    ELEMENTWISE = "elementwise"
    """Norms, residual adds, RoPE, activation quantisation, top-k weighting of one layer."""
    LM_HEAD = "lm_head"
    LATENT_PROJ = "latent_proj"
    """BigMac / DCCA shared projection hidden <-> ``latent`` (one direction) for ``tokens``."""


KIND_AXES: dict[LayerKind, tuple[str, ...]] = {
    LayerKind.MLA_PROJ: ("tokens", "tp"),
    LayerKind.MLA_CORE: ("requests", "ctx", "q_len", "tp"),
    LayerKind.MOE_EXPERTS: ("routed_tokens", "experts"),
    LayerKind.SHARED_EXPERT: ("tokens",),
    LayerKind.DENSE_FFN: ("tokens", "tp"),
    LayerKind.ROUTER: ("tokens",),
    LayerKind.ELEMENTWISE: ("tokens",),
    LayerKind.LM_HEAD: ("tokens", "tp"),
    LayerKind.LATENT_PROJ: ("tokens", "latent"),
}


class Roof(str, Enum):
    """Which efficiency pair of the roofline applies (see ``compute.RooflineEfficiency``)."""

    GEMM_FP8 = "gemm_fp8"
    GEMM_BF16 = "gemm_bf16"
    ATTENTION = "attention"  # BF16 FlashMLA-style
    MEMORY = "memory"  # elementwise, no meaningful FLOPs


def kernel_work(kind: LayerKind | str, m: ModelShape, **axes) -> tuple[np.ndarray, np.ndarray, int, Roof]:
    """``(flops, bytes, num_kernels, roof)`` of one layer kind on one GPU; axes broadcast as arrays.

    Bytes are HBM traffic: weights touched plus activations read and written (each once).
    """
    kind = LayerKind(kind)
    a = {k: np.asarray(v, dtype=float) for k, v in axes.items()}
    missing = set(KIND_AXES[kind]) - set(a)
    if missing:
        raise ValueError(f"{kind.value}: missing axis value(s) {', '.join(sorted(missing))}")
    h, ab, wb = m.hidden, m.act_bytes, m.weight_bytes
    if kind == LayerKind.MLA_PROJ:
        t, tp = a["tokens"], a["tp"]
        repl, shard = m.attention_params()
        params = repl + shard / tp
        heads = m.num_heads / tp
        act = t * ab * (2 * h + m.q_lora_rank + m.kv_latent_dim + 2 * heads * m.kv_latent_dim)
        return 2 * t * params, params * wb + act, 6, Roof.GEMM_FP8
    if kind == LayerKind.MLA_CORE:
        r, ctx, q, tp = a["requests"], a["ctx"], a["q_len"], a["tp"]
        heads = m.num_heads / tp
        lat = m.kv_latent_dim
        flops = 2 * r * q * ctx * heads * (lat + m.kv_lora_rank)
        byts = r * ctx * lat * m.kv_cache_bytes + r * q * heads * (lat + m.kv_lora_rank) * ab
        return flops, byts, 2, Roof.ATTENTION
    if kind == LayerKind.MOE_EXPERTS:
        rt, e = a["routed_tokens"], a["experts"]
        active = e * (1 - (1 - 1 / e) ** rt)  # experts that receive at least one token (uniform)
        w = m.expert_params()
        act = rt * (3 * h + 6 * m.moe_ffn_hidden)
        return 2 * rt * w, active * w * wb + act, 4, Roof.GEMM_FP8
    if kind == LayerKind.SHARED_EXPERT:
        t = a["tokens"]
        w = m.num_shared_experts * m.expert_params()
        act = t * (3 * h + 6 * m.num_shared_experts * m.moe_ffn_hidden)
        return 2 * t * w, w * wb + act, 3, Roof.GEMM_FP8
    if kind == LayerKind.DENSE_FFN:
        t, tp = a["tokens"], a["tp"]
        w = m.dense_ffn_params() / tp
        act = t * (3 * h + 6 * m.dense_ffn_hidden / tp)
        return 2 * t * w, w * wb + act, 3, Roof.GEMM_FP8
    if kind == LayerKind.ROUTER:
        t = a["tokens"]
        w = h * m.num_experts
        return 2 * t * w, w * ab + t * (h * ab + 4 * m.num_experts), 2, Roof.GEMM_BF16
    if kind == LayerKind.ELEMENTWISE:
        t = a["tokens"]
        return 10 * t * h, 12 * t * h * ab, 6, Roof.MEMORY
    if kind == LayerKind.LM_HEAD:
        t, tp = a["tokens"], a["tp"]
        w = h * m.vocab_size / tp
        return 2 * t * w, w * ab + t * (h + m.vocab_size / tp) * ab, 2, Roof.GEMM_BF16
    t, lat = a["tokens"], a["latent"]  # LATENT_PROJ
    w = h * lat
    return 2 * t * w, w * wb + t * (h + lat) * ab, 1, Roof.GEMM_FP8
