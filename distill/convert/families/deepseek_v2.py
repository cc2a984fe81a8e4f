"""DeepSeek-V2 / V2-Lite (``DeepseekV2ForCausalLM``): multi-latent attention, routed + shared
SwiGLU experts, the first ``first_k_dense_replace`` layers dense.

Attention. HF and megatron-core store the same matrices in the same row order:
``kv_a_proj_with_mqa`` = [latent (kv_lora_rank); shared rope key (qk_rope_head_dim)] is
``linear_kv_down_proj``; ``kv_b_proj`` rows are per head [nope key; value] as ``linear_kv_up_proj``;
``q_b_proj`` (or ``q_proj``) rows are per head [nope; rope] as ``linear_q_up_proj``
(``linear_q_proj``); ``q_a_layernorm``/``kv_a_layernorm`` are the q/kv norms (``qk_layernorm``; in a
Transformer Engine layer they are ``linear_q/kv_up_proj.layer_norm_weight``). HF rotates the rope
dims as interleaved complex pairs (2j, 2j+1); megatron-core's MLA de-interleaves q_pe and k_pe
(``rope_utils.py:119-122``) and rotates halves, which pairs the same dims with the same frequency,
so no weight permutation is needed (q.k is unchanged by the common reordering).

YaRN (``rope_scaling.type: yarn``) maps to megatron-core's ``YarnRotaryEmbedding`` and its softmax
scale ``mscale(factor, mscale_all_dim)^2 / sqrt(q_head_dim)``, as DeepSeek's own modeling code does.
transformers 4.57 omits that softmax factor for DeepSeek-V2 (fixed upstream in
huggingface/transformers#47435), so for YaRN configs its logits differ from the original model's.

Routing: softmax over all experts, top-k (``greedy``) or top-k within the ``topk_group`` groups of
highest maximum score (``group_limited_greedy``, our ``moe_router_group_score: max``), weights
times ``routed_scaling_factor``, not renormalised (``norm_topk_prob: false``; transformers 4.57
ignores ``norm_topk_prob`` while DeepSeek's code renormalises, so ``true`` is refused).
"""

from __future__ import annotations

from moe_variants.config import ModelConfig, RopeType, RouterGroupScore, moe_layer_pattern

from distill.convert import rules as R
from distill.convert.families.base import (
    Family,
    check_exportable,
    common_hf_fields,
    common_model_fields,
    get,
    layer_freq,
    optional_int,
    refuse,
)


class DeepseekV2(Family):
    model_type = "deepseek_v2"
    architecture = "DeepseekV2ForCausalLM"
    config_class = "DeepseekV2Config"

    def model_config(self, hf: dict) -> dict:
        name = self.model_type
        fields = common_model_fields(hf, name)
        heads, layers = fields["num_attention_heads"], fields["num_layers"]
        kv_heads = hf.get("num_key_value_heads") or heads
        refuse(int(kv_heads) != heads, f"config.json ({name}): num_key_value_heads {kv_heads} != "
                                       f"num_attention_heads {heads} is not a DeepSeek-V2 attention")
        refuse(int(hf.get("moe_layer_freq", 1)) != 1, f"config.json ({name}): moe_layer_freq != 1 is not supported")
        refuse(bool(hf.get("norm_topk_prob", False)),
               f"config.json ({name}): norm_topk_prob true is not supported (transformers ignores it, "
               "DeepSeek's code renormalises; no released DeepSeek-V2 sets it)")
        first_dense = int(hf.get("first_k_dense_replace", 0))
        moe_ffn = int(get(hf, "moe_intermediate_size", family=name))
        shared = hf.get("n_shared_experts")
        scaling = float(hf.get("routed_scaling_factor", 1.0))
        fields.update(
            ffn_hidden_size=int(get(hf, "intermediate_size", family=name)),
            multi_latent_attention=True,
            qk_layernorm=True,
            q_lora_rank=optional_int(hf.get("q_lora_rank")),
            kv_lora_rank=int(get(hf, "kv_lora_rank", family=name)),
            qk_head_dim=int(get(hf, "qk_nope_head_dim", family=name)),
            qk_pos_emb_head_dim=int(get(hf, "qk_rope_head_dim", family=name)),
            v_head_dim=int(get(hf, "v_head_dim", family=name)),
            num_experts=int(get(hf, "n_routed_experts", family=name)),
            moe_router_topk=int(get(hf, "num_experts_per_tok", family=name)),
            moe_ffn_hidden_size=moe_ffn,
            moe_shared_expert_intermediate_size=int(shared) * moe_ffn if shared else None,
            moe_layer_freq=layer_freq([int(i >= first_dense) for i in range(layers)]),
            moe_router_pre_softmax=True,
            moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
            moe_aux_loss_coeff=float(hf.get("aux_loss_alpha", 0.001)),
            moe_router_load_balancing_type="seq_aux_loss" if hf.get("seq_aux", True) else "aux_loss",
        )
        fields.update(_routing_groups(hf, name))
        fields.update(_rope(hf, name))
        return fields

    def hf_config(self, model: ModelConfig, vocab_size: int) -> dict:
        check_exportable(model, self.architecture)
        refuse(not model.multi_latent_attention, f"{self.architecture} needs --multi-latent-attention")
        refuse(not model.qk_layernorm, f"{self.architecture} normalises its latents (needs --qk-layernorm)")
        refuse(not model.moe_router_pre_softmax, f"{self.architecture} does not renormalise its top-k weights "
                                                 "(needs --moe-router-pre-softmax)")
        pattern = moe_layer_pattern(model)
        first_dense = pattern.index(1) if 1 in pattern else len(pattern)
        refuse(pattern != [0] * first_dense + [1] * (len(pattern) - first_dense),
               f"{self.architecture} needs its dense layers first (--moe-layer-freq {model.moe_layer_freq})")
        moe_ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
        shared = model.moe_shared_expert_intermediate_size
        refuse(bool(shared) and shared % moe_ffn != 0, f"--moe-shared-expert-intermediate-size {shared} is not a "
                                                       f"multiple of the expert size {moe_ffn}")
        grouped = bool(model.moe_router_group_topk)
        refuse(grouped and model.moe_router_group_score != RouterGroupScore.max,
               f"{self.architecture} ranks expert groups by their best expert (needs --moe-router-group-score max)")
        out = dict(
            common_hf_fields(model, vocab_size),
            attention_bias=False,
            num_key_value_heads=model.num_attention_heads,
            intermediate_size=model.ffn_hidden_size or 4 * model.hidden_size,
            q_lora_rank=model.q_lora_rank,
            kv_lora_rank=model.kv_lora_rank,
            qk_nope_head_dim=model.qk_head_dim,
            qk_rope_head_dim=model.qk_pos_emb_head_dim,
            v_head_dim=model.v_head_dim,
            first_k_dense_replace=first_dense,
            n_routed_experts=model.num_experts,
            n_shared_experts=shared // moe_ffn if shared else None,
            num_experts_per_tok=model.moe_router_topk,
            moe_intermediate_size=moe_ffn,
            routed_scaling_factor=float(model.moe_router_topk_scaling_factor or 1.0),
            norm_topk_prob=False,
            topk_method="group_limited_greedy" if grouped else "greedy",
            aux_loss_alpha=model.moe_aux_loss_coeff,
            seq_aux=model.moe_router_load_balancing_type == "seq_aux_loss",
            mlp_bias=False,
            rope_scaling=None,
        )
        if grouped:  # greedy routing ignores n_group/topk_group (V2-Lite ships 1/1): left as they were
            out.update(n_group=model.moe_router_num_groups, topk_group=model.moe_router_group_topk)
        if model.rope_type == RopeType.yarn:
            out["rope_scaling"] = dict(
                type="yarn", rope_type="yarn", factor=model.rotary_scaling_factor,
                original_max_position_embeddings=model.original_max_position_embeddings,
                beta_fast=model.beta_fast, beta_slow=model.beta_slow,
                mscale=model.mscale, mscale_all_dim=model.mscale_all_dim,
            )
        return out

    def rules(self, model: ModelConfig) -> list:
        moe_ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
        out = R.embeddings_and_head(model.untie_embeddings_and_output_weights)
        for i, moe in enumerate(moe_layer_pattern(model)):
            ours, hf = R.OUR_LAYER.format(i=i), R.HF_LAYER.format(i=i)
            out += R.layer_norms(i) + _attention(ours + "self_attention.", hf + "self_attn.", model)
            ours, hf = ours + "mlp.", hf + "mlp."
            if not moe:
                out += R.swiglu(ours, hf, model.ffn_hidden_size or 4 * model.hidden_size)
                continue
            out.append(R.copy(f"{ours}router.weight", f"{hf}gate.weight"))
            for e in range(model.num_experts):
                out += R.swiglu(f"{ours}experts.local_experts.{e}.", f"{hf}experts.{e}.", moe_ffn)
            if model.moe_shared_expert_intermediate_size:
                out += R.swiglu(f"{ours}shared_experts.", f"{hf}shared_experts.",
                                model.moe_shared_expert_intermediate_size)
        return out


def _attention(ours: str, hf: str, model: ModelConfig) -> list:
    if model.q_lora_rank is None:
        rules = [R.copy(f"{ours}linear_q_proj.weight", f"{hf}q_proj.weight")]
    else:
        rules = [R.copy(f"{ours}linear_q_down_proj.weight", f"{hf}q_a_proj.weight"),
                 R.copy(f"{ours}q_layernorm.weight", f"{hf}q_a_layernorm.weight"),
                 R.copy(f"{ours}linear_q_up_proj.weight", f"{hf}q_b_proj.weight")]
    return rules + [
        R.copy(f"{ours}linear_kv_down_proj.weight", f"{hf}kv_a_proj_with_mqa.weight"),
        R.copy(f"{ours}kv_layernorm.weight", f"{hf}kv_a_layernorm.weight"),
        R.copy(f"{ours}linear_kv_up_proj.weight", f"{hf}kv_b_proj.weight"),
        R.copy(f"{ours}linear_proj.weight", f"{hf}o_proj.weight"),
    ]


def _routing_groups(hf: dict, name: str) -> dict:
    method = hf.get("topk_method", "greedy")
    if method == "greedy":
        return dict(moe_router_num_groups=None, moe_router_group_topk=None)
    refuse(method != "group_limited_greedy",
           f"config.json ({name}): topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    groups, group_topk = hf.get("n_group"), hf.get("topk_group")
    refuse(not groups or not group_topk, f"config.json ({name}): group_limited_greedy needs n_group and topk_group")
    return dict(moe_router_num_groups=int(groups), moe_router_group_topk=int(group_topk),
                moe_router_group_score=RouterGroupScore.max.value)


def _rope(hf: dict, name: str) -> dict:
    scaling = hf.get("rope_scaling")
    if scaling is None:
        return dict(rope_type=RopeType.rope.value)
    kind = scaling.get("rope_type", scaling.get("type"))
    refuse(kind != "yarn", f"config.json ({name}): rope_scaling type {kind!r} is not supported (yarn)")
    refuse(scaling.get("attention_factor") is not None,
           f"config.json ({name}): rope_scaling.attention_factor is not supported")
    refuse(scaling.get("truncate", True) is not True, f"config.json ({name}): rope_scaling.truncate false "
                                                      "is not supported")
    return dict(
        rope_type=RopeType.yarn.value,
        rotary_scaling_factor=float(get(scaling, "factor", family=f"{name} rope_scaling")),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings")
                                             or hf["max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        mscale=float(scaling.get("mscale", 1.0)),
        mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)),
    )


FAMILY = DeepseekV2()
