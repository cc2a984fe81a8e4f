"""Bad input: one ``error:`` line naming the problem, exit code 2, nothing written.

Also the other input forms: sharded safetensors (with an index) and pickle ``.bin`` behind
``--allow-pickle`` give the same checkpoint as a single safetensors file.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tools.spawn import run_distributed
from tests.convert import hf_models as H
from tests.convert.conftest import no_temporaries

PROG = "python -m distill.convert: error: "


def _import(hf_dir, out, *extra):
    return ["--from", "hf", "--hf-dir", hf_dir, "--to", "mcore", "--out", out, *extra]


def _edit_weights(hf_dir, edit):
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory):
    """{case: hf dir} of broken copies of a tiny Mixtral, plus a good one."""
    root = tmp_path_factory.mktemp("bad_input")
    good = H.make_hf_model(str(root / "good"), "mixtral", seed=3)

    def copy(name):
        return shutil.copytree(good, str(root / name))

    dirs = {"good": good, "absent": str(root / "absent")}
    dirs["no_config"] = copy("no_config")
    os.remove(os.path.join(dirs["no_config"], "config.json"))
    dirs["no_weights"] = copy("no_weights")
    os.remove(os.path.join(dirs["no_weights"], "model.safetensors"))
    dirs["unknown_family"] = copy("unknown_family")
    with open(os.path.join(dirs["unknown_family"], "config.json")) as f:
        cfg = json.load(f)
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    with open(os.path.join(dirs["unknown_family"], "config.json"), "w") as f:
        json.dump(cfg, f)
    dirs["missing_tensor"] = copy("missing_tensor")
    _edit_weights(dirs["missing_tensor"], lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight"))
    dirs["extra_tensor"] = copy("extra_tensor")
    _edit_weights(dirs["extra_tensor"], lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    dirs["wrong_shape"] = copy("wrong_shape")
    _edit_weights(dirs["wrong_shape"], lambda t: t.update(
        {"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    dirs["pickle"] = copy("pickle")
    torch.save(load_file(os.path.join(good, "model.safetensors")), os.path.join(dirs["pickle"], "pytorch_model.bin"))
    os.remove(os.path.join(dirs["pickle"], "model.safetensors"))
    dirs["bad_tokenizer"] = copy("bad_tokenizer")  # unreadable: it must not become a NullTokenizer silently
    with open(os.path.join(dirs["bad_tokenizer"], "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": ')
    dirs["no_tokenizer"] = copy("no_tokenizer")
    os.remove(os.path.join(dirs["no_tokenizer"], "tokenizer.json"))
    dirs["sharded"] = str(root / "sharded")
    model = H.load_hf_model(good, "mixtral")
    model.save_pretrained(dirs["sharded"], safe_serialization=True, max_shard_size="100KB")
    H.write_tokenizer(dirs["sharded"])
    dirs["lost_shard"] = shutil.copytree(dirs["sharded"], str(root / "lost_shard"))
    os.remove(os.path.join(dirs["lost_shard"], sorted(f for f in os.listdir(dirs["lost_shard"])
                                                     if f.endswith(".safetensors"))[-1]))
    return dirs


CASES = [
    ("absent", [], "--hf-dir {dir}: no such directory"),
    ("no_config", [], "--hf-dir {dir}: no config.json"),
    ("no_weights", [], "--hf-dir {dir}: no weights"),
    ("unknown_family", [], "config.json: model_type 'llama' is not a supported family (supported: deepseek_v2, "
                           "mixtral, qwen3_moe)"),
    ("missing_tensor", [], "--hf-dir {dir}: 1 missing: model.layers.1.block_sparse_moe.experts.3.w3.weight"),
    ("extra_tensor", [], "--hf-dir {dir}: 1 unexpected: model.layers.0.self_attn.q_proj.bias"),
    ("wrong_shape", [], "--hf-dir {dir}: 1 wrong shape: model.layers.0.self_attn.k_proj.weight (16, 64) "
                        "(expected (32, 64))"),
    ("pickle", [], "--hf-dir {dir} holds only pickle weights (pytorch_model.bin); pass --allow-pickle"),
    ("lost_shard", [], "model.safetensors.index.json: 1 shard file(s) missing"),
    ("bad_tokenizer", [], "--hf-dir {dir}: cannot read tokenizer.json (EOF while parsing a value at line 1 column "
                          "28): fix it, or remove it to convert without a tokenizer (token ids in and out)"),
    ("good", ["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide the "
                                                    "vocabulary size 256"),
    ("good", ["--expert-model-parallel-size", "3"], "--expert-model-parallel-size 3 does not divide "
                                                    "--num-experts 4"),
]


def test_bad_input_gives_one_line_and_writes_nothing(bad_dirs, tmp_path):
    runs = [_import(bad_dirs[case], str(tmp_path / f"out{i}"), *extra) for i, (case, extra, _) in enumerate(CASES)]
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    runs.append(_import(bad_dirs["good"], str(existing)))
    runs.append(["--from", "hf", "--to", "hf", "--out", str(tmp_path / "x")])
    runs.append(["--from", "mcore", "--load", str(tmp_path / "nothing"), "--to", "hf", "--out", str(tmp_path / "y")])
    results = run_distributed(H.cli_rank, 1, runs, timeout_s=240)[0]
    expected = [msg.format(dir=bad_dirs[case]) for case, _, msg in CASES] + [
        f"--out {existing} already exists; refusing to overwrite it",
        "--from hf --to hf: convert hf -> mcore or mcore -> hf",
        f"--load {tmp_path / 'nothing'}: no such directory",
    ]
    for (code, err), message in zip(results, expected):
        assert code == 2, (code, err)
        assert err.count("\n") == 1 and err.startswith(PROG), err
        assert message in err, (message, err)
    assert sorted(os.listdir(tmp_path)) == ["existing"]  # no output, no temporaries
    assert os.listdir(existing) == ["keep.txt"] and (existing / "keep.txt").read_text() == "mine"


def test_sharded_and_pickle_inputs_convert_like_a_single_file(bad_dirs, tmp_path):
    """Sharded safetensors and (with --allow-pickle) pytorch_model.bin give the same tensors; without
    a tokenizer.json the checkpoint gets a NullTokenizer of the model's vocabulary."""
    from megatron.components.checkpointing import find_latest_checkpoint, read_manifest

    outs = {name: str(tmp_path / name) for name in ("sharded", "pickle", "no_tokenizer")}
    flags = {"pickle": ["--allow-pickle"], "sharded": ["--expert-model-parallel-size", "2",
                                                     "--pipeline-model-parallel-size", "2"]}
    runs = [_import(bad_dirs[name], out, *flags.get(name, [])) for name, out in outs.items()]
    runs += [["--from", "mcore", "--load", out, "--to", "hf", "--out", out + "_hf"] for out in outs.values()]
    results = run_distributed(H.cli_rank, 1, runs, timeout_s=240)[0]
    assert [code for code, _ in results] == [0] * 6, results
    reference = load_file(os.path.join(bad_dirs["good"], "model.safetensors"))
    for out in outs.values():
        got = load_file(os.path.join(out + "_hf", "model.safetensors"))
        assert set(got) == set(reference)
        assert all(torch.equal(got[k], reference[k]) for k in reference)
    assert no_temporaries(tmp_path)
    manifest = read_manifest(find_latest_checkpoint(outs["sharded"]))  # target layout recorded, saved unsharded
    parallel = manifest["configs"]["parallel"]
    assert (parallel["expert_model_parallel_size"], parallel["pipeline_model_parallel_size"]) == (2, 2)
    assert manifest["layout"]["world_size"] == 1 and manifest["layout"]["expert_model_parallel_size"] == 1
    manifest = read_manifest(find_latest_checkpoint(outs["no_tokenizer"]))
    assert manifest["configs"]["tokenizer"] == {"type": "NullTokenizer", "vocab_size": 256}
    assert not os.path.exists(os.path.join(outs["no_tokenizer"] + "_hf", "tokenizer.json"))


def test_export_refuses_what_the_family_cannot_express():
    """FarSkip/BigMac checkpoints and settings a family has no key for are refused by name."""
    from megatron.components.arguments import configs_from_dict
    from distill.convert import families

    hf = json.loads(json.dumps(H.FAMILIES["mixtral"][2]))
    hf.update(model_type="mixtral", architectures=["MixtralForCausalLM"])
    fam = families.by_name("mixtral")
    fields = fam.model_config(hf)
    for overrides, message in [
        (dict(farskip="all"), "--farskip all: FarSkip connectivity has no MixtralForCausalLM equivalent"),
        (dict(moe_variant="bigmac", bigmac_ratio=0.5), "--moe-variant bigmac: BigMac layers have no"),
        (dict(qk_layernorm=True), "--qk-layernorm has no MixtralForCausalLM equivalent"),
        (dict(moe_router_pre_softmax=True), "MixtralForCausalLM renormalises its top-k weights"),
    ]:
        model = configs_from_dict({**fields, **overrides}).model
        with pytest.raises(ValueError, match=message):
            fam.hf_config(model, 256)
