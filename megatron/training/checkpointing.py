"""Checkpoints: megatron-core ``dist_checkpointing`` written atomically, verified on load.

Layout on disk::

    SAVE/
      latest_checkpointed_iteration.txt    written (temp + rename) after a checkpoint is complete
      iter_0000100/
        .metadata, __*_*.distcp, common.pt, metadata.json    megatron-core torch_dist format
        manifest.json                      ours: iteration, layout, configs, every file's size+sha256

A checkpoint is written into a hidden temporary directory and renamed to ``iter_N`` only when every
rank has finished and the manifest is written, so an interrupted save never leaves a directory that
looks complete, and an existing ``iter_N`` is never written into. On load the manifest is checked
(file sizes and hashes) before anything is read, so a truncated or corrupt checkpoint is reported by
name instead of half-loaded.

Model weights reshard across TP/EP/PP through ``dist_checkpointing``. Optimizer state is restored
only at the same parallel layout: megatron-core 0.16.1 splits expert and dense parameters into two
optimizers only when EP > 1 (``optimizer/__init__.py:645-690``), so the state's structure itself
depends on the layout. At a different layout the weights, iteration and data position load and the
optimizer restarts, with a warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron import compat
from moe_variants.common import collectives

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "find_latest_checkpoint",
    "read_manifest",
    "LoadedCheckpoint",
]

FORMAT_VERSION = 1
LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, incomplete, corrupt, incompatible)."""


@dataclasses.dataclass
class LoadedCheckpoint:
    path: str
    iteration: int
    consumed_samples: int
    manifest: dict
    optimizer_loaded: bool


def _iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_table(directory: str) -> dict:
    table = {}
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            if name == MANIFEST:
                continue
            full = os.path.join(root, name)
            rel = os.path.relpath(full, directory)
            table[rel] = {"bytes": os.path.getsize(full), "sha256": _sha256(full)}
    return table


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _broadcast_object(obj, src: int = 0):
    box = [obj]
    collectives.broadcast_object_list(box, src=src)
    return box[0]


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _sharded_state(model_chunks, optimizer, scheduler, *, is_loading: bool, rank: int, world: int,
                   with_optimizer: bool, with_rng: bool):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {}
    model_sd = {}
    for i, chunk in enumerate(model_chunks):
        model_sd.update(_unwrap(chunk).sharded_state_dict(prefix="" if len(model_chunks) == 1 else f"chunk{i}."))
    state["model"] = model_sd
    if with_optimizer and optimizer is not None:
        if is_loading:
            compat.prepare_optimizer_for_load(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable"},
        )
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = ShardedObject(
            "rng_state", _rng_state() if not is_loading else None, (world,), (rank,), replica_id=0
        )
    return state


def layout_of(parallel, train_cfg, world_size: int) -> dict:
    """The parallel layout that determines whether optimizer state can be restored."""
    return {
        "world_size": world_size,
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "expert_model_parallel_size": parallel.expert_model_parallel_size,
        "expert_tensor_parallel_size": parallel.expert_tensor_parallel_size,
        "use_distributed_optimizer": bool(getattr(train_cfg, "use_distributed_optimizer", False)),
    }


def save_checkpoint(
    save_dir: str,
    iteration: int,
    model_chunks,
    optimizer=None,
    scheduler=None,
    *,
    consumed_samples: int = 0,
    layout: dict,
    configs: dict,
    keep_last: Optional[int] = None,
    tokenizer_files: Optional[dict] = None,
) -> str:
    """Save a checkpoint collectively (every rank calls it). Returns the final directory.

    ``configs`` (plain, JSON-serialisable dicts: model, parallel, training, data...) is stored in the
    manifest so other tools (evaluation, distillation, placement) can rebuild the model from the
    checkpoint alone. ``tokenizer_files`` ({role: path}, e.g. ``{"tokenizer_model": ...}``) are
    copied into ``iter_N/tokenizer/`` so the checkpoint is self-contained. Refuses to overwrite an
    existing ``iter_N``.
    """
    from megatron.core import dist_checkpointing

    rank, world = dist.get_rank(), dist.get_world_size()
    final = os.path.join(save_dir, _iter_name(iteration))
    error = None
    tmp = None
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(final):
            error = f"refusing to overwrite the existing checkpoint {final}"
        else:
            tmp = os.path.join(save_dir, f".tmp-{_iter_name(iteration)}-{secrets.token_hex(4)}")
            os.makedirs(tmp)
    error, tmp = _broadcast_object((error, tmp))
    if error:
        raise CheckpointError(error)
    state = _sharded_state(
        model_chunks, optimizer, scheduler, is_loading=False, rank=rank, world=world,
        with_optimizer=optimizer is not None, with_rng=True,
    )
    state["iteration"] = iteration
    state["consumed_samples"] = consumed_samples
    try:
        dist_checkpointing.save(state, tmp)
        collectives.barrier()
        if rank == 0:
            copied = {}
            if tokenizer_files:
                os.makedirs(os.path.join(tmp, "tokenizer"))
                for role, src in tokenizer_files.items():
                    dst = os.path.join("tokenizer", os.path.basename(src))
                    shutil.copyfile(src, os.path.join(tmp, dst))
                    copied[role] = dst
            manifest = {
                "format_version": FORMAT_VERSION,
                "iteration": iteration,
                "consumed_samples": consumed_samples,
                "layout": layout,
                "has_optimizer": optimizer is not None,
                "configs": configs,
                "tokenizer_files": copied,
                "files": _file_table(tmp),
            }
            _write_atomic(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1, default=str))
            os.rename(tmp, final)
            _write_atomic(os.path.join(save_dir, LATEST_FILE), f"{iteration}\n")
            if keep_last:
                _prune(save_dir, keep_last)
    except BaseException:
        if rank == 0 and tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    collectives.barrier()
    return final


def _complete_iterations(save_dir: str) -> list[int]:
    out = []
    for name in os.listdir(save_dir):
        match = _ITER_DIR.match(name)
        if match and os.path.isfile(os.path.join(save_dir, name, MANIFEST)):
            out.append(int(match.group(1)))
    return sorted(out)


def _prune(save_dir: str, keep_last: int) -> None:
    for iteration in _complete_iterations(save_dir)[:-keep_last]:
        shutil.rmtree(os.path.join(save_dir, _iter_name(iteration)), ignore_errors=True)


def find_latest_checkpoint(load_dir: str) -> Optional[str]:
    """Directory of the newest complete checkpoint under ``load_dir`` (or ``load_dir`` itself if it
    is a checkpoint directory); None if there is none."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    if os.path.isfile(os.path.join(load_dir, MANIFEST)):
        return load_dir
    latest = os.path.join(load_dir, LATEST_FILE)
    if os.path.isfile(latest):
        with open(latest) as f:
            text = f.read().strip()
        if text.isdigit():
            path = os.path.join(load_dir, _iter_name(int(text)))
            if os.path.isfile(os.path.join(path, MANIFEST)):
                return path
    complete = _complete_iterations(load_dir)
    return os.path.join(load_dir, _iter_name(complete[-1])) if complete else None


def read_manifest(path: str, verify: bool = True) -> dict:
    """Read and (optionally) verify a checkpoint's manifest; raises ``CheckpointError``."""
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{manifest_path} is corrupt: {e}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format {manifest.get('format_version')}")
    if verify:
        for rel, info in manifest["files"].items():
            full = os.path.join(path, rel)
            if not os.path.isfile(full):
                raise CheckpointError(f"checkpoint {path} is incomplete: {rel} is missing")
            size = os.path.getsize(full)
            if size != info["bytes"]:
                raise CheckpointError(
                    f"checkpoint {path} is corrupt: {rel} has {size} bytes, expected {info['bytes']}"
                )
            if _sha256(full) != info["sha256"]:
                raise CheckpointError(f"checkpoint {path} is corrupt: {rel} fails its sha256 check")
    return manifest


def load_checkpoint(
    load_dir: str,
    model_chunks,
    optimizer=None,
    scheduler=None,
    *,
    layout: Optional[dict] = None,
    load_optimizer: bool = True,
    load_rng: bool = True,
    verify: bool = True,
) -> Optional[LoadedCheckpoint]:
    """Load the newest complete checkpoint under ``load_dir`` collectively. None if there is none.

    Rank 0 verifies the manifest and every rank learns the verdict, so a corrupt checkpoint fails
    on all ranks with the same one-line message before any tensor is read.
    """
    from megatron.core import dist_checkpointing

    rank, world = dist.get_rank(), dist.get_world_size()
    verdict = None
    if rank == 0:
        try:
            path = find_latest_checkpoint(load_dir)
            manifest = read_manifest(path, verify=verify) if path else None
            verdict = ("ok", path, manifest)
        except CheckpointError as e:
            verdict = ("error", str(e), None)
    status, path, manifest = _broadcast_object(verdict)
    if status == "error":
        raise CheckpointError(path)
    if path is None:
        return None
    same_layout = layout is not None and manifest["layout"] == layout
    with_optimizer = bool(load_optimizer and optimizer is not None and manifest["has_optimizer"])
    if with_optimizer and not same_layout:
        if rank == 0:
            logger.warning(
                "checkpoint %s was saved at layout %s; this run is %s: loading weights, iteration "
                "and data position, and restarting the optimizer state",
                path, manifest["layout"], layout,
            )
        with_optimizer = False
    with_rng = load_rng and layout is not None and manifest["layout"]["world_size"] == world
    state = _sharded_state(
        model_chunks, optimizer, scheduler, is_loading=True, rank=rank, world=world,
        with_optimizer=with_optimizer, with_rng=with_rng,
    )
    try:
        loaded = dist_checkpointing.load(state, path)
    except Exception as e:  # surface megatron-core's multi-line errors as one line
        raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    model_sd = loaded["model"]
    if len(model_chunks) == 1:
        _unwrap(model_chunks[0]).load_state_dict(model_sd, strict=True)
    else:
        for i, chunk in enumerate(model_chunks):
            prefix = f"chunk{i}."
            _unwrap(chunk).load_state_dict(
                {k[len(prefix):]: v for k, v in model_sd.items() if k.startswith(prefix)}, strict=True
            )
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        if scheduler is not None and "scheduler" in loaded:
            scheduler.load_state_dict(loaded["scheduler"])
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()
    if with_rng and loaded.get("rng_state") is not None:
        _set_rng_state(loaded["rng_state"])
    collectives.barrier()
    return LoadedCheckpoint(
        path=path,
        iteration=int(manifest["iteration"]),
        consumed_samples=int(manifest["consumed_samples"]),
        manifest=manifest,
        optimizer_loaded=with_optimizer,
    )
