"""HF -> ours -> HF gives back the same tensors (torch.equal, same names) and config."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.convert.conftest import no_temporaries


def _tensors(directory):
    return load_file(os.path.join(directory, "model.safetensors"))


@pytest.mark.parametrize("family,yarn", [("qwen3_moe", False), ("deepseek_v2", False), ("mixtral", False),
                                         ("deepseek_v2", True)])
def test_export_round_trip_is_tensor_identical(converted, family, yarn):
    c = converted(family, yarn=yarn)
    original, exported = _tensors(c.hf_dir), _tensors(c.exported)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    with open(os.path.join(c.hf_dir, "config.json")) as f:
        before = json.load(f)
    with open(os.path.join(c.exported, "config.json")) as f:
        after = json.load(f)
    for key in set(before) - {"transformers_version"}:
        assert after.get(key) == before[key], key
    for name in ("tokenizer.json", "tokenizer_config.json"):  # copied into the checkpoint and back
        with open(os.path.join(c.hf_dir, name), "rb") as a, open(os.path.join(c.exported, name), "rb") as b:
            assert a.read() == b.read(), name
    assert no_temporaries(os.path.dirname(c.exported))


def test_exported_directory_loads_in_transformers(converted):
    """The exported config.json and weights load with from_pretrained and give the original logits."""
    from tests.convert import hf_models as H

    c = converted("qwen3_moe")
    model = H.load_hf_model(c.exported, "qwen3_moe")
    with torch.no_grad():
        assert torch.equal(model(H.PROMPT).logits, c.ref_logits)


def test_checkpoint_records_source_and_layout_free_tokenizer(converted):
    from megatron.components.checkpointing import find_latest_checkpoint, read_manifest

    c = converted("mixtral")
    manifest = read_manifest(find_latest_checkpoint(c.ckpt))
    assert manifest["configs"]["hf_source"]["model_type"] == "mixtral"
    assert manifest["configs"]["tokenizer"] == {"type": "HuggingFaceTokenizer", "vocab_size": 256}
    assert manifest["configs"]["model"]["transformer_impl"] == "local"
    assert set(manifest["tokenizer_files"]) >= {"tokenizer_model", "hf:tokenizer_config.json"}


def test_checkpoint_loads_at_pipeline_parallel_2(converted):
    """Layout-free: the two PP=2 stages hold exactly the TP=1 tensors between them."""
    from tools.spawn import run_distributed
    from tests.convert import hf_models as H

    c = converted("deepseek_v2")
    ref = run_distributed(H.stage_state_rank, 1, c.ckpt, 1, timeout_s=240)[0]
    stages = run_distributed(H.stage_state_rank, 2, c.ckpt, 2, timeout_s=240)
    assert set(stages[0]).isdisjoint(stages[1])
    assert set(stages[0]) | set(stages[1]) == set(ref)
    for stage in stages:
        assert all(torch.equal(tensor, ref[name]) for name, tensor in stage.items())


@pytest.mark.parametrize("family,values", [
    ("mixtral", dict(num_query_groups=2, moe_router_pre_softmax=False)),
    ("qwen3_moe", dict(qk_layernorm=True, kv_channels=24, moe_layer_freq=[0, 1], moe_router_pre_softmax=True)),
])
def test_export_of_a_native_checkpoint_matches_transformers(tmp_path, family, values):
    """A checkpoint made here (no HF source config) exports to a directory transformers loads and
    runs to the same logits (atol 5e-5, as in test_parity)."""
    from tools.spawn import run_distributed
    from tests.convert import hf_models as H

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, seq_length=32,
                num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, transformer_impl="local",
                init_method_std=0.25, norm_epsilon=1e-6)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    ours = run_distributed(H.native_checkpoint_rank, 1, ckpt, {**base, **values}, timeout_s=240)[0]
    results = run_distributed(H.cli_rank, 1, [["--from", "mcore", "--load", ckpt, "--to", "hf", "--out", out,
                                               "--family", family]], timeout_s=240)[0]
    assert results[0][0] == 0, results
    model = H.load_hf_model(out, family)
    with torch.no_grad():
        torch.testing.assert_close(model(H.PROMPT).logits, ours, rtol=0, atol=5e-5)
