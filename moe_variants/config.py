"""Dataclass configs for the model and its parallel layout (YAML/flags only at the edges).

Field names are Megatron-LM's flag names with ``-`` -> ``_`` so a user's ``--moe-router-topk 8``
and a YAML ``moe_router_topk: 8`` land on the same field; the docstring under a field is its flag's
help (``megatron.common.fielddocs``). ``validate`` checks a config against a world size once, raising
``UserError`` (a ``ValueError``) that names the offending setting.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from typing import Optional, Union

from megatron.common.cli import user_input


@functools.lru_cache(maxsize=None)
def _enum_fields(cls) -> tuple:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) is Union and len(args) == 1:
            hint = args[0]
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            out.append((f.name, hint))
    return tuple(out)


def plain(value):
    """A config value as YAML/JSON stores it: enum members by value, typed values (e.g. FarSkip's
    layer selection) by their ``to_config()``."""
    if isinstance(value, enum.Enum):
        return value.value
    if hasattr(value, "to_config"):
        return value.to_config()
    return value


def plain_fields(obj, skip: tuple = ()) -> dict:
    """``{field: plain value}`` of a config dataclass."""
    return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name not in skip}


def coerce_enums(obj) -> None:
    """Turn the plain values of a config dataclass's enum-typed fields into members (YAML and flags
    give strings); ``ValueError`` naming the flag and its choices otherwise. Every config uses this."""
    for name, enum_type in _enum_fields(type(obj)):
        value = getattr(obj, name)
        if value is None or isinstance(value, enum_type):
            continue
        try:
            setattr(obj, name, enum_type(value))
        except ValueError:
            choices = ", ".join(m.value for m in enum_type)
            raise ValueError(f"--{name.replace('_', '-')} {value!r} is not one of: {choices}") from None


class Choice(str, enum.Enum):
    """A config choice: a ``str`` enum that compares, hashes, formats and prints as its value (what
    YAML, flags and checkpoints store), so messages and megatron-core read the plain string."""

    def __str__(self) -> str:
        return self.value


class Normalization(Choice):
    """The normalisation layers."""

    rmsnorm = "RMSNorm"
    layernorm = "LayerNorm"


class PositionEmbeddingType(Choice):
    """Position information: rotary embeddings, a learned absolute table, or none."""

    rope = "rope"
    learned_absolute = "learned_absolute"
    none = "none"


class LoadBalancingType(Choice):
    """The router's load-balancing loss (megatron-core's names): per batch, per sequence, over the
    global batch, Sinkhorn routing, or none."""

    aux_loss = "aux_loss"
    seq_aux_loss = "seq_aux_loss"
    global_aux_loss = "global_aux_loss"
    sinkhorn = "sinkhorn"
    none = "none"


class RouterScoreFunction(Choice):
    """How the router turns logits into expert scores."""

    softmax = "softmax"
    sigmoid = "sigmoid"


class RouterDtype(Choice):
    """The router's compute precision."""

    fp32 = "fp32"
    fp64 = "fp64"


class TokenDropPolicy(Choice):
    """Which tokens an expert over capacity drops: the lowest routing probabilities, or the last."""

    probs = "probs"
    position = "position"


class MoELayer(str):
    """``--moe-variant``: the class of the MoE layers, resolved through the variant registry.

    ``standard`` is the project's MoE layer (no variant owns it); any other value is the
    ``moe_layer`` of exactly one registered variant (e.g. ``bigmac``), its ``owner``. Configs, YAML
    and checkpoints store the name, so every checkpoint (``moe_variant: standard`` or a variant's
    name, before or after the registry) reads the same; it compares and prints as the name.
    """

    @classmethod
    def parse(cls, value) -> "MoELayer":
        """The choice named by ``value``; ``ValueError`` naming ``--moe-variant`` and the choices."""
        if isinstance(value, MoELayer):
            return value
        from moe_variants import registry

        choices = registry.moe_layer_choices()
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"--moe-variant {value!r} is not one of: {', '.join(choices)}")
        return cls(value)

    @property
    def owner(self):
        """The registered variant whose MoE layer this is (``registry.moe_layer_owner``), or None."""
        from moe_variants import registry

        return registry.moe_layer_owner(self)

    def to_config(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"MoELayer({str.__str__(self)!r})"


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


class AttentionBackend(Choice):
    """``--attention-backend``, Megatron-LM's flag and values. With Transformer Engine they pick TE's
    kernels as in Megatron-LM. On the local spec (``moe_variants/attention.py``): ``local`` is
    megatron-core's ``DotProductAttention`` (the reference: the full score matrix, softmax, a second
    matmul); the others run torch's ``scaled_dot_product_attention``: ``flash`` its FlashAttention
    kernel (a CPU one too), ``fused`` cuDNN then memory-efficient attention (TE's fused attention is
    cuDNN's), ``unfused`` its math reference, ``auto`` cuDNN, FlashAttention, memory-efficient on
    Hopper and newer (torchtitan's order), FlashAttention first elsewhere; the math kernel is every
    choice's fallback where no kernel takes the inputs, and the log line says so."""

    flash = "flash"
    fused = "fused"
    unfused = "unfused"
    local = "local"
    auto = "auto"


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


@dataclasses.dataclass
class ModelConfig:
    """A GPT decoder with MoE layers (megatron-core ``GPTModel``)."""

    num_layers: int = 4
    """transformer layers"""
    hidden_size: int = 128
    """model (residual stream) width"""
    num_attention_heads: int = 4
    """attention heads"""
    num_query_groups: Optional[int] = None
    """key/value head groups (grouped-query attention); default: one per head"""
    kv_channels: Optional[int] = None
    """per-head dimension; default: hidden size / heads"""
    ffn_hidden_size: Optional[int] = None
    """FFN width of the dense layers; default: 4 x hidden size"""
    seq_length: int = 256
    """tokens per training sequence"""
    max_position_embeddings: Optional[int] = None
    """longest position the model supports; default: --seq-length"""
    vocab_size: Optional[int] = None
    """vocabulary size (NullTokenizer); default: the tokenizer's"""
    make_vocab_size_divisible_by: int = 128
    """pad the embedding's vocabulary to a multiple of this"""
    normalization: Normalization = Normalization.rmsnorm
    """RMSNorm or LayerNorm"""
    norm_epsilon: float = 1e-5
    """epsilon of the normalisation layers"""
    swiglu: bool = True
    """SwiGLU activation in the FFNs and experts"""
    position_embedding_type: PositionEmbeddingType = PositionEmbeddingType.rope
    """rope, learned_absolute, or none"""
    rotary_base: int = 10000
    """RoPE base"""
    rotary_percent: float = 1.0
    """fraction of each head's dimensions that RoPE rotates"""
    untie_embeddings_and_output_weights: bool = True
    """separate input embedding and output layer weights"""
    qk_layernorm: bool = False
    """normalise queries and keys before attention"""
    init_method_std: float = 0.02
    """standard deviation of the weight initialisation"""
    attention_dropout: float = 0.0
    """dropout on attention probabilities"""
    hidden_dropout: float = 0.0
    """dropout on the residual branches"""
    bf16: bool = False
    """train in bfloat16 (mixed precision with fp32 master weights)"""
    transformer_impl: TransformerImpl = TransformerImpl.auto
    """local: megatron-core's torch modules; transformer_engine: TE modules (GPU); auto: TE when importable
    with a GPU"""
    attention_backend: AttentionBackend = AttentionBackend.auto
    """core attention: auto, flash, fused, unfused (torch scaled_dot_product_attention kernels on the local
    spec; Transformer Engine's with TE) or local (megatron-core's DotProductAttention, the reference)"""
    gradient_accumulation_fusion: bool = True
    """fused weight-gradient accumulation into DDP's main_grad (GPU, with Transformer Engine or apex);
    --no-gradient-accumulation-fusion for a backward without DDP"""
    moe_grouped_gemm: bool = True
    """routed experts as grouped GEMMs (torch grouped_mm; TEGroupedMLP with Transformer Engine) where the
    kernel runs, else megatron-core's SequentialMLP loop; --no-moe-grouped-gemm for the loop"""
    multi_latent_attention: bool = False
    """multi-latent attention (DeepSeek-V2/V3)"""
    q_lora_rank: Optional[int] = None
    """MLA: query low-rank dimension (none: full-rank queries)"""
    kv_lora_rank: int = 32
    """MLA: key/value low-rank dimension"""
    qk_head_dim: int = 128
    """MLA: query/key head dimension without the rotary part"""
    qk_pos_emb_head_dim: int = 64
    """MLA: rotary part of the query/key head dimension"""
    v_head_dim: int = 128
    """MLA: value head dimension"""
    rope_type: RopeType = RopeType.rope
    """MLA rotary embedding: rope, or yarn (DeepSeek-V2 context extension)"""
    rotary_scaling_factor: float = 1.0
    """yarn: context extension factor"""
    original_max_position_embeddings: Optional[int] = None
    """yarn: the pre-extension context; default: --max-position-embeddings"""
    beta_fast: float = 32.0
    """yarn: beta_fast"""
    beta_slow: float = 1.0
    """yarn: beta_slow"""
    mscale: float = 1.0
    """yarn: mscale"""
    mscale_all_dim: float = 0.0
    """yarn: mscale_all_dim"""
    # MoE
    num_experts: Optional[int] = 8
    """routed experts per MoE layer (unset: a dense model)"""
    moe_router_topk: int = 2
    """experts each token is routed to"""
    moe_ffn_hidden_size: Optional[int] = None
    """FFN width of each routed expert; default: --ffn-hidden-size"""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """FFN width of the shared expert (unset: none)"""
    moe_layer_freq: Union[int, list] = 1
    """MoE layer pattern: every N-th layer, or a per-layer list like [0,1,1,1] (0 dense, 1 MoE)"""
    moe_aux_loss_coeff: float = 0.01
    """load-balancing auxiliary loss coefficient"""
    moe_z_loss_coeff: Optional[float] = None
    """router z-loss coefficient"""
    moe_router_load_balancing_type: LoadBalancingType = LoadBalancingType.aux_loss
    """aux_loss, seq_aux_loss, global_aux_loss, sinkhorn or none"""
    moe_router_score_function: RouterScoreFunction = RouterScoreFunction.softmax
    """softmax or sigmoid"""
    moe_router_pre_softmax: bool = False
    """softmax before the top-k (else over the selected experts)"""
    moe_router_topk_scaling_factor: Optional[float] = None
    """scale applied to the routing weights"""
    moe_router_num_groups: Optional[int] = None
    """group-limited routing: expert groups"""
    moe_router_group_topk: Optional[int] = None
    """group-limited routing: groups each token may use"""
    moe_router_group_score: RouterGroupScore = RouterGroupScore.topk_sum
    """how group-limited routing ranks a group: topk-sum or max"""
    moe_router_enable_expert_bias: bool = False
    """aux-loss-free balancing bias on the expert scores"""
    moe_router_dtype: Optional[RouterDtype] = RouterDtype.fp32
    """router compute dtype (fp32, fp64)"""
    moe_token_dispatcher_type: DispatcherType = DispatcherType.alltoall
    """how tokens reach their experts: all-to-all among EP ranks, or all-gather"""
    moe_expert_capacity_factor: Optional[float] = None
    """expert capacity as a multiple of the balanced load (unset: dropless)"""
    moe_pad_expert_input_to_capacity: bool = False
    """pad every expert's input to its capacity"""
    moe_token_drop_policy: TokenDropPolicy = TokenDropPolicy.probs
    """which tokens a full expert drops: probs or position"""
    # variants (moe_variants/registry.py): which MoE layer class (``standard`` or a variant's, e.g.
    # ``bigmac``: a registry-resolved MoELayer), and each registered variant's config section by name;
    # the sections' fields are flags of their own (``--bigmac-ratio``, ``--farskip``, ...)
    moe_variant: MoELayer = MoELayer("standard")
    """the MoE layer class: standard, or a registered variant's"""
    variants: dict = dataclasses.field(default_factory=dict, metadata={"cli": False})

    def __post_init__(self):
        coerce_enums(self)
        self.moe_variant = MoELayer.parse(self.moe_variant)
        from moe_variants import registry

        sections = registry.config_sections()
        for name, section in self.variants.items():
            if name not in sections or not isinstance(section, sections[name]):
                raise ValueError(f"ModelConfig.variants[{name!r}] is not the {name} variant's config section")

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @classmethod
    def from_flat(cls, values: dict) -> "ModelConfig":
        """A ``ModelConfig`` from one flat dict of flag values, the variants' fields included (e.g.
        ``{"num_layers": 2, "farskip": "all"}``): each key goes to the section that owns it."""
        from moe_variants import registry

        own = {f.name for f in dataclasses.fields(cls)} - {"variants"}
        sections = registry.config_sections()
        owner = {f.name: name for name, sec in sections.items() for f in dataclasses.fields(sec)}
        core, per_section = {}, {name: {} for name in sections}
        for key, value in values.items():
            if key in own:
                core[key] = value
            elif key in owner:
                per_section[owner[key]][key] = value
            else:
                raise ValueError(f"unknown option: --{key.replace('_', '-')}")
        try:
            built = {name: sections[name](**kw) for name, kw in per_section.items() if kw}
        except TypeError as e:
            raise ValueError(f"bad value in variant options: {e}") from None
        return cls(**core, variants=built)

    @classmethod
    def from_dump(cls, configs: dict) -> "ModelConfig":
        """The ``ModelConfig`` of a stored config dump (``{section: {field: value}}``, as checkpoint
        manifests keep it): the ``model`` section plus the variants' sections. Dumps written before
        the variants had sections keep their fields in ``model``; both read the same. Fields a dump
        lacks because it predates them get the values it was written with
        (``registry.stored_defaults``)."""
        from moe_variants import registry

        values = dict(configs.get("model", {}))
        for name in registry.config_sections():
            values.update(configs.get(name, {}))
        values.update(registry.stored_defaults(values))
        return cls.from_flat(values)

    def flat(self) -> dict:
        """One flat ``{flag field: plain value}`` of the model and its variants' sections (the inverse
        of ``from_flat``)."""
        out = {}
        for section in self.dump().values():
            out.update(section)
        return out

    def dump(self) -> dict:
        """``{section: {field: value}}`` of the model and its variants' sections (JSON-serialisable;
        every registered variant's section is written, with its defaults when the model has none)."""
        from moe_variants import registry

        out = {"model": plain_fields(self, skip=("variants",))}
        for name, cls in registry.config_sections().items():
            out[name] = plain_fields(self.variants.get(name) or cls())
        return out


@dataclasses.dataclass
class ParallelConfig:
    """Model-parallel layout; data parallelism is whatever remains of the world size."""

    tensor_model_parallel_size: int = 1
    """tensor-parallel size (TP)"""
    pipeline_model_parallel_size: int = 1
    """pipeline-parallel stages (PP)"""
    expert_model_parallel_size: int = 1
    """expert-parallel size (EP): ranks the experts are spread over"""
    expert_tensor_parallel_size: int = 1
    """tensor-parallel size inside each expert"""
    sequence_parallel: Optional[bool] = None
    """sequence parallelism; default: on whenever TP > 1 (megatron-core requires it for MoE training; the
    server turns it off)"""

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


@user_input()
def validate(model: ModelConfig, parallel: ParallelConfig, world_size: Optional[int] = None) -> None:
    """Raise ``UserError`` naming the first inconsistent setting (the variants' checks included)."""
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
    else:
        if ep != 1:
            raise ValueError("--expert-model-parallel-size > 1 needs --num-experts")
        if model.moe_variant.owner is not None:
            raise ValueError(f"--moe-variant {model.moe_variant} needs --num-experts")
    if model.rope_type == RopeType.yarn:
        if not model.multi_latent_attention:
            raise ValueError("--rope-type yarn needs --multi-latent-attention")
        if model.rotary_scaling_factor <= 0:
            raise ValueError(f"--rotary-scaling-factor must be > 0, got {model.rotary_scaling_factor}")
    if ep > 1 and etp > 1 and model.moe_token_dispatcher_type == DispatcherType.alltoall:
        # the dispatcher's uneven all-gather over expert-TP (mappings.py:149-150) is not
        # supported by gloo; NCCL handles it
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                "--expert-tensor-parallel-size > 1 with --expert-model-parallel-size > 1 needs NCCL "
                "(gloo cannot all-gather uneven sizes); use --expert-tensor-parallel-size 1 on CPU"
            )
    from moe_variants import registry

    for variant in registry.enabled(model):
        variant.validate(model, parallel)
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
