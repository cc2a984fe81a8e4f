"""Qwen3-MoE (``Qwen3MoeForCausalLM``): GQA with per-head RMSNorm on q and k (QK-norm), routed
SwiGLU experts without a shared expert, optional dense layers (``mlp_only_layers``,
``decoder_sparse_step``).

Routing: softmax over all experts, top-k, and with ``norm_topk_prob`` the k weights renormalised.
Renormalised softmax-top-k equals megatron's top-k on the logits then softmax
(``moe_router_pre_softmax: false``); without renormalisation it is megatron's pre-softmax top-k.
"""

from __future__ import annotations

from moe_variants.config import ModelConfig, moe_layer_pattern

from distill.convert import rules as R
from distill.convert.families.base import (
    Family,
    check_exportable,
    common_hf_fields,
    common_model_fields,
    dense_layers,
    get,
    layer_freq,
    refuse,
)


class Qwen3MoE(Family):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    config_class = "Qwen3MoeConfig"

    def model_config(self, hf: dict) -> dict:
        name = self.model_type
        refuse(hf.get("rope_scaling") is not None, f"config.json ({name}): rope_scaling is not supported")
        refuse(bool(hf.get("use_sliding_window", False)),
               f"config.json ({name}): use_sliding_window true is not supported")
        fields = common_model_fields(hf, name)
        num_experts = int(get(hf, "num_experts", family=name))
        refuse(num_experts < 1, f"config.json ({name}): num_experts {num_experts} is not an MoE model")
        step = int(hf.get("decoder_sparse_step", 1))
        mlp_only = set(hf.get("mlp_only_layers") or [])
        pattern = [int(i not in mlp_only and (i + 1) % step == 0) for i in range(fields["num_layers"])]
        heads = fields["num_attention_heads"]
        fields.update(
            num_query_groups=int(hf.get("num_key_value_heads") or heads),
            kv_channels=int(hf.get("head_dim") or fields["hidden_size"] // heads),
            ffn_hidden_size=int(get(hf, "intermediate_size", family=name)),
            qk_layernorm=True,
            num_experts=num_experts,
            moe_router_topk=int(get(hf, "num_experts_per_tok", family=name)),
            moe_ffn_hidden_size=int(get(hf, "moe_intermediate_size", family=name)),
            moe_layer_freq=layer_freq(pattern),
            moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", False)),
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
        )
        return fields

    def hf_config(self, model: ModelConfig, vocab_size: int) -> dict:
        check_exportable(model, self.architecture)
        refuse(model.multi_latent_attention, f"{self.architecture} has no multi-latent attention")
        refuse(not model.qk_layernorm, f"{self.architecture} needs --qk-layernorm (its q_norm/k_norm)")
        refuse(bool(model.moe_shared_expert_intermediate_size), f"{self.architecture} has no shared expert")
        refuse(bool(model.moe_router_topk_scaling_factor),
               f"--moe-router-topk-scaling-factor has no {self.architecture} equivalent")
        refuse(bool(model.moe_router_group_topk), f"group-limited routing has no {self.architecture} equivalent")
        return dict(
            common_hf_fields(model, vocab_size),
            attention_bias=False,
            num_key_value_heads=model.num_query_groups or model.num_attention_heads,
            head_dim=model.kv_channels or model.hidden_size // model.num_attention_heads,
            intermediate_size=model.ffn_hidden_size or 4 * model.hidden_size,
            rope_scaling=None,
            use_sliding_window=False,
            decoder_sparse_step=1,
            mlp_only_layers=dense_layers(model),
            num_experts=model.num_experts,
            num_experts_per_tok=model.moe_router_topk,
            moe_intermediate_size=model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size,
            norm_topk_prob=not model.moe_router_pre_softmax,
            router_aux_loss_coef=model.moe_aux_loss_coeff,
        )

    def rules(self, model: ModelConfig) -> list:
        heads = model.num_attention_heads
        groups = model.num_query_groups or heads
        head_dim = model.kv_channels or model.hidden_size // heads
        moe_ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
        out = R.embeddings_and_head(model.untie_embeddings_and_output_weights)
        for i, moe in enumerate(moe_layer_pattern(model)):
            ours, hf = R.OUR_LAYER.format(i=i) + "mlp.", R.HF_LAYER.format(i=i) + "mlp."
            out += R.layer_norms(i) + R.gqa_attention(i, heads, groups, head_dim, qk_norm=True)
            if moe:
                out.append(R.copy(f"{ours}router.weight", f"{hf}gate.weight"))
                for e in range(model.num_experts):
                    out += R.swiglu(f"{ours}experts.local_experts.{e}.", f"{hf}experts.{e}.", moe_ffn)
            else:
                out += R.swiglu(ours, hf, model.ffn_hidden_size or 4 * model.hidden_size)
        return out


FAMILY = Qwen3MoE()
