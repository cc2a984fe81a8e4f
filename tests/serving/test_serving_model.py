"""The typed change a variant makes to a served model (``registry.ServingModel``)."""

from __future__ import annotations

import argparse

import pytest
import torch

from moe_variants import registry


class _Rows:
    name = "toy-rows"

    def local_rows(self, layer, num_real):
        return torch.ones(num_real, dtype=torch.bool)


class _ServesRows(registry.Variant):
    name = "toy-serving"
    change = None

    def serving_model(self, args, manifest, model, pg_collection):
        return self.change


@pytest.fixture
def serving_variant():
    registry.register(_ServesRows)
    yield registry.get("toy-serving")
    registry.unregister("toy-serving")


def test_serving_model_is_typed(serving_variant):
    """The server reads a variant's change through ``registry.ServingModel`` (its ``name`` and
    ``local_rows``): a conforming object passes, anything else is refused at the hook, and Sem-MoE's
    Algorithm 3 state is one."""
    from moe_variants.semmoe.attention_tp import AttentionTP

    args = argparse.Namespace(tensor_model_parallel_size=1, semmoe_tables=None)
    assert registry.serving_model(args, {}, None, None) is None
    serving_variant.change = _Rows()
    assert registry.serving_model(args, {}, None, None) is serving_variant.change
    serving_variant.change = object()
    with pytest.raises(TypeError, match="toy-serving: serving_model returned a object, not a registry.ServingModel"):
        registry.serving_model(args, {}, None, None)
    assert registry.ServingModel in AttentionTP.__mro__ and AttentionTP.name == "semmoe-algorithm-3"
