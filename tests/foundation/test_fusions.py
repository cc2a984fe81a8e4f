"""megatron-core's fusions: all off on CPU; on GPU on wherever the kernel exists, except where a
rule of upstream's or a variant's needs keeps one off (the reasons are in ``builder.fusions``)."""

from __future__ import annotations

from moe_variants.builder import fusions, transformer_config
from moe_variants.config import ParallelConfig
from tests.helpers import tiny_model_config

ALL = {"rope": True, "permute": True, "router": True, "wgrad_accumulation": True}
NONE = {key: False for key in ALL}


def test_cpu_runs_unfused():
    f = fusions(tiny_model_config(swiglu=True), te=False, cuda=False, kernels=ALL)
    assert not any(f.values())
    config = transformer_config(tiny_model_config(), ParallelConfig())  # this machine: CPU
    assert not config.gradient_accumulation_fusion and not config.bias_dropout_fusion


def test_gpu_with_transformer_engine_takes_every_fusion():
    f = fusions(tiny_model_config(swiglu=True), te=True, cuda=True, kernels=ALL)
    assert all(f.values()), f


def test_gpu_without_kernels_keeps_the_torch_compiled_ones():
    f = fusions(tiny_model_config(swiglu=True), te=False, cuda=True, kernels=NONE)
    assert f["bias_activation_fusion"] and f["bias_dropout_fusion"]
    assert not any(v for k, v in f.items() if k not in ("bias_activation_fusion", "bias_dropout_fusion")), f


def test_what_keeps_a_fusion_off_on_gpu():
    assert not fusions(tiny_model_config(swiglu=False), te=True, cuda=True, kernels=ALL)["bias_activation_fusion"]
    mla = tiny_model_config(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8,
                            qk_pos_emb_head_dim=8, v_head_dim=8)
    assert not fusions(mla, te=True, cuda=True, kernels=ALL)["apply_rope_fusion"]
    grouped = tiny_model_config(moe_router_num_groups=2, moe_router_group_topk=1, moe_router_group_score="max")
    assert not fusions(grouped, te=True, cuda=True, kernels=ALL)["moe_router_fusion"]
    no_gaf = tiny_model_config(gradient_accumulation_fusion=False)
    assert not fusions(no_gaf, te=True, cuda=True, kernels=ALL)["gradient_accumulation_fusion"]
    # the local spec needs apex's kernel for the fused accumulation and TE for the MoE fusions
    local = fusions(tiny_model_config(), te=False, cuda=True, kernels=ALL)
    assert local["gradient_accumulation_fusion"] and not local["moe_permute_fusion"]
