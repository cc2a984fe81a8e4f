"""Build a megatron-core ``GPTModel`` with the project's MoE layers from a ``ModelConfig``.

The spec comes from megatron-core's own ``get_gpt_decoder_block_spec`` (local or Transformer
Engine modules, dense-first patterns from ``moe_layer_freq``); the builder swaps in the project's
MoE layer, router and (local spec) grouped-GEMM experts (``common/experts.py``), then lets every enabled variant (``moe_variants.registry``) change each MoE
layer's spec and, once built, the model. It names no variant.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
import torch.nn.functional as F

from megatron import compat  # first: its import quiets megatron-core's import-time notices
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from moe_variants import registry
from moe_variants.attention import mark_causal, sdpa_attention_class
from moe_variants.common.experts import RoutedExperts
from moe_variants.common.moe_layer import ProjectMoELayer, ProjectRouter
from moe_variants.config import (AttentionBackend, ModelConfig, ParallelConfig, RouterGroupScore, TransformerImpl,
                                 plain, validate)
from moe_variants.features import GroupMaxRouter, MLADotProductAttention
from moe_variants.norms import TorchNorm

__all__ = [
    "build_model",
    "transformer_config",
    "fusions",
    "use_transformer_engine",
    "padded_vocab_size",
    "causal_attention_mask",
]


class _SubclassMLPWarningFilter(logging.Filter):
    """Drop megatron-core's "Unknown MLP type" warning for our ``MoELayer`` subclasses.

    ``TransformerLayer`` only recognises ``MoELayer`` itself when deciding to pass
    ``pg_collection`` (``transformer_layer.py:352``); our specs pass it through ``params``.
    """

    def filter(self, record):
        return "Unknown MLP type" not in record.getMessage()


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_SubclassMLPWarningFilter())


def use_transformer_engine(model: ModelConfig) -> bool:
    """Resolve ``--transformer-impl``: TE needs both the package and a GPU."""
    if model.transformer_impl == TransformerImpl.local:
        return False
    available = compat.have_transformer_engine() and torch.cuda.is_available()
    if model.transformer_impl == TransformerImpl.transformer_engine:
        if not available:
            raise ValueError(
                "--transformer-impl transformer_engine needs a GPU and Transformer Engine "
                "(pip install -e '.[gpu]'); use --transformer-impl local on CPU"
            )
        return True
    return available


def padded_vocab_size(vocab_size: int, model: ModelConfig, parallel: ParallelConfig) -> int:
    """Megatron-LM's padding: a multiple of ``make_vocab_size_divisible_by x TP``."""
    multiple = model.make_vocab_size_divisible_by * parallel.tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


# ModelConfig fields that megatron-core's TransformerConfig takes under the same name, unchanged
_SAME_NAME = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "normalization", "qk_layernorm", "init_method_std", "attention_dropout", "hidden_dropout", "bf16")
_SAME_NAME_MOE = (
    "moe_router_topk", "moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_aux_loss_coeff",
    "moe_z_loss_coeff", "moe_router_load_balancing_type", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_enable_expert_bias", "moe_router_dtype", "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
)
_SAME_NAME_MLA = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rotary_base",
                  "rotary_scaling_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_SAME_NAME_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                       "expert_tensor_parallel_size")


def _copy(obj, names) -> dict:
    """The fields as megatron-core takes them: enum choices as their plain strings."""
    return {name: plain(getattr(obj, name)) for name in names}


def _available_kernels() -> dict:
    """Which fused kernels this machine has, as megatron-core itself resolved them at import
    (``sites.FUSION_SITES``): each is ``None``/absent/False when TE or apex is missing."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import moe_utils

    permute = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
               "fused_sort_chunks_by_index_with_probs", "fused_unpermute")
    return {
        "rope": getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None,
        "permute": all(getattr(moe_utils, name, None) is not None for name in permute),
        "router": getattr(moe_utils, "fused_topk_with_score_function", None) is not None,
        "wgrad_accumulation": bool(getattr(layers, "_grad_accum_fusion_available", False)),
    }


def fusions(model: ModelConfig, te: bool, *, cuda: Optional[bool] = None, kernels: Optional[dict] = None) -> dict:
    """megatron-core's fusion flags: on GPU, on wherever the kernel exists (its fast path, the
    baseline every variant is compared with); on CPU all off (torch-only code paths: the fused
    kernels need CUDA, and ``jit_fuser`` is ``torch.compile``, which compat disables on CPU).

    ``cuda`` and ``kernels`` (see ``_available_kernels``) default to this machine's.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        return dict(bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                    apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
                    moe_permute_fusion=False, moe_router_fusion=False)
    kernels = _available_kernels() if kernels is None else kernels
    return dict(
        # torch-compiled bias+SwiGLU; upstream refuses the GeLU fusion without a linear bias
        # (transformer_config.py:1491-1499) and our linears have none
        bias_activation_fusion=model.swiglu,
        bias_dropout_fusion=True,  # torch-compiled bias+dropout+add
        # fused softmax and persistent layer norm are apex/TE kernels; TE's attention and norms
        # replace both, so they only matter with TE
        masked_softmax_fusion=te,
        persist_layer_norm=te,
        # upstream calls the fused MLA RoPE experimental and rejects it for non-YARN MLA
        # (transformer_config.py:2068-2069): MLA keeps the unfused RoPE
        apply_rope_fusion=kernels["rope"] and not model.multi_latent_attention,
        gradient_accumulation_fusion=model.gradient_accumulation_fusion and (te or kernels["wgrad_accumulation"]),
        moe_permute_fusion=kernels["permute"] and te,
        # the fused top-k bypasses routing replay, through which --moe-router-group-score max
        # selects its groups (features.GroupMaxRouter): that router keeps the unfused top-k
        moe_router_fusion=(kernels["router"] and te and model.moe_router_group_score != RouterGroupScore.max),
    )


def transformer_config(model: ModelConfig, parallel: ParallelConfig):
    """The megatron-core ``TransformerConfig`` (or ``MLATransformerConfig``) for our configs."""
    validate(model, parallel)
    te = use_transformer_engine(model)
    dtype = torch.bfloat16 if model.bf16 else torch.float32
    kwargs = dict(
        **_copy(model, _SAME_NAME),
        **_copy(parallel, _SAME_NAME_PARALLEL),
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        sequence_parallel=parallel.resolved_sequence_parallel(),
        use_cpu_initialization=not torch.cuda.is_available(),
        # Transformer Engine's kernels by Megatron-LM's flag; the local spec picks its core attention
        # class instead (_local_attention) and leaves megatron-core's value, which then only sets
        # TE's environment switches, at its default
        attention_backend=AttnBackend[model.attention_backend.value] if te else AttnBackend.auto,
        **fusions(model, te),
    )
    if model.is_moe:
        kwargs.update(
            **_copy(model, _SAME_NAME_MOE),
            num_moe_experts=model.num_experts,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size or kwargs["ffn_hidden_size"],
            moe_token_dispatcher_type=model.moe_token_dispatcher_type.value,
            moe_grouped_gemm=te and model.moe_grouped_gemm,  # TE's TEGroupedMLP (the local path: _experts)
            moe_shared_expert_overlap=False,
        )
    if model.multi_latent_attention:
        from megatron.compat.mla import apply_mla_without_te

        apply_mla_without_te()
        kwargs.update(
            **_copy(model, _SAME_NAME_MLA),
            rope_type=model.rope_type.value,
            original_max_position_embeddings=(
                model.original_max_position_embeddings or model.max_position_embeddings or model.seq_length
            ),
        )
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


# Local MLA layers keep q/kv norms as modules; Transformer Engine fuses them into the up-projections.
# Checkpoints use the fused names either way (as megatron-core's local GPT spec does for its norms).
_LOCAL_MLA_KEYS_MAP = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}


def _local_attention(spec, model: ModelConfig, te: bool, norm):
    """Local-module attention: q/k/kv norms that support sequence parallelism (``norm``), and the
    core attention ``--attention-backend`` names: torch's scaled_dot_product_attention
    (``moe_variants/attention.py``), or for ``local`` megatron-core's ``DotProductAttention`` (for
    MLA the subclass that takes MLA's k/v channels, ``features.py``)."""
    attn = spec.submodules.self_attention
    if te or not isinstance(attn, ModuleSpec):
        return spec
    changes = {
        name: norm(getattr(attn.submodules, name))
        for name in ("q_layernorm", "k_layernorm", "kv_layernorm")
        if hasattr(attn.submodules, name)
    }
    keys_map = dict(spec.submodules.sharded_state_dict_keys_map)
    if attn.submodules.core_attention is DotProductAttention:
        if model.attention_backend != AttentionBackend.local:
            changes["core_attention"] = sdpa_attention_class(model.attention_backend)
        elif model.multi_latent_attention:
            changes["core_attention"] = MLADotProductAttention
        if model.multi_latent_attention and model.qk_layernorm:
            keys_map.update(_LOCAL_MLA_KEYS_MAP)
    attn = ModuleSpec(
        module=attn.module, params=attn.params, metainfo=attn.metainfo,
        submodules=dataclasses.replace(attn.submodules, **changes),
    )
    sub = dataclasses.replace(spec.submodules, self_attention=attn, sharded_state_dict_keys_map=keys_map)
    return ModuleSpec(module=spec.module, params=spec.params, submodules=sub, metainfo=spec.metainfo)


def _experts(spec, model: ModelConfig, te: bool):
    """The local spec's routed experts: ``RoutedExperts`` (grouped GEMMs where the kernel runs,
    megatron-core's ``SequentialMLP`` otherwise, on the same submodules); TE's experts unchanged."""
    if te or not isinstance(spec, ModuleSpec) or spec.module is not SequentialMLP:
        return spec
    return ModuleSpec(module=RoutedExperts, params={**spec.params, "grouped": model.moe_grouped_gemm},
                      submodules=spec.submodules)


def _project_block_spec(config, model: ModelConfig, pg_collection, te: bool, pp_rank=None, upstream_moe=False):
    router = GroupMaxRouter if model.moe_router_group_score == RouterGroupScore.max else ProjectRouter
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization=plain(model.normalization), pp_rank=pp_rank
    )
    if upstream_moe:
        return block
    variants = registry.enabled(model)

    def norm(module):
        # sequence parallelism with torch norms (apex absent): see moe_variants/norms.py
        return TorchNorm if module is WrappedTorchNorm else module

    layer_specs = []
    for spec in block.layer_specs:
        sub = spec.submodules
        sub = dataclasses.replace(
            sub, input_layernorm=norm(sub.input_layernorm), pre_mlp_layernorm=norm(sub.pre_mlp_layernorm)
        )
        spec = ModuleSpec(module=spec.module, params=spec.params, submodules=sub, metainfo=spec.metainfo)
        spec = _local_attention(spec, model, te, norm)
        mlp = spec.submodules.mlp
        if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
            mlp = ModuleSpec(
                module=ProjectMoELayer,
                params={**mlp.params, "pg_collection": pg_collection},
                submodules=dataclasses.replace(mlp.submodules, router=router,
                                               experts=_experts(mlp.submodules.experts, model, te)),
                metainfo=mlp.metainfo,
            )
            for variant in variants:
                mlp = variant.moe_layer_spec(mlp, model)
            spec = ModuleSpec(
                module=spec.module,
                params=spec.params,
                submodules=dataclasses.replace(spec.submodules, mlp=mlp),
                metainfo=spec.metainfo,
            )
        layer_specs.append(spec)
    return dataclasses.replace(block, layer_specs=layer_specs, layer_norm=norm(block.layer_norm))


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    vocab_size: Optional[int] = None,
    pg_collection=None,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    upstream_moe: bool = False,
    config_overrides: Optional[dict] = None,
):
    """Build the ``GPTModel`` for this rank's pipeline stage (on CPU or the current GPU).

    ``vocab_size`` is the tokenizer's (padded here); it overrides ``model.vocab_size``.
    Call ``megatron.components.parallel.initialize_parallel`` first.

    ``upstream_moe`` builds megatron-core's own spec unchanged (its ``MoELayer``, router and token
    dispatcher; no project layer, no variant), and ``config_overrides`` sets ``TransformerConfig``
    fields after the mapping (validated by megatron-core): what a plain megatron-core user runs,
    for the EP benchmark's upstream peers (``tools/bench/peers/mcore.py``).
    """
    compat.apply()
    vocab = vocab_size if vocab_size is not None else model.vocab_size
    if vocab is None:
        raise ValueError("the vocabulary size is unknown: give a tokenizer or --vocab-size")
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel.pipeline_model_parallel_size
    if pre_process is None:
        pre_process = pp_rank == 0
    if post_process is None:
        post_process = pp_rank == pp_size - 1
    config = transformer_config(model, parallel)
    if config_overrides:
        unknown = sorted(k for k in config_overrides if not hasattr(config, k))
        if unknown:
            raise ValueError(f"TransformerConfig has no field(s) {', '.join(unknown)}")
        config = dataclasses.replace(config, **config_overrides)
    te = use_transformer_engine(model)
    spec = _project_block_spec(config, model, pg_collection, te, pp_rank=pp_rank, upstream_moe=upstream_moe)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(vocab, model, parallel),
        max_sequence_length=model.max_position_embeddings or model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=plain(model.position_embedding_type),
        rotary_percent=model.rotary_percent,
        rotary_base=model.rotary_base,
        pg_collection=pg_collection,
    )
    for variant in [] if upstream_moe else registry.enabled(model):
        variant.apply(gpt, model)
    if torch.cuda.is_available() and next(gpt.parameters()).device.type != "meta":  # a meta build stays shapes only
        gpt.cuda(torch.cuda.current_device())
    return gpt


def causal_attention_mask(seq_length: int, device=None) -> torch.Tensor:
    """[1, 1, S, S] bool, True where attention is masked (megatron-core's convention).

    Always passed explicitly: megatron-core's default mask is built with ``device="cuda"``
    (``transformer/utils.py:35``). The mask is recorded as causal (``attention.mark_causal``), so
    the SDPA attention runs its causal kernels without reading it.
    """
    return mark_causal(torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), 1)[None, None])
