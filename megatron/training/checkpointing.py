"""Checkpoints: megatron-core ``dist_checkpointing`` written atomically, verified on load.

Layout on disk::

    SAVE/
      latest_checkpointed_iteration.txt    written (temp + rename) after a checkpoint is complete
      writer.lock                          the running writer's pid/host (save_dir.py)
      iter_0000100/
        .metadata, __*_*.distcp, common.pt, metadata.json    megatron-core torch_dist format
        manifest.json                      ours: iteration, layout, configs, lineage, config hash,
                                           every file's size (and sha256, per --verify-checkpoint)
      iter_0000200.corrupt-20250101-120000 a bad checkpoint moved aside (never deleted)

A checkpoint is written into a hidden temporary directory (``.tmp-iter_N-*``) by this process
(``megatron/compat/dist_ckpt.py``: no writer processes a signal could kill) and renamed to
``iter_N`` only when every rank has finished and the manifest is written, so an interrupted save
never leaves a directory that looks complete, and an existing ``iter_N`` is never written into.
The latest pointer is written after the rename and only ever names a complete checkpoint.

Every run has a *lineage* (a random id recorded in its manifests and inherited when it resumes);
``--keep-last-checkpoints`` prunes only checkpoints of the saving run's lineage, so another run's
checkpoints in the same directory are never deleted (``save_dir.prepare_save_dir`` refuses such a
directory at start-up anyway).

The files are hashed by all ranks at once, each a share (``hash_shares``: the shards it wrote,
and the other files balanced by size), and rank 0 writes the digests into the manifest;
``--verify-checkpoint`` (``VerifyCheckpoint``, default ``full``) chooses what is recorded and
checked: ``full`` every file's sha256, ``sizes`` every file's size and the ``.metadata`` file's
sha256, ``off`` nothing (sizes are recorded anyway). Manifests of any mode, and of earlier
versions (every file hashed), load under any mode: a check the manifest has no hash for is skipped.

``save_checkpoint(..., async_save=True)`` plans the save and copies the state to host memory in
the training thread, writes the shards from a daemon thread, and returns; the checkpoint is
completed (hashes, manifest, rename, latest pointer) by ``finalize_pending_save``, a collective
that the next save and the end of the run call on every rank, so at most one save is in flight
and the write-then-rename rule is the synchronous save's.

The RNG state saved per rank holds python's, numpy's, torch's and CUDA's generators and, when it
has any, megatron-core's CUDA RNG tracker states (the tensor/expert-parallel streams dropout under
TP/EP draws from), restored on load at the same world size.

On load the newest checkpoint is checked before anything is read: its manifest (file sizes and
hashes, checked by all ranks in parallel, each a share; a bad file is the same one-line error on
every rank), its pickled parts through restricted readers (``checkpoint_safety``: a crafted
``.metadata`` fails instead of running code) and its model tensors' names and shapes against the
model being loaded (a different architecture is one line naming the differing config fields). An
incomplete or corrupt newest checkpoint is an error naming it; an older one is used only when
``--load`` names it or with ``fallback`` (``--load-fallback``).

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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from megatron import compat
from megatron.training.config import VerifyCheckpoint
from megatron.common import collectives
from megatron.common.files import write_json, write_text

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "find_latest_checkpoint",
    "checkpoint_candidates",
    "read_manifest",
    "LoadedCheckpoint",
    "config_hash",
    "new_lineage",
    "move_aside",
    "one_line_error",
    "broadcast_object",
    "read_manifest_quietly",
    "VerifyCheckpoint",
    "PendingSave",
    "pending_save",
    "finalize_pending_save",
    "hash_shares",
]

FORMAT_VERSION = 1
LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-iter_"
METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's metadata (hashed even with --verify-checkpoint sizes)
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
# config sections that do not change what a checkpoint holds (left out of its config hash)
_RUN_SECTIONS = ("parallel", "training", "data", "checkpoint", "logging")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, incomplete, corrupt, incompatible, unsafe) or
    cannot be written (full disk, read-only directory)."""


@dataclasses.dataclass
class LoadedCheckpoint:
    path: str
    iteration: int
    consumed_samples: int
    manifest: dict
    optimizer_loaded: bool
    skipped: list = dataclasses.field(default_factory=list)  # newer bad checkpoints passed over (fallback)


def _iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_of(path: str) -> Optional[int]:
    match = _ITER_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def new_lineage() -> str:
    """A fresh lineage id (a run that does not resume another run's checkpoint starts one)."""
    return secrets.token_hex(8)


def config_hash(configs: dict) -> str:
    """A short hash of what a checkpoint holds: the model's sections and the tokenizer (not the
    optimisation, data, checkpoint or logging settings, which a resumed run may change)."""
    held = {k: v for k, v in configs.items() if k not in _RUN_SECTIONS}
    return hashlib.sha256(json.dumps(held, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_differences(a: dict, b: dict, limit: int = 5) -> list[str]:
    """``field X (there) vs Y (here)`` for the model-defining fields that differ between two
    ``configs`` dicts (as stored in manifests)."""
    out = []
    for section in sorted(set(a) | set(b)):
        if section in _RUN_SECTIONS:
            continue
        sa, sb = a.get(section) or {}, b.get(section) or {}
        if not isinstance(sa, dict) or not isinstance(sb, dict):
            continue
        for key in sorted(set(sa) | set(sb)):
            if sa.get(key) != sb.get(key):
                out.append(f"{key} {sa.get(key)!r} vs {sb.get(key)!r}")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def one_line_error(err: BaseException) -> str:
    """The most useful single line of an exception from a save or load: the operating-system error
    at its root when there is one (``[Errno 28] No space left on device``), else its first line."""
    seen = set()
    cur = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return f"{os.strerror(cur.errno)} ({cur.filename})" if cur.filename else os.strerror(cur.errno)
        failures = getattr(cur, "failures", None)  # torch's CheckpointException: {rank: exception}
        if isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
            if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
                inner = inner[0]  # torch's WRAPPED_EXCEPTION: (exception, stack summary)
            if isinstance(inner, BaseException):
                return one_line_error(inner)
        cur = cur.__cause__ or cur.__context__
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verify_mode(verify: Union[bool, str, VerifyCheckpoint, None]) -> VerifyCheckpoint:
    """A ``VerifyCheckpoint`` from the value callers pass (``True``/``None``: full, ``False``: off)."""
    if verify is None or verify is True:
        return VerifyCheckpoint.full
    if verify is False:
        return VerifyCheckpoint.off
    return VerifyCheckpoint(verify)


def _hashed(rel: str, mode: VerifyCheckpoint) -> bool:
    """Whether a file's sha256 is recorded (save) or checked (load) under ``mode``."""
    return mode is VerifyCheckpoint.full or (mode is VerifyCheckpoint.sizes and rel == METADATA_FILE)


_RANK_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


def hash_shares(sizes: dict, world: int) -> list:
    """Split a checkpoint's files between ``world`` ranks for hashing (a pure function).

    ``sizes``: ``{relative path: bytes}``. A ``__R_*.distcp`` shard goes to rank R (the rank that
    wrote it, when the world size is the saving one); every other file, largest first, to the rank
    with the fewest bytes so far (ties: the lowest rank). Returns ``world`` sorted lists of paths,
    disjoint, covering every file; deterministic.
    """
    shares = [[] for _ in range(world)]
    loads = [0] * world
    rest = []
    for rel, size in sizes.items():
        match = _RANK_SHARD.match(rel)
        if match and int(match.group(1)) < world:
            shares[int(match.group(1))].append(rel)
            loads[int(match.group(1))] += size
        else:
            rest.append(rel)
    for rel in sorted(rest, key=lambda r: (-sizes[r], r)):
        rank = min(range(world), key=lambda i: (loads[i], i))
        shares[rank].append(rel)
        loads[rank] += sizes[rel]
    return [sorted(share) for share in shares]


def _list_files(directory: str) -> dict:
    """``{relative path: bytes}`` of a checkpoint directory's files (the manifest excepted)."""
    sizes = {}
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, directory)
            if rel != MANIFEST:
                sizes[rel] = os.path.getsize(full)
    return sizes


def _hash_files(directory: str, rels: list) -> dict:
    """``{rel: sha256}``, a few files at a time (hashlib releases the GIL on large buffers)."""
    if len(rels) <= 1:
        return {rel: _sha256(os.path.join(directory, rel)) for rel in rels}
    with ThreadPoolExecutor(max_workers=min(4, len(rels))) as pool:
        return dict(zip(rels, pool.map(lambda rel: _sha256(os.path.join(directory, rel)), rels)))


def _file_problem(path: str, rel: str, info: dict, mode: VerifyCheckpoint) -> Optional[str]:
    """Why one file of a checkpoint fails its manifest entry under ``mode``; None if it passes."""
    if mode is VerifyCheckpoint.off:
        return None
    full = os.path.join(path, rel)
    if not os.path.isfile(full):
        return f"checkpoint {path} is incomplete: {rel} is missing"
    size = os.path.getsize(full)
    if size != info["bytes"]:
        return f"checkpoint {path} is corrupt: {rel} has {size} bytes, expected {info['bytes']}"
    if _hashed(rel, mode) and "sha256" in info and _sha256(full) != info["sha256"]:
        return f"checkpoint {path} is corrupt: {rel} fails its sha256 check"
    return None


def _first_problem(path: str, files: dict, rels: list, mode: VerifyCheckpoint) -> Optional[tuple]:
    """``(rel, message)`` of the first file of ``rels`` (by name) that fails its check, or None."""
    for rel in sorted(rels):
        try:
            problem = _file_problem(path, rel, files[rel], mode)
        except OSError as e:
            problem = f"checkpoint {path}: {rel}: {one_line_error(e)}"
        if problem:
            return rel, problem
    return None


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def move_aside(path: str, why: str) -> str:
    """Rename a bad checkpoint directory to ``iter_N.corrupt-<time>`` (never deleted); returns the
    new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = f"{path}.corrupt-{stamp}"
    n = 1
    while os.path.exists(target):
        target = f"{path}.corrupt-{stamp}-{n}"
        n += 1
    os.rename(path, target)
    logger.warning("checkpoint %s is %s: moved aside to %s", path, why, os.path.basename(target))
    return target


def write_latest(save_dir: str, iteration: Optional[int]) -> None:
    """Point ``latest_checkpointed_iteration.txt`` at ``iteration`` (a complete checkpoint), or
    remove it when there is none."""
    path = os.path.join(save_dir, LATEST_FILE)
    if iteration is None:
        if os.path.exists(path):
            os.unlink(path)
        return
    write_text(path, f"{iteration}\n")


def broadcast_object(obj, src: int = 0):
    """``obj`` of rank ``src`` on every rank (collective)."""
    box = [obj]
    collectives.broadcast_object_list(box, src=src)
    return box[0]


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _tracker_states() -> dict:
    """``{name: state}`` of megatron-core's CUDA RNG tracker (the tensor-parallel, data-parallel and
    expert-parallel streams that dropout inside TP/EP regions draws from). Empty on CPU, where
    ``parallel.set_seed`` installs the inference tracker, which holds none. A graph-safe tracker's
    generators are stored as their state tensors."""
    from megatron.core import tensor_parallel

    states = {}
    for name, value in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        if isinstance(value, torch.Generator):
            value = value.get_state()
        if isinstance(value, torch.Tensor):
            states[name] = value.detach().cpu().clone()
    return states


def _set_tracker_states(saved: dict) -> None:
    """Restore ``_tracker_states`` into the tracker (generators of a graph-safe tracker in place)."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    states = dict(current)
    for name, value in saved.items():
        if isinstance(current.get(name), torch.Generator):
            current[name].set_state(value)
        else:
            states[name] = value
    tracker.set_states(states)


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = _tracker_states()
    if tracker:
        state["cuda_tracker"] = tracker
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("cuda_tracker"):
        _set_tracker_states(state["cuda_tracker"])


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
    lineage: Optional[str] = None,
    verify: Union[bool, str, VerifyCheckpoint] = VerifyCheckpoint.full,
    async_save: bool = False,
) -> str:
    """Save a checkpoint collectively (every rank calls it). Returns the final directory.

    ``configs`` (plain, JSON-serialisable dicts: model, parallel, training, data...) is stored in the
    manifest so other tools (evaluation, distillation, placement) can rebuild the model from the
    checkpoint alone. ``tokenizer_files`` ({role: path}, e.g. ``{"tokenizer_model": ...}``) are
    copied into ``iter_N/tokenizer/`` so the checkpoint is self-contained. ``lineage`` (default: a
    new one) is recorded in the manifest; ``keep_last`` then prunes older checkpoints of that
    lineage only. ``verify`` is what the manifest records besides every file's size (full: every
    file's sha256, sizes: the ``.metadata`` file's, off: none), hashed by all ranks in parallel. A
    complete ``iter_N`` that already exists is never overwritten (an error); an incomplete one is
    moved aside first. Any failure (a full disk, a read-only directory) is a one-line
    ``CheckpointError`` on every rank, and the temporary directory is removed.

    ``async_save``: the state is planned and copied to host memory now, written by a background
    thread while training goes on, and becomes ``iter_N`` (manifest, rename, latest pointer,
    pruning) only when ``finalize_pending_save`` is called on every rank; the returned path does
    not exist before that. A save first finalizes the one in flight, so at most one is.
    """
    from megatron.core import dist_checkpointing

    from megatron.compat.dist_ckpt import in_process_save_strategy

    global _PENDING
    finalize_pending_save()
    rank, world = dist.get_rank(), dist.get_world_size()
    lineage = lineage or new_lineage()
    final = os.path.join(save_dir, _iter_name(iteration))
    error = None
    tmp = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            if os.path.exists(final):
                if os.path.isfile(os.path.join(final, MANIFEST)):
                    error = f"refusing to overwrite the existing checkpoint {final}"
                else:
                    move_aside(final, "incomplete (no manifest.json)")
            if error is None:
                tmp = os.path.join(save_dir, f".tmp-{_iter_name(iteration)}-{secrets.token_hex(4)}")
                os.makedirs(tmp)
        except OSError as e:
            error = f"cannot save checkpoint {final}: {one_line_error(e)}"
    error, tmp = broadcast_object((error, tmp))
    if error:
        raise CheckpointError(error)
    state = _sharded_state(
        model_chunks, optimizer, scheduler, is_loading=False, rank=rank, world=world,
        with_optimizer=optimizer is not None, with_rng=True,
    )
    state["iteration"] = iteration
    state["consumed_samples"] = consumed_samples
    finish = dict(save_dir=save_dir, tmp=tmp, final=final, iteration=iteration,
                  consumed_samples=consumed_samples, layout=layout, configs=configs,
                  has_optimizer=optimizer is not None, tokenizer_files=tokenizer_files, lineage=lineage,
                  keep_last=keep_last, mode=_verify_mode(verify))
    try:
        try:
            request = dist_checkpointing.save(state, tmp, sharded_strategy=in_process_save_strategy(),
                                              async_sharded_save=async_save)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # torch's CheckpointException is a BaseException
            raise CheckpointError(f"cannot save checkpoint {final}: {one_line_error(e)}") from e
        if async_save:
            _PENDING = PendingSave(request, finish)
            return final
        _complete_save(**finish)
    except BaseException:
        if rank == 0 and tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _complete_save(*, save_dir, tmp, final, iteration, consumed_samples, layout, configs, has_optimizer,
                   tokenizer_files, lineage, keep_last, mode) -> None:
    """Collective, once every rank's shards are written: rank 0 copies the tokenizer files and lists
    the files, every rank hashes its share (``hash_shares``), and rank 0 writes the manifest and
    renames (``_finish_save``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    collectives.barrier()

    def cannot(e: OSError) -> CheckpointError:
        return CheckpointError(f"cannot save checkpoint {final}: {one_line_error(e)}")

    def listing():
        try:
            return _copy_tokenizer_files(tmp, tokenizer_files), _list_files(tmp)
        except OSError as e:
            raise cannot(e) from None

    copied, sizes = from_rank0(listing)
    share = hash_shares({rel: n for rel, n in sizes.items() if _hashed(rel, mode)}, world)[rank]
    try:
        mine = ("ok", _hash_files(tmp, share))
    except OSError as e:
        mine = ("error", str(cannot(e)))
    gathered = [None] * world
    collectives.all_gather_object(gathered, mine)
    errors = [value for status, value in gathered if status == "error"]
    if errors:
        raise CheckpointError(errors[0])
    digests = {}
    for _, value in gathered:
        digests.update(value)
    files = {rel: {"bytes": n, **({"sha256": digests[rel]} if rel in digests else {})}
             for rel, n in sorted(sizes.items())}

    def finish():
        try:
            _finish_save(save_dir, tmp, final, iteration, consumed_samples, layout, configs, has_optimizer,
                         copied, files, mode, lineage, keep_last)
        except OSError as e:
            raise cannot(e) from None

    from_rank0(finish)


def _copy_tokenizer_files(tmp: str, tokenizer_files: Optional[dict]) -> dict:
    """Rank 0: ``tokenizer_files`` ({role: path}) copied into ``tmp/tokenizer/``; {role: relative path}."""
    copied = {}
    if tokenizer_files:
        os.makedirs(os.path.join(tmp, "tokenizer"))
        for role, src in tokenizer_files.items():
            dst = os.path.join("tokenizer", os.path.basename(src))
            shutil.copyfile(src, os.path.join(tmp, dst))
            copied[role] = dst
    return copied


def _finish_save(save_dir, tmp, final, iteration, consumed_samples, layout, configs, has_optimizer,
                 copied, files, mode, lineage, keep_last) -> None:
    """Rank 0, once every file is written and hashed: manifest, rename, latest pointer, pruning (in
    that order, so the pointer only ever names a complete checkpoint)."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": layout,
        "has_optimizer": has_optimizer,
        "configs": configs,
        "config_hash": config_hash(configs),
        "lineage": lineage,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "tokenizer_files": copied,
        "verify": mode.value,
        "files": files,
    }
    write_json(os.path.join(tmp, MANIFEST), manifest, default=str)
    os.rename(tmp, final)
    _fsync_dir(save_dir)
    write_latest(save_dir, iteration)
    if keep_last:
        prune(save_dir, keep_last, lineage, keep=final)


# --------------------------------------------------------------------------------------------------
# Asynchronous saves
# --------------------------------------------------------------------------------------------------

_PENDING: Optional["PendingSave"] = None


def _copy_to_host(write_buckets: list) -> list:
    """megatron-core's write buckets with every tensor copied to host memory. On CPU the planned
    tensors are the parameters and optimizer state themselves (megatron-core copies only views,
    ``filesystem_async.py:151``), which training goes on changing while the thread writes; on GPU
    this is the device-to-host copy."""
    return [(file_name, key, (bytes_data, [(item, t.detach().to("cpu", copy=True)) for item, t in tensor_data]))
            for file_name, key, (bytes_data, tensor_data) in write_buckets]


class PendingSave:
    """An asynchronous save in flight (``save_checkpoint(..., async_save=True)``): this rank's
    shards written by a daemon thread from a host copy of the state (bytes items, ``common.pt``
    and the plan were made in the training thread). Nothing of it is a checkpoint until
    ``finalize_pending_save``; a process that dies first leaves only a ``.tmp-iter_*`` directory."""

    def __init__(self, request, finish: dict):
        self.final: str = finish["final"]
        self.iteration: int = finish["iteration"]
        self.request = request
        self.finish = finish
        self.error: Optional[BaseException] = None
        self._args = list(request.async_fn_args)
        if request.async_fn is not None:
            self._args[1] = _copy_to_host(self._args[1])
        self.thread = threading.Thread(target=self._write, name=f"checkpoint-writer-{self.iteration}",
                                       daemon=True)
        self.thread.start()

    def _write(self) -> None:
        try:
            if self.request.async_fn is None:  # nothing to write on this rank
                return
            self.request.async_fn(*self._args, **self.request.async_fn_kwargs)
            results = self._args[2]  # the in-process results queue (megatron/compat/dist_ckpt.py)
            outcome = results.get_nowait()
            results.put(outcome)  # megatron-core's finalize reads it again
            if isinstance(outcome, BaseException):
                raise outcome
        except BaseException as e:
            self.error = e

    def done(self) -> bool:
        """Whether this rank's writer has finished (the checkpoint still needs finalizing)."""
        return not self.thread.is_alive()


def pending_save() -> Optional[PendingSave]:
    """The asynchronous save in flight on this rank, if any."""
    return _PENDING


def finalize_pending_save() -> Optional[str]:
    """Make the asynchronous save in flight a checkpoint; collective (every rank calls it, at the
    next save and at the end of the run). Waits for this rank's writer, agrees with the other ranks
    that every write succeeded, lets megatron-core finish its files (rank 0 writes ``.metadata``
    and ``metadata.json``), hashes, writes the manifest and renames: the write-then-rename rule of
    a synchronous save. Returns the checkpoint's path, or None when none is in flight. A failed
    write is the same one-line ``CheckpointError`` on every rank and the temporary directory is
    removed."""
    global _PENDING
    pending, _PENDING = _PENDING, None
    if pending is None:
        return None
    world = dist.get_world_size()
    try:
        pending.thread.join()
        mine = None if pending.error is None else (
            f"cannot save checkpoint {pending.final}: {one_line_error(pending.error)}")
        gathered = [None] * world
        collectives.all_gather_object(gathered, mine)
        first = next((e for e in gathered if e), None)
        if first:
            raise CheckpointError(first)
        try:
            for fn in pending.request.finalize_fns:
                fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # torch's CheckpointException is a BaseException
            raise CheckpointError(f"cannot save checkpoint {pending.final}: {one_line_error(e)}") from e
        _complete_save(**pending.finish)
    except BaseException:
        tmp = pending.finish["tmp"]
        if dist.get_rank() == 0 and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return pending.final


def read_manifest_quietly(path: str) -> Optional[dict]:
    """A checkpoint directory's manifest, unverified; None when it is missing or unreadable."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        return manifest if isinstance(manifest, dict) else None
    except (OSError, ValueError):
        return None


def prune(save_dir: str, keep_last: int, lineage: str, keep: Optional[str] = None) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints of ``lineage`` in ``save_dir``
    (never ``keep``, never another lineage's). A checkpoint is first renamed to a ``.tmp-`` name,
    so a crash mid-delete leaves a temporary directory (cleaned at the next start), not a
    half-deleted ``iter_N``. Returns the deleted paths."""
    ours = []
    for name in os.listdir(save_dir):
        iteration = iteration_of(name)
        path = os.path.join(save_dir, name)
        if iteration is None or not os.path.isdir(path):
            continue
        manifest = read_manifest_quietly(path)
        if manifest is not None and manifest.get("lineage") == lineage:
            ours.append((iteration, path))
    ours.sort()
    deleted = []
    for _, path in ours[:-keep_last] if keep_last > 0 else []:
        if keep is not None and os.path.abspath(path) == os.path.abspath(keep):
            continue
        doomed = os.path.join(save_dir, f"{TMP_PREFIX}{os.path.basename(path)[len('iter_'):]}-pruned")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(path)
    return deleted


def checkpoint_candidates(load_dir: str) -> list[tuple[int, str, Optional[str]]]:
    """``(iteration, path, problem)`` of the checkpoints under a run directory, newest first.

    ``problem`` is None for a directory with a manifest (complete as far as the directory tells;
    ``read_manifest`` verifies it), else why it cannot be loaded: no manifest, or named by the
    latest pointer but missing.
    """
    found = {}
    for name in os.listdir(load_dir):
        iteration = iteration_of(name)
        path = os.path.join(load_dir, name)
        if iteration is None or not os.path.isdir(path):
            continue
        found[iteration] = (path, None if os.path.isfile(os.path.join(path, MANIFEST))
                            else f"incomplete (no {MANIFEST})")
    latest = os.path.join(load_dir, LATEST_FILE)
    if os.path.isfile(latest):
        try:
            with open(latest) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text.isdigit() and int(text) not in found:
            found[int(text)] = (os.path.join(load_dir, _iter_name(int(text))),
                                f"missing (named by {LATEST_FILE})")
    return [(it, path, problem) for it, (path, problem) in sorted(found.items(), reverse=True)]


def leftover_temporaries(directory: str) -> list[str]:
    """The ``.tmp-iter_*`` directories interrupted saves (or prunes) left in a run directory."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, n) for n in names
                  if n.startswith(TMP_PREFIX) and os.path.isdir(os.path.join(directory, n)))


def _is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST)) or iteration_of(path) is not None


def find_latest_checkpoint(load_dir: str, *, fallback: bool = False) -> Optional[str]:
    """Directory of the newest checkpoint under ``load_dir`` (or ``load_dir`` itself if it is a
    checkpoint directory); None if there is none.

    An incomplete newest checkpoint (no manifest, or named by the latest pointer but missing) is a
    ``CheckpointError`` naming it; with ``fallback`` it is reported and the next older complete
    one is returned. Leftover temporary directories of interrupted saves are reported.
    """
    path, _ = _select(load_dir, fallback=fallback)
    return path


def _select(load_dir: str, *, fallback: bool):
    """(path or None, [(bad path, problem)...] passed over)."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    if _is_checkpoint_dir(load_dir):
        if not os.path.isfile(os.path.join(load_dir, MANIFEST)):
            raise CheckpointError(f"checkpoint {load_dir} is incomplete (no {MANIFEST})")
        return load_dir, []
    for tmp in leftover_temporaries(load_dir):
        logger.warning("%s is a leftover of an interrupted save (not a checkpoint; the next run "
                       "saving to %s removes it)", tmp, load_dir)
    skipped = []
    for _, path, problem in checkpoint_candidates(load_dir):
        if problem is None:
            return path, skipped
        if not fallback:
            raise CheckpointError(_bad_newest_message(path, problem, load_dir))
        logger.warning("checkpoint %s is %s: skipped (--load-fallback)", path, problem)
        skipped.append((path, problem))
    return None, skipped


def _bad_newest_message(path: str, problem: str, load_dir: str) -> str:
    return (f"newest checkpoint {path} is {problem}: resume from an older one with --load "
            f"{load_dir}/iter_NNNNNNN, or pass --load-fallback to use the newest good one")


def read_manifest(path: str, verify: Union[bool, str, VerifyCheckpoint] = True) -> dict:
    """Read a checkpoint's manifest and check its files in this process (``verify``: a
    ``VerifyCheckpoint`` mode, ``True`` full, ``False`` off); raises ``CheckpointError``. A
    collective load checks the files in parallel instead (``_verify_collective``)."""
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{manifest_path} is corrupt: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or not all(
            isinstance(info, dict) and isinstance(info.get("bytes"), int) for info in manifest["files"].values()):
        raise CheckpointError(f"{manifest_path} is not a checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format {manifest.get('format_version')}")
    problem = _first_problem(path, manifest["files"], list(manifest["files"]), _verify_mode(verify))
    if problem:
        raise CheckpointError(problem[1])
    return manifest


def _safety_check(path: str, manifest: dict) -> dict:
    """The checkpoint's pickled parts through the restricted readers; ``{tensor key: shape}``."""
    from megatron.training.checkpoint_safety import UnsafeCheckpoint, check_checkpoint_files, tensor_shapes

    try:
        metadata = check_checkpoint_files(path, set(manifest["files"]))
    except UnsafeCheckpoint as e:
        raise CheckpointError(f"unsafe checkpoint: {e}") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: {one_line_error(e)}") from None
    return tensor_shapes(metadata)


def verify_checkpoint(path: str, *, verify: Union[bool, str, VerifyCheckpoint] = True):
    """Everything checked before a checkpoint's tensors are read, in this process: the manifest
    (its files checked per ``verify``) and its pickled parts through the restricted readers.
    Returns ``(manifest, {tensor key: shape})``; raises ``CheckpointError``."""
    manifest = read_manifest(path, verify=verify)
    return manifest, _safety_check(path, manifest)


def from_rank0(fn, *, user_errors: bool = False):
    """``fn()`` run on rank 0, its (picklable) result on every rank; a ``CheckpointError`` (or an
    ``OSError``) there is the same one-line ``CheckpointError`` on all ranks, and with
    ``user_errors`` a ``ValueError`` there is the same ``UserError`` on all ranks, so a refusal
    never leaves the other ranks waiting in a collective (collective)."""
    from megatron.common.cli import UserError

    out = None
    if dist.get_rank() == 0:
        try:
            out = ("ok", fn())
        except CheckpointError as e:
            out = ("checkpoint", str(e))
        except OSError as e:
            out = ("checkpoint", one_line_error(e))
        except ValueError as e:
            if not user_errors:
                raise
            out = ("user", str(e))
    status, value = broadcast_object(out)
    if status == "checkpoint":
        raise CheckpointError(value)
    if status == "user":
        raise UserError(value)
    return value


def _verify_collective(path: str, mode: VerifyCheckpoint):
    """``verify_checkpoint`` on all ranks at once: rank 0 reads the manifest, every rank checks
    its share of the files (``hash_shares``: sizes, and hashes per ``mode``) in parallel, and the
    first bad file by name is the same one-line ``CheckpointError`` on every rank; rank 0 then
    reads the pickled parts through the restricted readers. Returns ``(manifest, shapes)``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest = from_rank0(lambda: read_manifest(path, verify=VerifyCheckpoint.off))
    files = manifest["files"]
    share = hash_shares({rel: info["bytes"] for rel, info in files.items()}, world)[rank]
    gathered = [None] * world
    collectives.all_gather_object(gathered, _first_problem(path, files, share, mode))
    bad = min((p for p in gathered if p), default=None)
    if bad:
        raise CheckpointError(bad[1])
    return manifest, from_rank0(lambda: _safety_check(path, manifest))


def _pick_and_verify(load_dir: str, *, verify, fallback: bool):
    """Collective: the checkpoint to load, verified, and the bad newer ones passed over
    (fallback). Rank 0 reads the directory; the files are checked by all ranks."""
    mode = _verify_mode(verify)
    path, skipped, explicit = from_rank0(
        lambda: (*_select(load_dir, fallback=fallback), _is_checkpoint_dir(load_dir)))
    while path is not None:
        try:
            manifest, shapes = _verify_collective(path, mode)
            return path, manifest, shapes, skipped
        except CheckpointError as e:
            if explicit:
                raise
            if not fallback:
                raise CheckpointError(f"{e} (resume from an older one with --load {load_dir}/iter_NNNNNNN, "
                                      "or pass --load-fallback to use the newest good one)") from None
            if dist.get_rank() == 0:
                logger.warning("%s: skipped (--load-fallback)", e)
            skipped.append((path, str(e)))
            bad = path
            path = from_rank0(lambda: next((p for it, p, problem in checkpoint_candidates(load_dir)
                                             if problem is None and it < iteration_of(bad)), None))
    return None, None, None, skipped


_OPTIMIZER_KEY = re.compile(r"(^|\.)optimizer\.")


def _model_tensor_shapes(model_sd) -> dict:
    """``{key: global shape or None}`` of a model sharded state dict's tensors (None where a
    factory builds the stored tensors: only the key is compared)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for value in nested_values(model_sd):
        if isinstance(value, ShardedTensor):
            out[value.key] = tuple(value.global_shape)
        elif isinstance(value, ShardedTensorFactory):
            out.setdefault(value.key, None)
    return out


def _architecture_problem(path: str, manifest: dict, ckpt_shapes: dict, model_shapes: dict,
                          expected_configs: Optional[dict]) -> Optional[str]:
    """One line when the checkpoint's model tensors do not match the model's, naming the config
    fields that differ (from the manifest) and the first tensor that does not fit."""
    stored = {k: s for k, s in ckpt_shapes.items() if not _OPTIMIZER_KEY.search(k)}
    first = None
    for key in sorted(model_shapes):
        if key not in stored:
            first = f"{key} is not in the checkpoint"
            break
        if model_shapes[key] is not None and tuple(stored[key]) != tuple(model_shapes[key]):
            first = f"{key} is {list(stored[key])} there, {list(model_shapes[key])} here"
            break
    if first is None:
        extra = sorted(set(stored) - set(model_shapes))
        if not extra:
            return None
        first = f"{extra[0]} is in the checkpoint but not in this model"
    fields = config_differences(manifest.get("configs") or {}, expected_configs or {}) if expected_configs else []
    what = f": {', '.join(fields)} (checkpoint vs this run)" if fields else ""
    return f"checkpoint {path} holds a different model{what}; {first}"

def load_checkpoint(
    load_dir: str,
    model_chunks,
    optimizer=None,
    scheduler=None,
    *,
    layout: Optional[dict] = None,
    load_optimizer: bool = True,
    load_rng: bool = True,
    verify: Union[bool, str, VerifyCheckpoint] = VerifyCheckpoint.full,
    fallback: bool = False,
    expected_configs: Optional[dict] = None,
) -> Optional[LoadedCheckpoint]:
    """Load the newest checkpoint under ``load_dir`` collectively. None if there is none.

    Rank 0 picks the checkpoint and reads its manifest, every rank checks a share of its files
    (``verify``: ``VerifyCheckpoint`` full, sizes or off; ``True``/``False`` mean full/off), rank 0
    reads its pickled parts through the restricted readers (``fallback`` past bad newer ones) and
    every rank learns the verdict; the model's tensor names
    and shapes are then compared with the checkpoint's (``expected_configs``, the run's configs
    dict, names the differing fields). So a corrupt, unsafe or different-architecture checkpoint
    fails on all ranks with the same one-line ``CheckpointError`` before any tensor is read.
    """
    from megatron.core import dist_checkpointing

    rank, world = dist.get_rank(), dist.get_world_size()
    path, manifest, ckpt_shapes, skipped = _pick_and_verify(load_dir, verify=verify, fallback=fallback)
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
    gathered = [None] * world if rank == 0 else None
    collectives.gather_object(_model_tensor_shapes(state["model"]), gathered, dst=0)
    problem = None
    if rank == 0:
        model_shapes = {}
        for shapes in gathered:
            for key, shape in shapes.items():
                if model_shapes.get(key) is None:
                    model_shapes[key] = shape
        problem = _architecture_problem(path, manifest, ckpt_shapes, model_shapes, expected_configs)
    problem = broadcast_object(problem)
    if problem:
        raise CheckpointError(problem)
    try:
        loaded = dist_checkpointing.load(state, path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {one_line_error(e)}") from e
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
        skipped=[p for p, _ in skipped],
    )
