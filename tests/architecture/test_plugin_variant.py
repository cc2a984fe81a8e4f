"""A fifth variant is one registration: a toy variant defined and registered here trains through
``pretrain_gpt``'s normal path at EP=2 without an edit anywhere else in the tree.

The toy scales every MoE layer's output by ``--moe-output-scale``. Its flag comes from its own
config section (parsed from the command line and stored in the checkpoint's configs), its
validation rejects a bad value in one line, and its ``apply`` hook changes the built model, so the
first step's loss differs from the same run without it (same seed, same data).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from tools.spawn import run_distributed
from moe_variants import registry
from moe_variants.registry import Variant, VariantConfig
from tests.helpers import SMALL_PRETRAIN_ARGS, read_jsonl

# trains through pretrain_gpt on two ranks
pytestmark = pytest.mark.slow


@dataclasses.dataclass
class ScaleConfig(VariantConfig):
    SECTION = "toy-scale"

    moe_output_scale: float = 1.0
    """multiply each MoE output"""


class ToyScale(Variant):
    name = "toy-scale"
    config = ScaleConfig
    bench_presets = {"toy-scale": {"moe_output_scale": 2.0}}
    off = {"moe_output_scale": 1.0}

    def enabled(self, model) -> bool:
        return self.section(model).moe_output_scale != 1.0

    def validate(self, model, parallel) -> None:
        if self.section(model).moe_output_scale <= 0:
            raise ValueError("--moe-output-scale must be > 0")

    def apply(self, gpt, model) -> None:
        from moe_variants.common.moe_layer import moe_layers

        scale = self.section(model).moe_output_scale
        for layer in moe_layers(gpt):
            layer.register_forward_hook(lambda mod, inp, out: (out[0] * scale, *out[1:]))


@pytest.fixture
def toy_variant():
    registry.register(ToyScale)
    yield
    registry.unregister("toy-scale")


def _pretrain(rank, world, argv):
    from megatron.training.pretrain_gpt import main

    return main([str(a) for a in argv])


def _run(tmp_path, name, extra):
    save = tmp_path / name
    argv = SMALL_PRETRAIN_ARGS + ["--train-iters", 1, "--expert-model-parallel-size", 2, "--save", save,
                                  "--save-interval", 1, "--data-cache-path", tmp_path / "cache", *extra]
    codes = run_distributed(_pretrain, 2, argv, timeout_s=240)
    return codes, save


def test_toy_variant_trains_through_pretrain_gpt(toy_variant, tmp_path):
    assert "toy-scale" in registry.config_sections()
    assert registry.preset_overrides("standard+toy-scale") == {"moe_variant": "standard", "farskip": "none",
                                                               "moe_output_scale": 2.0}
    codes, scaled = _run(tmp_path, "scaled", ["--moe-output-scale", 2.0])
    assert codes == [0, 0]
    codes, plain = _run(tmp_path, "plain", [])
    assert codes == [0, 0]
    loss = {name: [r for r in read_jsonl(path / "metrics.jsonl") if "event" not in r][0]["loss"]
            for name, path in (("scaled", scaled), ("plain", plain))}
    assert loss["scaled"] != loss["plain"]
    manifest = json.load(open(os.path.join(scaled, "iter_0000001", "manifest.json")))
    assert manifest["configs"]["toy-scale"] == {"moe_output_scale": 2.0}


def test_toy_variant_validation_is_one_line(toy_variant, tmp_path, capfd):
    codes, save = _run(tmp_path, "bad", ["--moe-output-scale", -1])
    assert codes == [2, 2]
    assert "pretrain_gpt: error: --moe-output-scale must be > 0" in capfd.readouterr().err
    assert not os.path.exists(save / "iter_0000001")
