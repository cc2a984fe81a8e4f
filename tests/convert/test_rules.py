"""Pure pieces of the conversion: tensor rules, the family registry, config mapping, routing.

All comparisons here are exact (``torch.equal`` / equality): rules only concatenate and reshape,
and routing selections are index sets.
"""

import pytest
import torch

from distill.convert import families
from distill.convert import rules as R
from distill.convert.hf_mcore import vocab_multiple


def test_registry_discovers_every_family_module():
    assert set(families.all_families()) == {"qwen3_moe", "deepseek_v2", "mixtral"}
    assert families.by_name("mixtral").architecture == "MixtralForCausalLM"
    with pytest.raises(ValueError, match="--family 'llama' is not one of"):
        families.by_name("llama")


def test_unknown_model_type_and_wrong_architecture_are_refused():
    with pytest.raises(ValueError, match="model_type 'llama' is not a supported family"):
        families.for_hf_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="is not Qwen3MoeForCausalLM"):
        families.for_hf_config({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForSequenceClassification"]})


def test_fused_qkv_layout_is_megatrons_per_group_interleaving():
    """Rows of linear_qkv are, per query group: its query heads, its key head, its value head."""
    heads, groups, d, hidden = 4, 2, 3, 5
    q = torch.arange(heads * d * hidden, dtype=torch.float32).reshape(heads * d, hidden)
    k = -torch.arange(groups * d * hidden, dtype=torch.float32).reshape(groups * d, hidden) - 1
    v = 1000 + torch.arange(groups * d * hidden, dtype=torch.float32).reshape(groups * d, hidden)
    rule = R.fused_qkv("x", "q", "k", "v", heads, groups, d)
    fused = rule.join([q, k, v])
    per = heads // groups
    expected = torch.cat([torch.cat([q[g * per * d:(g + 1) * per * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]])
                          for g in range(groups)])
    assert torch.equal(fused, expected)
    assert all(torch.equal(a, b) for a, b in zip(rule.split(fused), (q, k, v)))
    assert R.hf_shapes(rule, fused.shape) == [(heads * d, hidden), (groups * d, hidden), (groups * d, hidden)]


def test_swiglu_fc1_is_gate_then_up():
    gate, up, down = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)
    fc1, fc2 = R.swiglu("m.", "h.", 6)
    assert torch.equal(fc1.join([gate, up]), torch.cat([gate, up]))
    assert all(torch.equal(a, b) for a, b in zip(fc1.split(torch.cat([gate, up])), (gate, up)))
    assert fc1.hf == ("h.gate_proj.weight", "h.up_proj.weight") and fc2.hf == ("h.down_proj.weight",)


def test_vocab_multiple_never_pads():
    assert vocab_multiple(256, 1) == 128
    assert vocab_multiple(151936, 2) == 64  # Qwen3: 151936 = 2^7 x 1187
    assert vocab_multiple(102400, 8) == 128  # DeepSeek-V2
    assert vocab_multiple(32000, 1) == 128  # Mixtral
    with pytest.raises(ValueError, match="does not divide the vocabulary size 32001"):
        vocab_multiple(32001, 2)


def _hf(family, **overrides):
    from tests.convert.hf_models import FAMILIES

    import transformers

    config_cls, _, kwargs = FAMILIES[family]
    return getattr(transformers, config_cls)(**{**kwargs, **overrides}).to_dict()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_config_round_trip(family):
    """HF config -> ModelConfig -> HF config reproduces every key the family maps."""
    from megatron.components.arguments import configs_from_dict

    fam = families.by_name(family)
    hf = _hf(family)
    model = configs_from_dict(fam.model_config(hf)).model
    back = fam.hf_config(model, hf["vocab_size"])
    for key, value in back.items():
        assert key in hf and hf[key] == value, (key, hf.get(key), value)


def test_deepseek_yarn_config_round_trip():
    from megatron.components.arguments import configs_from_dict
    from tests.convert.hf_models import DEEPSEEK_LITE_YARN

    fam = families.by_name("deepseek_v2")
    hf = _hf("deepseek_v2", **DEEPSEEK_LITE_YARN)
    model = configs_from_dict(fam.model_config(hf)).model
    assert model.rope_type.value == "yarn" and model.q_lora_rank is None and not model.moe_router_group_topk
    back = fam.hf_config(model, hf["vocab_size"])
    assert back["rope_scaling"] == {**hf["rope_scaling"], "type": "yarn", "rope_type": "yarn"}
    assert back["topk_method"] == "greedy" and back["routed_scaling_factor"] == 1.0


@pytest.mark.parametrize("family,overrides,match", [
    ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob true is not supported"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method 'noaux_tc' is not supported"),
    ("deepseek_v2", dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling type 'linear'"),
    ("qwen3_moe", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    ("qwen3_moe", dict(use_sliding_window=True), "use_sliding_window true is not supported"),
    ("mixtral", dict(sliding_window=16), "sliding_window 16 is not supported"),
])
def test_unsupported_settings_are_refused_by_name(family, overrides, match):
    hf = _hf(family)
    hf.update(overrides)
    with pytest.raises(ValueError, match=match):
        families.by_name(family).model_config(hf)


def test_group_max_topk_is_deepseek_v2_group_limited_greedy():
    """Our selection equals transformers' DeepseekV2MoEGate (group_limited_greedy); megatron-core's
    own group-limited top-k (groups ranked by top-2 sums) picks differently on the same scores."""
    import transformers
    from megatron.core.transformer.moe.moe_utils import group_limited_topk
    from moe_variants.features import group_max_topk
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MoEGate

    config = transformers.DeepseekV2Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=4,
                                           topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                           routed_scaling_factor=2.5)
    torch.manual_seed(0)
    gate = DeepseekV2MoEGate(config)
    torch.nn.init.normal_(gate.weight, std=1.0)
    hidden = torch.randn(1, 64, 16)
    hf_idx, hf_weight = gate(hidden)
    scores = torch.softmax(hidden.view(-1, 16) @ gate.weight.T, dim=-1)
    values, idx = group_max_topk(scores, 4, 4, 2)
    assert torch.equal(idx.sort(-1).values, hf_idx.sort(-1).values)
    order_hf, order_ours = hf_idx.argsort(-1), idx.argsort(-1)
    assert torch.equal(hf_weight.gather(1, order_hf), (values * 2.5).gather(1, order_ours))
    _, upstream = group_limited_topk(scores, 4, 64, 8, 4, 2)
    assert not torch.equal(upstream.sort(-1).values, hf_idx.sort(-1).values)
