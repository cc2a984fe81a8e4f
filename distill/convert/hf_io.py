"""Reading and writing Hugging Face model directories (config.json + weights), without transformers.

Weights are read lazily by name: safetensors (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) through memory-mapped ``safe_open``; pickle ``pytorch_model*.bin``
only when the caller allows it, and then with ``torch.load(weights_only=True)``. Every problem is a
``ValueError`` naming the file.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import Iterable, Optional

import torch

__all__ = [
    "TOKENIZER_FILES",
    "HFWeights",
    "read_config",
    "open_weights",
    "write_hf_dir",
    "check_new_output",
]

# Files copied with a model (tokenizer and generation defaults); tokenizer.json is the one
# megatron.components.tokenizer reads, tokenizer_config.json gives it the EOS token.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)

_SAFETENSORS = "model.safetensors"
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE = "pytorch_model.bin"
_PICKLE_INDEX = "pytorch_model.bin.index.json"


def read_config(hf_dir: str) -> dict:
    """``config.json`` of a Hugging Face model directory as a dict."""
    if not os.path.isdir(hf_dir):
        raise ValueError(f"--hf-dir {hf_dir}: no such directory")
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--hf-dir {hf_dir}: no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


class HFWeights:
    """Lazy access to the tensors of a Hugging Face checkpoint.

    ``files``: the weight files; ``name2file``: {tensor name: file} from an index (None: every
    tensor of every file). ``shapes``/``dtypes``: per tensor, from the headers (safetensors) or the
    memory-mapped pickle; ``get(name)``: one tensor (CPU).
    """

    def __init__(self, files: list[str], reader: str, name2file: Optional[dict[str, str]] = None):
        self._reader = reader
        self._open: dict[str, object] = {}
        self.shapes: dict[str, tuple] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self._name2file: dict[str, str] = {}
        for path in files:
            handle = self._handle(path)
            present = list(handle.keys())
            if name2file is None:
                names = present
            else:
                names = [n for n, p in name2file.items() if p == path]
                absent = sorted(set(names) - set(present))
                if absent:
                    raise ValueError(
                        f"{path}: {len(absent)} tensor(s) listed in the index are not in the file "
                        f"(first: {', '.join(absent[:3])})"
                    )
            for name in names:
                if name in self._name2file:
                    raise ValueError(f"{path}: tensor {name} also appears in {self._name2file[name]}")
                self._name2file[name] = path
                if reader == "safetensors":
                    sl = handle.get_slice(name)
                    self.shapes[name] = tuple(sl.get_shape())
                    self.dtypes[name] = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                else:
                    tensor = handle[name]
                    if not isinstance(tensor, torch.Tensor):
                        raise ValueError(f"{path}: entry {name!r} is not a tensor")
                    self.shapes[name] = tuple(tensor.shape)
                    self.dtypes[name] = tensor.dtype

    def _handle(self, path: str):
        if path not in self._open:
            if self._reader == "safetensors":
                from safetensors import safe_open

                try:
                    self._open[path] = safe_open(path, framework="pt")
                except Exception as e:
                    raise ValueError(f"{path}: not a readable safetensors file ({_first_line(e)})") from None
            else:
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except Exception as e:
                    raise ValueError(f"{path}: cannot be read with torch.load(weights_only=True) "
                                     f"({_first_line(e)})") from None
                if not isinstance(state, dict):
                    raise ValueError(f"{path}: expected a dict of tensors")
                self._open[path] = state
        return self._open[path]

    def get(self, name: str) -> torch.Tensor:
        handle = self._handle(self._name2file[name])
        if self._reader == "safetensors":
            return handle.get_tensor(name)
        return handle[name]

    def dtype(self) -> torch.dtype:
        """The floating-point dtype of the weights (the most common one)."""
        counts: dict[torch.dtype, int] = {}
        for dt in self.dtypes.values():
            if dt is not None and dt.is_floating_point:
                counts[dt] = counts.get(dt, 0) + 1
        return max(counts, key=counts.get) if counts else torch.float32


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _read_index(path: str) -> dict[str, str]:
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        items = list(weight_map.items())
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a valid weight index ({_first_line(e)})") from None
    directory = os.path.dirname(path)
    missing = sorted({f for _, f in items if not os.path.isfile(os.path.join(directory, str(f)))})
    if missing:
        raise ValueError(f"{path}: {len(missing)} shard file(s) missing (first: {', '.join(missing[:3])})")
    return {name: os.path.join(directory, f) for name, f in items}


def open_weights(hf_dir: str, *, allow_pickle: bool = False) -> HFWeights:
    """The weights of ``hf_dir``: safetensors first; pickle only with ``allow_pickle``."""
    join = lambda name: os.path.join(hf_dir, name)  # noqa: E731
    if os.path.isfile(join(_SAFETENSORS_INDEX)):
        name2file = _read_index(join(_SAFETENSORS_INDEX))
        return HFWeights(sorted(set(name2file.values())), "safetensors", name2file)
    if os.path.isfile(join(_SAFETENSORS)):
        return HFWeights([join(_SAFETENSORS)], "safetensors")
    pickled = [n for n in (_PICKLE_INDEX, _PICKLE) if os.path.isfile(join(n))]
    if not pickled:
        raise ValueError(
            f"--hf-dir {hf_dir}: no weights ({_SAFETENSORS}, {_SAFETENSORS_INDEX}, or pickle {_PICKLE})"
        )
    if not allow_pickle:
        raise ValueError(
            f"--hf-dir {hf_dir} holds only pickle weights ({pickled[0]}); pass --allow-pickle to read "
            "them with torch.load(weights_only=True)"
        )
    if pickled[0] == _PICKLE_INDEX:
        name2file = _read_index(join(_PICKLE_INDEX))
        return HFWeights(sorted(set(name2file.values())), "pickle", name2file)
    return HFWeights([join(_PICKLE)], "pickle")


def check_new_output(path: str, flag: str = "--out") -> None:
    """Refuse an output path that exists (we never write into or over existing files)."""
    if os.path.lexists(path):
        raise ValueError(f"{flag} {path} already exists; refusing to overwrite it")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: parent directory {parent} does not exist")


def write_hf_dir(out_dir: str, tensors: dict[str, torch.Tensor], config_writer, extra_files: Iterable[str] = (),
                 metadata: Optional[dict] = None) -> str:
    """Write ``model.safetensors`` + ``config.json`` (``config_writer(tmp_dir)``) + copies of
    ``extra_files`` into a temporary sibling directory, then rename it to ``out_dir``."""
    from safetensors.torch import save_file

    check_new_output(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = os.path.join(parent, f".tmp-{os.path.basename(os.path.abspath(out_dir))}-{secrets.token_hex(4)}")
    os.makedirs(tmp)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, _SAFETENSORS),
                  metadata={"format": "pt", **(metadata or {})})
        config_writer(tmp)
        for src in extra_files:
            shutil.copyfile(src, os.path.join(tmp, os.path.basename(src)))
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
