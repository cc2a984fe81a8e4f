"""The model config's choices: enums and the registry-resolved MoE layer, with every stored form
still reading the same.

Checkpoint manifests and YAML keep plain strings (``moe_variant: standard``, ``normalization:
RMSNorm``, ...). They load into enum members and a ``MoELayer`` whose owner the registry
resolves, and dump back to the same strings, so a checkpoint written by any earlier version
compares equal to its reload. Exact comparisons: no numerics involved.
"""

from __future__ import annotations

import json
import os

import pytest

from moe_variants import registry
from moe_variants.config import (
    LoadBalancingType,
    ModelConfig,
    MoELayer,
    Normalization,
    PositionEmbeddingType,
    RouterDtype,
    RouterScoreFunction,
    TokenDropPolicy,
)
from moe_variants.registry import Variant

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "ckpt_v1_bigmac_farskip", "iter_0000002", "manifest.json")
STORED = {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
          "moe_router_load_balancing_type": "seq_aux_loss", "moe_router_score_function": "sigmoid",
          "moe_router_dtype": "fp64", "moe_token_drop_policy": "position"}


@pytest.mark.parametrize("moe_variant,owner", [("standard", None), ("bigmac", "bigmac")])
def test_stored_strings_load_as_choices_and_dump_unchanged(moe_variant, owner):
    dump = {"model": {**STORED, "moe_variant": moe_variant}}
    model = ModelConfig.from_dump(dump)
    assert isinstance(model.moe_variant, MoELayer) and model.moe_variant == moe_variant
    assert (model.moe_variant.owner.name if model.moe_variant.owner else None) == owner
    assert [v.name for v in registry.enabled(model) if v.moe_layer] == ([owner] if owner else [])
    assert (model.normalization, model.position_embedding_type, model.moe_router_load_balancing_type,
            model.moe_router_score_function, model.moe_router_dtype, model.moe_token_drop_policy) == (
        Normalization.layernorm, PositionEmbeddingType.learned_absolute, LoadBalancingType.seq_aux_loss,
        RouterScoreFunction.sigmoid, RouterDtype.fp64, TokenDropPolicy.position)
    again = model.dump()["model"]
    assert {k: again[k] for k in dump["model"]} == dump["model"]
    assert all(type(again[k]) is str for k in dump["model"])  # JSON/YAML see plain strings
    assert f"{model.normalization} {model.moe_variant}" == f"LayerNorm {moe_variant}"


def test_the_pre_registry_fixture_manifest_resolves_its_moe_layer():
    """The checkpoint of tests/training/test_old_checkpoint.py (written before the registry)."""
    with open(FIXTURE) as f:
        configs = json.load(f)["configs"]
    model = ModelConfig.from_dump(configs)
    assert model.moe_variant.owner is registry.get("bigmac")
    assert model.dump()["model"]["moe_variant"] == configs["model"]["moe_variant"] == "bigmac"


@pytest.mark.parametrize("field,value", [("moe_variant", "nosuch"), ("moe_variant", 3),
                                         ("normalization", "rmsnorm"), ("moe_router_dtype", "bf16")])
def test_a_bad_choice_names_the_flag(field, value):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} .* is not one of"):
        ModelConfig(**{field: value})


def test_a_moe_layer_has_one_owner():
    """Two variants cannot own the same ``--moe-variant`` value, and none can own ``standard``."""

    class Twin(Variant):
        name = "twin-of-bigmac"
        moe_layer = "bigmac"

    class Standard(Variant):
        name = "owns-standard"
        moe_layer = "standard"

    registry.variants()  # the built-ins are registered
    for cls, message in ((Twin, "already the bigmac variant's"), (Standard, "project's own MoE layer")):
        with pytest.raises(ValueError, match=message):
            registry.register(cls)
        assert cls.name not in [v.name for v in registry.variants()]
