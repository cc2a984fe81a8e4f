"""Hugging Face directory <-> our checkpoint, in one process.

``import_hf`` builds our model (megatron-core local modules, TP=1/EP=1) from the family's
``ModelConfig``, fills every parameter from the HF tensors through the family's rules, and saves a
weights-only checkpoint (``checkpointing.save_checkpoint``: atomic, manifest, tokenizer files copied).
Our checkpoints are layout-free (``dist_checkpointing`` reshards on load), so the requested
TP/EP/PP layout is validated against the model and recorded as the checkpoint's parallel config
(``loading.load_model`` then defaults to it) while the tensors are written once, unsharded.
``export_hf`` loads a checkpoint at TP=1/EP=1, gathers its layout-free state dict and writes
``config.json`` + ``model.safetensors`` (+ the tokenizer files).

Nothing is written before every name and shape has been checked; outputs go to a temporary sibling
directory renamed into place, and an existing output is never touched.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from typing import Optional

import torch

from megatron.common.cli import user_input
from megatron.components.parallel import single_process_group
from distill.convert import families
from distill.convert.hf_io import TOKENIZER_FILES, check_new_output, open_weights, read_config, write_hf_dir
from distill.convert.rules import hf_shapes

__all__ = ["import_hf", "export_hf", "vocab_multiple", "TensorMismatch", "HF_SOURCE"]

# manifest["configs"][HF_SOURCE] = {"model_type": ..., "hf_config": {...}}: the imported config,
# reused on export for the keys our configs do not carry (token ids, generation defaults...)
HF_SOURCE = "hf_source"
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
_MAX_NAMES = 5


class TensorMismatch(ValueError):
    """Missing, unexpected or mis-shaped tensors; the message is one line, the lists are complete."""

    def __init__(self, where: str, missing: list, unexpected: list, misshaped: list):
        self.missing, self.unexpected, self.misshaped = missing, unexpected, misshaped
        parts = []
        for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)):
            if names:
                shown = ", ".join(names[:_MAX_NAMES]) + (f" (+{len(names) - _MAX_NAMES} more)"
                                                         if len(names) > _MAX_NAMES else "")
                parts.append(f"{len(names)} {label}: {shown}")
        super().__init__(f"{where}: " + "; ".join(parts))


def vocab_multiple(vocab_size: int, tensor_parallel: int) -> int:
    """``make_vocab_size_divisible_by`` such that the model's vocabulary is exactly ``vocab_size``
    at TP=1 and at ``tensor_parallel`` (padding rows would join the softmax and change logits)."""
    if vocab_size % tensor_parallel:
        raise ValueError(
            f"--tensor-model-parallel-size {tensor_parallel} does not divide the vocabulary size {vocab_size} "
            "(megatron would pad the output layer, which changes the softmax)"
        )
    multiple = 128
    while multiple > 1 and vocab_size % (multiple * tensor_parallel):
        multiple //= 2
    return multiple


def _check_tensors(where: str, rules, our_shapes: dict, available: dict, vocab_size: int, ignored) -> None:
    """Every HF name a rule needs is present with the shape our model implies, and nothing else."""
    expected: dict[str, tuple] = {}
    for rule in rules:
        shape = tuple(our_shapes[rule.ours])
        if rule.ours in _VOCAB_PARAMS:
            shape = (vocab_size,) + shape[1:]
        expected.update(zip(rule.hf, hf_shapes(rule, shape)))
    missing = [n for n in expected if n not in available]
    unexpected = sorted(n for n in available if n not in expected and not ignored(n))
    misshaped = [f"{n} {tuple(available[n])} (expected {expected[n]})"
                 for n in expected if n in available and tuple(available[n]) != expected[n]]
    if missing or unexpected or misshaped:
        raise TensorMismatch(where, missing, unexpected, misshaped)


def _check_coverage(where: str, rules, our_names) -> None:
    """Every one of our tensors has exactly one rule (missing: tensors no rule makes)."""
    covered = [r.ours for r in rules]
    missing = sorted(set(our_names) - set(covered))
    unexpected = sorted(set(covered) - set(our_names))
    if missing or unexpected:
        raise TensorMismatch(where, missing, unexpected, [])


def _model_dtype(dtype: torch.dtype, where: str) -> torch.dtype:
    if dtype in (torch.float32, torch.bfloat16):
        return dtype
    if dtype == torch.float16:
        return torch.float32  # no fp16 models here; fp32 holds fp16 values exactly
    raise ValueError(f"{where}: weights of dtype {dtype} are not supported (float32, bfloat16, float16)")


def _tokenizer(hf_dir: str, vocab_size: int):
    """(tokenizer files {role: path}, tokenizer info) for the checkpoint manifest.

    ``tokenizer.json`` becomes the checkpoint's tokenizer when ``megatron.components.tokenizer`` can
    load it; without one, or without an end-of-document token in it (a warning), the checkpoint gets a
    ``NullTokenizer`` of the model's vocabulary (ids in, ids out) and the files are still copied for
    export. A ``tokenizer.json`` that cannot be read is an error (``ValueError``), never a
    ``NullTokenizer``: the converted model would otherwise lose its tokenizer unnoticed.
    """
    from tokenizers import Tokenizer

    from megatron.common.cli import one_line
    from megatron.components.tokenizer import HFTokenizer

    files = {f"hf:{name}": os.path.join(hf_dir, name) for name in TOKENIZER_FILES
             if os.path.isfile(os.path.join(hf_dir, name))}
    null = {"type": "NullTokenizer", "vocab_size": vocab_size}
    if "hf:tokenizer.json" not in files:
        return files, null
    try:
        Tokenizer.from_file(files["hf:tokenizer.json"])
    except Exception as e:  # the tokenizers library raises a bare Exception (its Rust error)
        raise ValueError(f"--hf-dir {hf_dir}: cannot read tokenizer.json ({one_line(e)}): fix it, or remove it "
                         "to convert without a tokenizer (token ids in and out)") from None
    try:
        HFTokenizer.from_file(files["hf:tokenizer.json"])
    except ValueError as e:
        print(f"warning: {e}; the checkpoint gets a NullTokenizer of {vocab_size} ids", file=sys.stderr)
        return files, null
    files["tokenizer_model"] = files.pop("hf:tokenizer.json")
    return files, {"type": "HuggingFaceTokenizer", "vocab_size": vocab_size}


def import_hf(hf_dir: str, out: str, *, tensor_parallel: int = 1, expert_parallel: int = 1,
              pipeline_parallel: int = 1, allow_pickle: bool = False) -> str:
    """Convert a Hugging Face model directory to our checkpoint at ``out``. Returns ``out``."""
    from megatron.components.arguments import configs_from_dict, configs_to_dict
    from megatron.components.checkpointing import layout_of, save_checkpoint
    from moe_variants.config import ParallelConfig, validate
    from moe_variants.builder import build_model
    from moe_variants.global_state import local_weights
    from megatron.components.parallel import initialize_parallel

    with user_input():  # the HF directory, the output path and the requested layout
        check_new_output(out)
        hf = read_config(hf_dir)
        family = families.for_hf_config(hf)
        fields = family.model_config(hf)
        weights = open_weights(hf_dir, allow_pickle=allow_pickle)
        dtype = _model_dtype(weights.dtype(), f"--hf-dir {hf_dir}")
        vocab = fields["vocab_size"]
        fields.update(
            transformer_impl="local",  # the names this checkpoint is written with
            bf16=dtype == torch.bfloat16,
            make_vocab_size_divisible_by=vocab_multiple(vocab, tensor_parallel),
            tensor_model_parallel_size=tensor_parallel,
            expert_model_parallel_size=expert_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
        )
        configs = configs_from_dict(fields)
        validate(configs.model, configs.parallel)  # the requested layout fits the model
        rules = family.rules(configs.model)
        tokenizer_files, tokenizer_info = _tokenizer(hf_dir, vocab)
    if tokenizer_info["type"] == "HuggingFaceTokenizer":
        configs.data.tokenizer_type = "HuggingFaceTokenizer"
    config_dict = configs_to_dict(configs)
    config_dict["tokenizer"] = tokenizer_info
    config_dict[HF_SOURCE] = {"model_type": family.model_type, "hf_config": hf}
    with single_process_group(only="python -m distill.convert"):
        build_layout = ParallelConfig()
        pgc = initialize_parallel(build_layout, seed=0)
        model = build_model(configs.model, build_layout, vocab_size=vocab, pg_collection=pgc)
        params = local_weights(model)  # grouped experts as per-expert views: the rules' names
        _check_coverage(f"{family.model_type} rules vs our model", rules, params)
        tied = not configs.model.untie_embeddings_and_output_weights
        with user_input():  # the HF weights' names and shapes
            _check_tensors(f"--hf-dir {hf_dir}", rules, {k: p.shape for k, p in params.items()}, weights.shapes,
                           vocab, lambda n: family.is_ignored(n) or (n == "lm_head.weight" and tied))
        with torch.no_grad():
            for rule in rules:
                with user_input():  # a tensor the file cannot give
                    hf_tensors = [weights.get(name) for name in rule.hf]
                tensor = rule.join(hf_tensors)
                param = params[rule.ours]
                assert tensor.shape == param.shape, (rule.ours, tensor.shape, param.shape)  # vocab unpadded
                param.copy_(tensor.to(param.dtype))
        parent = os.path.dirname(os.path.abspath(out))
        tmp = os.path.join(parent, f".tmp-{os.path.basename(os.path.abspath(out))}-{secrets.token_hex(4)}")
        try:
            save_checkpoint(tmp, 0, [model], None, None, consumed_samples=0,
                            layout=layout_of(build_layout, configs.training, 1), configs=config_dict,
                            tokenizer_files=tokenizer_files)
            with user_input():  # created while we converted
                check_new_output(out)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _infer_family(model) -> str:
    if model.multi_latent_attention:
        return "deepseek_v2"
    return "qwen3_moe" if model.qk_layernorm else "mixtral"


def _write_config(family, hf_config: dict):
    """config.json through the transformers config class when transformers is importable."""
    def write(directory: str) -> None:
        try:
            import transformers
        except ImportError:
            transformers = None
        if transformers is not None and hasattr(transformers, family.config_class):
            getattr(transformers, family.config_class).from_dict(hf_config).save_pretrained(directory)
        else:
            with open(os.path.join(directory, "config.json"), "w") as f:
                json.dump(hf_config, f, indent=2, sort_keys=True)
                f.write("\n")
    return write


def export_hf(load: str, out: str, *, family_name: Optional[str] = None) -> str:
    """Convert our checkpoint (``load``: a save dir or an ``iter_*`` dir) to a Hugging Face directory."""
    from moe_variants.config import ParallelConfig
    from moe_variants.global_state import gather_global_state_dict
    from megatron.components.loading import checkpoint_configs, load_model
    from megatron.components.parallel import initialize_parallel

    with user_input():  # the checkpoint, the output path and the family
        check_new_output(out)
        configs, manifest, ckpt = checkpoint_configs(load)
        source = manifest["configs"].get(HF_SOURCE) or {}
        family = families.by_name(family_name or source.get("model_type") or _infer_family(configs.model))
        vocab = int(manifest["configs"].get("tokenizer", {}).get("vocab_size") or configs.model.vocab_size)
        hf_fields = family.hf_config(configs.model, vocab)  # refuses what the family cannot express
    with single_process_group(only="python -m distill.convert"):
        pgc = initialize_parallel(ParallelConfig(), seed=0)
        model, _, _, _ = load_model(ckpt, parallel=ParallelConfig(), pg_collection=pgc)
        state = gather_global_state_dict(model, pgc)
        dtype = next(model.parameters()).dtype
        del model
    rules = family.rules(configs.model)
    with user_input():  # a checkpoint with tensors the family has no place for
        _check_coverage(f"--load {load} vs {family.model_type}", rules, state)
    tensors: dict[str, torch.Tensor] = {}
    for rule in rules:
        tensor = state.pop(rule.ours)  # peak memory: about two copies of the model
        if rule.ours in _VOCAB_PARAMS:
            tensor = tensor[:vocab]  # drop megatron's padding rows
        for name, part in zip(rule.hf, rule.split(tensor)):
            tensors[name] = part.clone()  # own storage: safetensors refuses shared tensors
    dropped = ("transformers_version", "auto_map", "_name_or_path")  # remote-code pointers and provenance
    base = {k: v for k, v in (source.get("hf_config") or {}).items() if k not in dropped}
    hf_config = {**base, **hf_fields, "architectures": [family.architecture], "model_type": family.model_type,
                 "torch_dtype": str(dtype).replace("torch.", "")}
    extra = [os.path.join(ckpt, rel) for rel in manifest.get("tokenizer_files", {}).values()]
    return write_hf_dir(out, tensors, _write_config(family, hf_config), extra)
