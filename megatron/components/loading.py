"""Models from checkpoints, for the server and the tools that run after training (evaluation,
distillation, placement, conversion): rebuild the model from the configs stored in the checkpoint,
at any TP/EP/PP layout, and load its weights; write weights-only checkpoints.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["find_checkpoint", "checkpoint_configs", "load_tokenizer", "load_model", "save_model", "parameter_changes"]


def find_checkpoint(path: str):
    """(checkpoint dir, manifest) of the newest complete checkpoint under ``path`` (a save dir or
    one ``iter_`` dir); ``CheckpointError`` naming ``--load`` when there is none."""
    from megatron.components.checkpointing import CheckpointError, find_latest_checkpoint, read_manifest

    ckpt = find_latest_checkpoint(path)
    if ckpt is None:
        raise CheckpointError(f"--load {path}: no complete checkpoint found")
    return ckpt, read_manifest(ckpt, verify=False)


def checkpoint_configs(path: str, overrides: Optional[dict] = None):
    """(Configs, manifest, checkpoint dir) of the newest checkpoint under ``path``.

    ``overrides`` replaces config fields (e.g. ``{"farskip": "all"}`` to load a model with another
    connectivity, or parallel sizes). Fields the checkpoint lacks because it was written before
    they existed get the values it was written with (``registry.stored_defaults``).
    """
    from megatron.common.cli import user_input
    from megatron.components.arguments import configs_from_dict, option_names
    from moe_variants import registry

    ckpt, manifest = find_checkpoint(path)
    values = {}
    for section, fields in manifest["configs"].items():
        if section == "tokenizer":
            continue
        values.update(fields)
    values.update(registry.stored_defaults(values))
    values.update(overrides or {})
    known = option_names()
    with user_input():  # the checkpoint's configs and the caller's overrides are input
        return configs_from_dict({k: v for k, v in values.items() if k in known}), manifest, ckpt


def load_tokenizer(manifest: dict, ckpt: str):
    """The tokenizer stored with a checkpoint (its files are copied into the checkpoint)."""
    from megatron.components.tokenizer import build_tokenizer

    from megatron.components.tokenizer import DEFAULT_TOKENIZER_MODEL

    info = manifest["configs"].get("tokenizer", {})
    files = {role: os.path.join(ckpt, rel) for role, rel in manifest.get("tokenizer_files", {}).items()}
    data = manifest["configs"].get("data", {})
    if not files:  # older checkpoints: the tokenizer flags they were trained with
        files = {k: data.get(k) for k in ("tokenizer_model", "vocab_file", "merge_file") if data.get(k)}
        if not data.get("tokenizer_type"):
            files = {"tokenizer_model": DEFAULT_TOKENIZER_MODEL}
    kind = info.get("type") or data.get("tokenizer_type") or "HuggingFaceTokenizer"
    if kind == "NullTokenizer":
        return build_tokenizer(kind, vocab_size=info["vocab_size"] - 1)
    return build_tokenizer(kind, files.get("tokenizer_model"), files.get("vocab_file"), files.get("merge_file"))


def load_model(path: str, *, parallel=None, overrides: Optional[dict] = None, pg_collection=None,
               verify: bool = True):
    """Build this rank's model from a checkpoint's configs and load its weights.

    Call ``megatron.components.parallel.initialize_parallel(parallel)`` first; ``parallel`` defaults
    to the checkpoint's. Returns ``(model, configs, tokenizer, manifest)``; the model is in eval mode.
    """

    from megatron.components.checkpointing import load_checkpoint
    from moe_variants.builder import build_model

    configs, manifest, ckpt = checkpoint_configs(path, overrides)
    if parallel is not None:
        configs.parallel = parallel
    tokenizer = load_tokenizer(manifest, ckpt)
    vocab = manifest["configs"].get("tokenizer", {}).get("vocab_size", tokenizer.vocab_size)
    model = build_model(configs.model, configs.parallel, vocab_size=vocab, pg_collection=pg_collection)
    from megatron.components.arguments import configs_to_dict

    load_checkpoint(ckpt, [model], None, None, layout=None, load_optimizer=False, load_rng=False,
                    verify=verify, expected_configs=configs_to_dict(configs))
    model.eval()
    return model, configs, tokenizer, manifest


def parameter_changes(path: str, overrides: dict, *, parallel=None, pg_collection=None) -> list[str]:
    """Parameters of the checkpoint's model that ``overrides`` would add, drop or reshape, as
    ``name`` or ``name: shape -> shape`` (empty: the overrides change only connectivity, like
    FarSkip's, and the checkpoint's weights load as they are).

    Both models are built on the meta device (no memory, no weights) at ``parallel`` (default
    TP = EP = PP = 1, which needs ``initialize_parallel`` at that layout first).
    """
    import dataclasses

    import torch

    from moe_variants.builder import build_model
    from moe_variants.config import ParallelConfig, TransformerImpl

    parallel = parallel or ParallelConfig()
    shapes = []
    for extra in ({}, overrides):
        configs, manifest, _ = checkpoint_configs(path, extra)
        model_cfg = dataclasses.replace(configs.model, transformer_impl=TransformerImpl.local)
        vocab = manifest["configs"].get("tokenizer", {}).get("vocab_size") or 1024
        with torch.device("meta"):
            model = build_model(model_cfg, parallel, vocab_size=vocab, pg_collection=pg_collection)
        shapes.append({name: tuple(p.shape) for name, p in model.named_parameters()})
        del model
    before, after = shapes
    out = [f"{n} (dropped)" for n in before if n not in after] + [f"{n} (new)" for n in after if n not in before]
    out += [f"{n}: {list(before[n])} -> {list(after[n])}" for n in before if n in after and before[n] != after[n]]
    return out


def save_model(save_dir: str, model, configs, *, iteration: int = 0, tokenizer_files: Optional[dict] = None,
               tokenizer_info: Optional[dict] = None) -> str:
    """A weights-only checkpoint (no optimizer) of ``model`` with ``configs``; collective."""
    import torch.distributed as dist

    from megatron.components.arguments import configs_to_dict
    from megatron.components.checkpointing import layout_of, save_checkpoint

    config_dict = configs_to_dict(configs)
    if tokenizer_info:
        config_dict["tokenizer"] = tokenizer_info
    return save_checkpoint(
        save_dir, iteration, [model], None, None, consumed_samples=0,
        layout=layout_of(configs.parallel, configs.training, dist.get_world_size()),
        configs=config_dict, tokenizer_files=tokenizer_files,
    )
