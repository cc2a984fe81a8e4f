"""Checkpoint layout apart from the model: in the model library only the adapter modules
(``moe_variants/common/state_dict/``, one per layout) hook ``state_dict``/``load_state_dict`` or
build megatron-core's sharded tensors; the model modules hold model code and call them."""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADAPTERS = os.path.join("moe_variants", "common", "state_dict")
HOOKS = {"register_state_dict_post_hook", "register_load_state_dict_pre_hook", "register_state_dict_pre_hook",
         "register_load_state_dict_post_hook", "_register_state_dict_hook", "_register_load_state_dict_pre_hook"}
CHECKPOINT_MODULES = ("megatron.core.dist_checkpointing",)
CHECKPOINT_NAMES = {"make_sharded_object_for_checkpoint", "make_sharded_tensors_for_checkpoint",
                    "ShardedTensor", "ShardedTensorFactory", "ShardedObject"}


def checkpoint_code(source: str) -> list[str]:
    """What in ``source`` belongs to a checkpoint layout: hook registrations, imports of
    dist-checkpointing or of megatron-core's sharded-tensor builders."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in HOOKS:
            found.append(f"line {node.lineno}: {node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names} & CHECKPOINT_NAMES
            if node.module.startswith(CHECKPOINT_MODULES) or names:
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith(CHECKPOINT_MODULES)]
    return found


def test_the_check_sees_checkpoint_code():
    assert checkpoint_code("self.register_state_dict_post_hook(f)") == ["line 1: register_state_dict_post_hook"]
    assert checkpoint_code("from megatron.core.dist_checkpointing.mapping import ShardedTensor")
    assert checkpoint_code("from megatron.core.transformer.utils import make_sharded_object_for_checkpoint")
    assert checkpoint_code("import torch\nx = module.state_dict()") == []


def test_only_the_adapters_hold_checkpoint_layout_code():
    problems = []
    for root, _, files in os.walk(os.path.join(REPO, "moe_variants")):
        rel_root = os.path.relpath(root, REPO)
        if rel_root == ADAPTERS or rel_root.startswith(ADAPTERS + os.sep):
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                problems += [f"{os.path.relpath(path, REPO)}: {p}" for p in checkpoint_code(open(path).read())]
    assert problems == [], "checkpoint layout code outside moe_variants/common/state_dict/:\n" + "\n".join(problems)
