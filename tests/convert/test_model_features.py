"""The model features conversion added (MLA on local modules, YaRN fields, group-max routing):
config validation, and the upstream flag the MLA-without-TE adaptation corrects (its upstream pins
are checked with the rest in tests/compat)."""

import importlib.util

import pytest

from moe_variants.config import ModelConfig, ParallelConfig, validate


def _moe(**overrides):
    return ModelConfig(**{**dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_experts=8,
                                 moe_router_topk=4, transformer_impl="local"), **overrides})


@pytest.mark.parametrize("overrides,message", [
    (dict(rope_type="yarn"), "--rope-type yarn needs --multi-latent-attention"),
    (dict(rope_type="ntk"), "--rope-type 'ntk' is not one of: rope, yarn"),
    (dict(multi_latent_attention=True, rope_type="yarn", rotary_scaling_factor=0.0),
     "--rotary-scaling-factor must be > 0"),
    (dict(moe_router_group_score="max"), "--moe-router-group-score needs --moe-router-num-groups"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "--moe-router-num-groups 3 must divide --num-experts 8"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=5), "--moe-router-group-topk 5 must be between 1"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=1), "--moe-router-topk 4 exceeds the 2 experts"),
])
def test_new_fields_are_validated_by_flag_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(_moe(**overrides), ParallelConfig())


def test_mla_without_te_flag_is_wrong_upstream_and_corrected():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine installed: the flag is right upstream")
    from megatron.compat.mla import apply_mla_without_te
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention

    assert not isinstance(te_ext.TELinear, type)  # the cause: a MagicMock stand-in, importable without TE
    apply_mla_without_te()
    assert multi_latent_attention.HAVE_TE is False
    assert apply_mla_without_te() is False  # idempotent
