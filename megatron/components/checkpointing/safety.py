"""Read a ``torch_dist`` checkpoint's pickled parts without running code from it.

torch's distributed-checkpoint reader unpickles three kinds of data while loading, each able to run
arbitrary code if the checkpoint was crafted (the sha256 manifest does not help: whoever crafts the
files can write a matching manifest):

- ``.metadata``: ``pickle.load`` in ``FileSystemReader.read_metadata``
  (torch/distributed/checkpoint/filesystem.py);
- the byte items inside the ``.distcp`` shards (``ShardedObject``s: RNG states, layers'
  ``_extra_state``): ``torch.load(weights_only=False)`` in ``DefaultLoadPlanner.load_bytes``;
- ``common.pt``: ``torch.load`` with torch's default, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
  can turn into a full unpickle.

``check_checkpoint_files`` reads each of them first with a restricted reader: ``.metadata`` through
an ``Unpickler`` whose ``find_class`` admits only the classes torch's checkpoint metadata is made of
(``METADATA_GLOBALS``, the set ``torch.distributed.checkpoint`` 2.x pickles); the byte items and
``common.pt`` through ``torch.load(weights_only=True)`` with the three numpy names an RNG state
needs. Anything else (a ``__reduce__`` that calls ``os.system``, an unknown class) fails with
``UnsafeCheckpoint`` before megatron-core's loader is called, and nothing from the file runs.
Storage entries must also name files of the checkpoint itself (no ``../`` paths).

What this does not cover: a file changed between this check and the load (someone with write
access to the checkpoint while it loads can do anything anyway).
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Optional

__all__ = ["UnsafeCheckpoint", "read_metadata", "check_checkpoint_files", "METADATA_GLOBALS"]

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
METADATA_GLOBALS = frozenset(
    [(_DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )]
    + [(_DCP_PLANNER, name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType",
    )]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout from its name (torch.strided)
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id may be a path
    ]
)


class UnsafeCheckpoint(Exception):
    """A checkpoint file that would run code or reach outside the checkpoint when loaded."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if (module, name) in METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refusing a persistent id")


def read_metadata(checkpoint_dir: str):
    """The ``torch.distributed.checkpoint`` ``Metadata`` of a checkpoint, read without running code."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(checkpoint_dir, METADATA_FILE)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise UnsafeCheckpoint(f"{path} is missing") from None
    except Exception as e:  # UnpicklingError, or a constructor of an allowed class refusing its arguments
        raise UnsafeCheckpoint(f"{path} is not plain checkpoint metadata ({_first_line(e)}); "
                               "not loading it") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not checkpoint metadata")
    return metadata


def _safe_numpy_globals() -> list:
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    names = [np.ndarray, np.dtype, _reconstruct]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None and hasattr(dtypes, "UInt32DType"):
        names.append(dtypes.UInt32DType)
    return names


def _weights_only_load(data, where: str) -> None:
    import torch

    try:
        with torch.serialization.safe_globals(_safe_numpy_globals()):
            torch.load(data, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UnsafeCheckpoint(f"{where} holds more than tensors and plain values "
                               f"({_first_line(e)}); not loading it") from None


def check_checkpoint_files(checkpoint_dir: str, listed_files: Optional[set] = None):
    """Read every pickled part of a checkpoint with the restricted readers; returns its metadata.

    ``listed_files``: the files the manifest lists; every storage entry must name one of them.
    Raises ``UnsafeCheckpoint`` naming the file.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_metadata(checkpoint_dir)
    storage = metadata.storage_data or {}
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if (not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ("", ".", "..")
                or (listed_files is not None and rel not in listed_files)):
            raise UnsafeCheckpoint(f"{os.path.join(checkpoint_dir, METADATA_FILE)}: entry {index.fqn!r} "
                                   f"points at {rel!r}, not a file of this checkpoint")
    byte_items = {fqn for fqn, meta in metadata.state_dict_metadata.items() if isinstance(meta, BytesStorageMetadata)}
    for index, info in storage.items():
        fqn = index.fqn
        if fqn in byte_items:
            where = f"{os.path.join(checkpoint_dir, info.relative_path)} (item {fqn})"
            if getattr(info, "transform_descriptors", None):
                raise UnsafeCheckpoint(f"{where}: transformed (compressed) items are not supported")
            with open(os.path.join(checkpoint_dir, info.relative_path), "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            if len(data) != info.length:
                raise UnsafeCheckpoint(f"{where}: truncated")
            _weights_only_load(io.BytesIO(data), where)
    common = os.path.join(checkpoint_dir, COMMON_FILE)
    if os.path.isfile(common):
        _weights_only_load(common, common)
    return metadata


def tensor_shapes(metadata) -> dict:
    """``{key: shape}`` of every tensor in a checkpoint's metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
