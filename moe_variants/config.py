"""Dataclass configs for the model and its parallel layout (YAML/flags only at the edges).

Field names are Megatron-LM's flag names with ``-`` -> ``_`` so a user's ``--moe-router-topk 8``
and a YAML ``moe_router_topk: 8`` land on the same field. ``validate`` checks a config against a
world size once, raising ``ValueError`` that names the offending setting.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Union


class DispatcherType(str, enum.Enum):
    """How tokens reach their experts: all-to-all among EP ranks, or all-gather over TPxEP."""

    alltoall = "alltoall"
    allgather = "allgather"


class TransformerImpl(str, enum.Enum):
    """``local``: megatron-core's plain torch modules (CPU and GPU). ``transformer_engine``: TE
    modules (GPU). ``auto``: TE when it is importable and a GPU is present, else local."""

    local = "local"
    transformer_engine = "transformer_engine"
    auto = "auto"


class MoEVariant(str, enum.Enum):
    """``standard``: megatron-core's fine-grained MoE. ``bigmac``: DCCA (BigMac), the all-to-all at
    ``bigmac_ratio x hidden`` between a shared down- and up-projection."""

    standard = "standard"
    bigmac = "bigmac"


class RopeType(str, enum.Enum):
    """Rotary embedding of multi-latent attention: plain ``rope``, or ``yarn`` (DeepSeek-V2's
    context extension: rescaled frequencies and a softmax scale of ``mscale(mscale_all_dim)^2``)."""

    rope = "rope"
    yarn = "yarn"


class RouterGroupScore(str, enum.Enum):
    """How group-limited routing (``--moe-router-num-groups``) ranks a group of experts.
    ``topk-sum``: the sum of its top ``topk / group_topk`` scores (megatron-core, DeepSeek-V3).
    ``max``: its best expert's score (DeepSeek-V2's ``group_limited_greedy``)."""

    topk_sum = "topk-sum"
    max = "max"


class FarSkipMode(str, enum.Enum):
    """Which sub-block of a FarSkip layer reads an earlier activation. ``full``: attention reads
    the stream without the last routed-expert output and the MoE reads the pre-attention residual
    (the paper). ``attn-only``: only attention skips. ``mlp-only``: only the MoE skips."""

    full = "full"
    attn_only = "attn-only"
    mlp_only = "mlp-only"


class FarSkipImpl(str, enum.Enum):
    """``simple``: FarSkip connectivity with blocking collectives (reference, fine-tuning).
    ``overlapped``: the same math with dispatch/combine overlapping attention and the next layer."""

    simple = "simple"
    overlapped = "overlapped"


@dataclasses.dataclass
class ModelConfig:
    """A GPT decoder with MoE layers (megatron-core ``GPTModel``)."""

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    ffn_hidden_size: Optional[int] = None  # dense layers; default 4 x hidden
    seq_length: int = 256
    max_position_embeddings: Optional[int] = None  # default seq_length
    vocab_size: Optional[int] = None  # from the tokenizer when None
    make_vocab_size_divisible_by: int = 128
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = True
    position_embedding_type: str = "rope"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    untie_embeddings_and_output_weights: bool = True
    qk_layernorm: bool = False
    init_method_std: float = 0.02
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    bf16: bool = False
    transformer_impl: TransformerImpl = TransformerImpl.auto
    # multi-latent attention (DeepSeek-V2/V3)
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: RopeType = RopeType.rope  # yarn: DeepSeek-V2 context extension (MLA only)
    rotary_scaling_factor: float = 1.0  # yarn factor
    original_max_position_embeddings: Optional[int] = None  # yarn; default max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # MoE
    num_experts: Optional[int] = 8
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_layer_freq: Union[int, list] = 1
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: Optional[float] = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_group_score: RouterGroupScore = RouterGroupScore.topk_sum
    moe_router_enable_expert_bias: bool = False
    moe_router_dtype: Optional[str] = "fp32"
    moe_token_dispatcher_type: DispatcherType = DispatcherType.alltoall
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    # variants
    moe_variant: MoEVariant = MoEVariant.standard
    bigmac_ratio: Optional[float] = None
    moe_latent_size: Optional[int] = None
    bigmac_ffn_hidden_size: Optional[int] = None  # expert F; default (moe_ffn_hidden_size) / r
    farskip: str = "none"  # none | all | first:N | last:N | A-B (0-based layer indices, inclusive)
    farskip_impl: FarSkipImpl = FarSkipImpl.simple
    farskip_mode: FarSkipMode = FarSkipMode.full
    # overlapped FarSkip: the local experts' and the output layer's weight gradients run while a
    # later gradient all-to-all flies (moe_variants/common/wgrad.py); --no-farskip-defer-wgrad
    # computes them in place
    farskip_defer_wgrad: bool = True

    def __post_init__(self):
        for name, enum_type in (
            ("moe_token_dispatcher_type", DispatcherType),
            ("transformer_impl", TransformerImpl),
            ("moe_variant", MoEVariant),
            ("farskip_impl", FarSkipImpl),
            ("farskip_mode", FarSkipMode),
            ("rope_type", RopeType),
            ("moe_router_group_score", RouterGroupScore),
        ):
            value = getattr(self, name)
            if not isinstance(value, enum_type):
                try:
                    setattr(self, name, enum_type(value))
                except ValueError:
                    choices = ", ".join(m.value for m in enum_type)
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(f"{flag} {value!r} is not one of: {choices}") from None

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def resolved_latent_size(self) -> Optional[int]:
        """BigMac's low dimension r x h (None for the standard variant)."""
        if self.moe_variant != MoEVariant.bigmac:
            return None
        if self.moe_latent_size is not None:
            return self.moe_latent_size
        return int(round(self.bigmac_ratio * self.hidden_size))

    def resolved_bigmac_ffn(self) -> Optional[int]:
        """BigMac's expert intermediate size F: set, or the parameter-matching f / r."""
        if self.moe_variant != MoEVariant.bigmac:
            return None
        if self.bigmac_ffn_hidden_size is not None:
            return self.bigmac_ffn_hidden_size
        f = self.moe_ffn_hidden_size or self.ffn_hidden_size or 4 * self.hidden_size
        ratio = self.resolved_latent_size() / self.hidden_size
        import math

        return int(math.ceil(f / ratio))


@dataclasses.dataclass
class ParallelConfig:
    """Model-parallel layout; data parallelism is whatever remains of the world size."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    sequence_parallel: Optional[bool] = None  # None: on whenever TP > 1 (megatron-core requires it for MoE)

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    def resolved_sequence_parallel(self) -> bool:
        if self.sequence_parallel is None:
            return self.tensor_model_parallel_size > 1
        return self.sequence_parallel


def _moe_layer_pattern(model: ModelConfig) -> list[int]:
    freq = model.moe_layer_freq
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"--moe-layer-freq must be >= 1, got {freq}")
        return [1 if i % freq == 0 else 0 for i in range(model.num_layers)]
    if len(freq) != model.num_layers:
        raise ValueError(
            f"--moe-layer-freq lists {len(freq)} layers but --num-layers is {model.num_layers}"
        )
    if any(v not in (0, 1) for v in freq):
        raise ValueError("--moe-layer-freq as a list must contain only 0 (dense) and 1 (MoE)")
    return list(freq)


def moe_layer_pattern(model: ModelConfig) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per layer (megatron-core's ``moe_layer_freq``)."""
    if not model.is_moe:
        return [0] * model.num_layers
    return _moe_layer_pattern(model)


def validate(model: ModelConfig, parallel: ParallelConfig, world_size: Optional[int] = None) -> None:
    """Raise ``ValueError`` naming the first inconsistent setting."""
    tp = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    ep = parallel.expert_model_parallel_size
    etp = parallel.expert_tensor_parallel_size
    for name, value in (
        ("--tensor-model-parallel-size", tp),
        ("--pipeline-model-parallel-size", pp),
        ("--expert-model-parallel-size", ep),
        ("--expert-tensor-parallel-size", etp),
        ("--num-layers", model.num_layers),
        ("--hidden-size", model.hidden_size),
        ("--num-attention-heads", model.num_attention_heads),
        ("--seq-length", model.seq_length),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if model.num_attention_heads % tp:
        raise ValueError(
            f"--tensor-model-parallel-size {tp} does not divide --num-attention-heads "
            f"{model.num_attention_heads}"
        )
    groups = model.num_query_groups or model.num_attention_heads
    if model.num_attention_heads % groups:
        raise ValueError("--num-query-groups must divide --num-attention-heads")
    if groups % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} does not divide --num-query-groups {groups}")
    if model.num_layers % pp:
        raise ValueError(
            f"--pipeline-model-parallel-size {pp} does not divide --num-layers {model.num_layers}"
        )
    if model.is_moe:
        if model.num_experts % ep:
            raise ValueError(
                f"--expert-model-parallel-size {ep} does not divide --num-experts {model.num_experts}"
            )
        if not 1 <= model.moe_router_topk <= model.num_experts:
            raise ValueError(
                f"--moe-router-topk {model.moe_router_topk} must be between 1 and --num-experts "
                f"{model.num_experts}"
            )
        _moe_layer_pattern(model)
        _validate_router_groups(model)
        if model.moe_pad_expert_input_to_capacity and model.moe_expert_capacity_factor is None:
            raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if model.moe_variant == MoEVariant.bigmac:
            if model.moe_latent_size is None and model.bigmac_ratio is None:
                raise ValueError("--moe-variant bigmac needs --bigmac-ratio (or --moe-latent-size)")
            if model.bigmac_ratio is not None and not 0 < model.bigmac_ratio <= 1:
                raise ValueError(f"--bigmac-ratio must be in (0, 1], got {model.bigmac_ratio}")
            latent = model.resolved_latent_size()
            if latent < 1 or latent > model.hidden_size:
                raise ValueError(
                    f"--moe-latent-size {latent} must be between 1 and --hidden-size {model.hidden_size}"
                )
    else:
        if ep != 1:
            raise ValueError("--expert-model-parallel-size > 1 needs --num-experts")
        if model.moe_variant != MoEVariant.standard:
            raise ValueError(f"--moe-variant {model.moe_variant.value} needs --num-experts")
    if model.rope_type == RopeType.yarn:
        if not model.multi_latent_attention:
            raise ValueError("--rope-type yarn needs --multi-latent-attention")
        if model.rotary_scaling_factor <= 0:
            raise ValueError(f"--rotary-scaling-factor must be > 0, got {model.rotary_scaling_factor}")
    if model.farskip != "none":
        from moe_variants.farskip.connectivity import parse_farskip_layers

        parse_farskip_layers(model.farskip, model.num_layers)
    if ep > 1 and etp > 1 and model.moe_token_dispatcher_type == DispatcherType.alltoall:
        # the dispatcher's uneven all-gather over expert-TP (mappings.py:149-150) is not
        # supported by gloo; NCCL handles it
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                "--expert-tensor-parallel-size > 1 with --expert-model-parallel-size > 1 needs NCCL "
                "(gloo cannot all-gather uneven sizes); use --expert-tensor-parallel-size 1 on CPU"
            )
    if world_size is not None:
        if world_size % (tp * pp):
            raise ValueError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size x "
                f"--pipeline-model-parallel-size = {tp * pp}"
            )
        if (world_size // pp) % (ep * etp):
            raise ValueError(
                f"--expert-model-parallel-size x --expert-tensor-parallel-size = {ep * etp} does not "
                f"divide the {world_size // pp} ranks of a pipeline stage (world size {world_size})"
            )


def _validate_router_groups(model: ModelConfig) -> None:
    groups, group_topk = model.moe_router_num_groups, model.moe_router_group_topk
    if not group_topk:
        if model.moe_router_group_score != RouterGroupScore.topk_sum:
            raise ValueError("--moe-router-group-score needs --moe-router-num-groups and --moe-router-group-topk")
        return
    if not groups or model.num_experts % groups:
        raise ValueError(f"--moe-router-num-groups {groups} must divide --num-experts {model.num_experts}")
    if not 1 <= group_topk <= groups:
        raise ValueError(f"--moe-router-group-topk {group_topk} must be between 1 and --moe-router-num-groups {groups}")
    if model.moe_router_topk > group_topk * (model.num_experts // groups):
        raise ValueError(
            f"--moe-router-topk {model.moe_router_topk} exceeds the {group_topk * (model.num_experts // groups)} "
            "experts of the selected groups"
        )
