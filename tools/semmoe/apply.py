"""``apply``: write a placed copy of a checkpoint (experts and router rows permuted per layer).

The pass loads the checkpoint (one process, TP=1/EP=1), permutes the layout-free global state
dict with :func:`placement.permute_expert_state` in the order of the tables'
``physical_to_logical`` map, loads it back and saves a weights-only checkpoint. Because expert
index order is ownership order, a model built from the result at EP = D puts on rank d exactly
the experts the tables assigned to device d; at any other EP the same file splits contiguously.

Output layout (``--out`` is created atomically: written under a hidden temporary name next to
it and renamed when complete; an existing ``--out`` is refused)::

    OUT/latest_checkpointed_iteration.txt
    OUT/iter_N/ ... (the usual checkpoint; same iteration as the source)
    OUT/iter_N/semmoe_tables/tables.npz, expert_map.json   the tables that were applied
    OUT/iter_N/semmoe_tables/placement.json                 expert -> rank per layer

The manifest's ``configs["semmoe"]`` records the placement: ``semmoe_method``,
``semmoe_num_devices``, ``semmoe_tables_map`` (the [L, N] map applied by this pass),
``semmoe_expert_map`` (the original expert in every slot, composed over repeated passes),
``semmoe_tables_sha256`` and ``semmoe_source`` (path, iteration and manifest sha256 of the source).
The model configs keep the source's parallel layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path

import numpy as np

from megatron.common.cli import UserError, user_input
from megatron.components.loading import find_checkpoint
from moe_variants.semmoe.placement import (
    PLACEMENT_SECTION,
    checkpoint_placement,
    moe_shape,
)
from moe_variants.semmoe.tables import EXPERT_MAP_FILE, TABLES_FILE, Tables, load_tables

__all__ = [
    "TABLES_SUBDIR",
    "load_checkpoint_tables",
    "validate_apply",
    "apply_placement",
]

TABLES_SUBDIR = "semmoe_tables"
PLACEMENT_FILE = "placement.json"


def _sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_checkpoint_tables(path: str) -> tuple[Tables, dict]:
    """(tables, placement record) stored with a placed checkpoint; one-line ValueError if the
    checkpoint is unplaced or its tables were changed."""
    ckpt, manifest = find_checkpoint(path)
    placement = checkpoint_placement(manifest)
    if placement is None:
        raise ValueError(f"{path}: not a Sem-MoE placed checkpoint (no '{PLACEMENT_SECTION}' record; run apply)")
    tables_file = os.path.join(ckpt, TABLES_SUBDIR, TABLES_FILE)
    if not os.path.isfile(tables_file) or _sha256(tables_file) != placement["semmoe_tables_sha256"]:
        raise ValueError(f"{path}: its {TABLES_SUBDIR}/{TABLES_FILE} is missing or was modified")
    return load_tables(os.path.join(ckpt, TABLES_SUBDIR)), placement


@user_input()
def validate_apply(load: str, tables_path: str, out: str) -> tuple[str, dict, Tables]:
    """Check the inputs of ``apply`` before anything runs; returns (checkpoint dir, manifest, tables)."""
    out_path = Path(out)
    if out_path.exists():
        raise ValueError(f"--out {out}: exists; refusing to overwrite (choose a new path)")
    if not out_path.parent.is_dir():
        raise ValueError(f"--out {out}: parent directory {out_path.parent} does not exist")
    ckpt, manifest = find_checkpoint(load)
    tables = load_tables(tables_path)
    layers, experts = moe_shape(manifest, load)
    if tables.expert2device.shape != (layers, experts):
        raise ValueError(
            f"--tables {tables_path} are for {tables.num_layers} MoE layers x {tables.num_experts} experts, "
            f"--load {load} has {layers} x {experts}"
        )
    return ckpt, manifest, tables


def _tokenizer_sources(manifest: dict, ckpt: str) -> dict:
    """{role: existing path} of the tokenizer files to copy into the placed checkpoint."""
    files = {role: os.path.join(ckpt, rel) for role, rel in manifest.get("tokenizer_files", {}).items()}
    if not files:
        data = manifest["configs"].get("data", {})
        files = {k: data[k] for k in ("tokenizer_model", "vocab_file", "merge_file") if data.get(k)}
    return {role: p for role, p in files.items() if os.path.isfile(p)}


def apply_placement(load: str, tables_path: str, out: str, seed: int = 1234) -> str:
    """Write the placed checkpoint to ``out`` (see the module docstring). Returns its iter dir.

    Runs in this process as one gloo rank (or inside a caller's single-rank group)."""
    import torch.distributed as dist

    from megatron.components.arguments import configs_from_dict, configs_to_dict
    from megatron.components.checkpointing import layout_of, save_checkpoint
    from moe_variants.config import ParallelConfig
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel

    from moe_variants.semmoe.placement import compose_maps, permute_model_experts
    from megatron.components.parallel import single_process_group

    ckpt, manifest, tables = validate_apply(load, tables_path, out)
    p2l = tables.physical_to_logical()
    previous = checkpoint_placement(manifest)
    composed = compose_maps(None if previous is None else np.asarray(previous["semmoe_expert_map"]), p2l)
    out_path = Path(out).resolve()
    tmp = out_path.parent / f".{out_path.name}.tmp-{secrets.token_hex(4)}"
    with single_process_group():
        if dist.get_world_size() != 1:
            raise ValueError("apply runs as a single process")
        parallel = ParallelConfig()
        pgc = initialize_parallel(parallel, seed=seed)
        model, configs, _, _ = load_model(ckpt, parallel=parallel, pg_collection=pgc)
        permute_model_experts(model, pgc, p2l)
        source_configs = configs_from_dict(
            {k: v for section, fields in manifest["configs"].items() if section in ("parallel",)
             for k, v in fields.items()}
        )  # fmt: skip
        configs.parallel = source_configs.parallel
        config_dict = configs_to_dict(configs)
        for section in ("tokenizer",):
            if section in manifest["configs"]:
                config_dict[section] = manifest["configs"][section]
        config_dict[PLACEMENT_SECTION] = {
            "semmoe_method": tables.method,
            "semmoe_num_devices": tables.num_devices,
            "semmoe_tables_map": p2l.tolist(),
            "semmoe_expert_map": composed.tolist(),
            "semmoe_tables_sha256": _sha256(Path(tables_path) / TABLES_FILE if Path(tables_path).is_dir()
                                            else tables_path),
            "semmoe_source": {
                "checkpoint": os.path.abspath(ckpt),
                "iteration": manifest.get("iteration"),
                "manifest_sha256": _sha256(os.path.join(ckpt, "manifest.json")),
            },
        }  # fmt: skip
        try:
            final = save_checkpoint(
                str(tmp), int(manifest.get("iteration", 0)), [model], None, None, consumed_samples=0,
                layout=layout_of(parallel, configs.training, 1), configs=config_dict,
                tokenizer_files=_tokenizer_sources(manifest, ckpt),
            )  # fmt: skip
            sub = Path(final) / TABLES_SUBDIR
            sub.mkdir()
            src = Path(tables_path) if Path(tables_path).is_dir() else Path(tables_path).parent
            shutil.copyfile(src / TABLES_FILE, sub / TABLES_FILE)
            if (src / EXPERT_MAP_FILE).is_file():
                shutil.copyfile(src / EXPERT_MAP_FILE, sub / EXPERT_MAP_FILE)
            expert_to_rank = np.empty_like(composed)
            per = tables.num_experts // tables.num_devices
            for l, row in enumerate(composed):
                expert_to_rank[l, row] = np.arange(tables.num_experts) // per
            with open(sub / PLACEMENT_FILE, "w") as f:
                json.dump({
                    "num_devices": tables.num_devices,
                    "method": tables.method,
                    "expert_to_rank": expert_to_rank.tolist(),
                    "physical_to_logical_map": composed.tolist(),
                    "note": "expert ids are the source model's (before any placement); physical slot s "
                            "of this checkpoint lives on rank s // (num_experts / num_devices)",
                }, f)  # fmt: skip
            if out_path.exists():
                raise UserError(f"--out {out}: appeared while writing; refusing to overwrite")
            os.rename(tmp, out_path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return str(out_path / Path(final).name)
