"""Mixtral (``MixtralForCausalLM``): GQA, every layer a sparse MoE of SwiGLU experts
(``w1`` gate, ``w3`` up, ``w2`` down), no shared expert.

Routing: softmax over all experts, top-k, weights renormalised over the k, which equals megatron's
top-k on the logits followed by a softmax over those k (``moe_router_pre_softmax: false``).
"""

from __future__ import annotations

from moe_variants.config import ModelConfig, moe_layer_pattern

from distill.convert import rules as R
from distill.convert.families.base import (
    Family,
    check_exportable,
    common_hf_fields,
    common_model_fields,
    get,
    refuse,
)


class Mixtral(Family):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    config_class = "MixtralConfig"

    def model_config(self, hf: dict) -> dict:
        name = self.model_type
        fields = common_model_fields(hf, name)
        window = hf.get("sliding_window")
        refuse(window is not None and int(window) < fields["max_position_embeddings"],
               f"config.json ({name}): sliding_window {window} is not supported (attention is full-context)")
        heads = fields["num_attention_heads"]
        ffn = int(get(hf, "intermediate_size", family=name))
        fields.update(
            num_query_groups=int(hf.get("num_key_value_heads") or heads),
            kv_channels=int(hf.get("head_dim") or fields["hidden_size"] // heads),
            ffn_hidden_size=ffn,
            qk_layernorm=False,
            num_experts=int(get(hf, "num_local_experts", family=name)),
            moe_router_topk=int(get(hf, "num_experts_per_tok", family=name)),
            moe_ffn_hidden_size=ffn,
            moe_layer_freq=1,
            moe_router_pre_softmax=False,
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
        )
        return fields

    def hf_config(self, model: ModelConfig, vocab_size: int) -> dict:
        check_exportable(model, self.architecture)
        refuse(model.multi_latent_attention, f"{self.architecture} has no multi-latent attention")
        refuse(model.qk_layernorm, f"--qk-layernorm has no {self.architecture} equivalent")
        refuse(not all(moe_layer_pattern(model)), f"{self.architecture} needs every layer to be MoE (--moe-layer-freq 1)")
        refuse(bool(model.moe_shared_expert_intermediate_size), f"{self.architecture} has no shared expert")
        refuse(model.moe_router_pre_softmax, f"{self.architecture} renormalises its top-k weights "
                                             "(needs --no-moe-router-pre-softmax)")
        refuse(bool(model.moe_router_topk_scaling_factor),
               f"--moe-router-topk-scaling-factor has no {self.architecture} equivalent")
        refuse(bool(model.moe_router_group_topk), f"group-limited routing has no {self.architecture} equivalent")
        default_head_dim = model.hidden_size // model.num_attention_heads
        return dict(
            common_hf_fields(model, vocab_size),
            num_key_value_heads=model.num_query_groups or model.num_attention_heads,
            # null means hidden / heads (MixtralConfig's default, kept for an exact round trip)
            head_dim=None if model.kv_channels in (None, default_head_dim) else model.kv_channels,
            intermediate_size=model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size,
            sliding_window=None,
            num_local_experts=model.num_experts,
            num_experts_per_tok=model.moe_router_topk,
            router_aux_loss_coef=model.moe_aux_loss_coeff,
        )

    def rules(self, model: ModelConfig) -> list:
        heads = model.num_attention_heads
        groups = model.num_query_groups or heads
        head_dim = model.kv_channels or model.hidden_size // heads
        ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
        out = R.embeddings_and_head(model.untie_embeddings_and_output_weights)
        for i in range(model.num_layers):
            ours, hf = R.OUR_LAYER.format(i=i) + "mlp.", R.HF_LAYER.format(i=i) + "block_sparse_moe."
            out += R.layer_norms(i) + R.gqa_attention(i, heads, groups, head_dim, qk_norm=False)
            out.append(R.copy(f"{ours}router.weight", f"{hf}gate.weight"))
            for e in range(model.num_experts):
                out += R.swiglu(f"{ours}experts.local_experts.{e}.", f"{hf}experts.{e}.", ffn, names=("w1", "w3", "w2"))
        return out


FAMILY = Mixtral()
