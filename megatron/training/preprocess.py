"""Writing indexed datasets: ``read_text_documents`` (plain text -> documents),
``write_indexed_dataset`` (token documents -> megatron-core ``.bin``/``.idx``, atomically) and
``ensure_embedded_dataset`` (the shipped tiny-shakespeare corpus, preprocessed once into a cache
directory). ``scripts/preprocess_data.py`` (``tools.data.preprocess_data``) is the command-line
front end; training reads what this writes through ``megatron.training.data``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from megatron.common import collectives
from megatron.common.cli import UserError

__all__ = [
    "DOCUMENT_BOUNDARIES",
    "IndexedDatasetStats",
    "read_text_documents",
    "indexed_dataset_paths",
    "indexed_dataset_exists",
    "check_outputs_free",
    "write_indexed_dataset",
    "ensure_embedded_dataset",
]

DOCUMENT_BOUNDARIES = ("blank-line", "file")


@dataclasses.dataclass(frozen=True)
class IndexedDatasetStats:
    """What ``write_indexed_dataset`` wrote."""

    prefix: str
    num_documents: int
    num_tokens: int
    dtype: str


def read_text_documents(path: str, boundary: str = "blank-line") -> Iterator[str]:
    """Documents of a UTF-8 text file.

    ``blank-line``: each run of non-blank lines is a document (its line breaks kept, the final
    one dropped); blank or whitespace-only lines only separate documents. ``file``: the whole
    file is one document, byte for byte. Streams, so the file may be larger than memory.
    """
    if boundary not in DOCUMENT_BOUNDARIES:
        raise UserError(
            f"--document-boundary: unknown value {boundary!r} (choose from {', '.join(DOCUMENT_BOUNDARIES)})"
        )
    if not os.path.isfile(path):
        raise UserError(f"--input: no such file: {path}")
    try:
        with open(path, encoding="utf-8", newline="") as f:
            if boundary == "file":
                text = f.read()
                if text.strip():
                    yield text
                return
            block: list[str] = []
            for line in f:
                if line.strip():
                    block.append(line)
                elif block:
                    yield "".join(block).rstrip("\r\n")
                    block = []
            if block:
                yield "".join(block).rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise UserError(f"--input: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def indexed_dataset_paths(prefix: str) -> tuple[str, str]:
    """(``prefix.bin``, ``prefix.idx``)."""
    return prefix + ".bin", prefix + ".idx"


def check_outputs_free(prefixes: Sequence[str], overwrite: bool) -> None:
    """Refuse (``UserError`` naming the file) when an output exists and ``overwrite`` is off."""
    if overwrite:
        return
    for prefix in prefixes:
        for path in indexed_dataset_paths(prefix):
            if os.path.exists(path):
                raise UserError(f"--output-prefix: {path} exists (pass --overwrite to replace it)")


def write_indexed_dataset(
    documents: Iterable[Sequence[int]],
    output_prefix: str,
    vocab_size: int,
    overwrite: bool = False,
) -> IndexedDatasetStats:
    """Write token documents as a megatron-core ``IndexedDataset`` (``.bin`` + ``.idx``).

    One sequence per document (Megatron-LM's layout without sentence splitting); empty documents
    are skipped. The token dtype is ``uint16`` when ``vocab_size`` allows, else ``int32``
    (``DType.optimal_dtype``). Both files are written under temporary names in the output
    directory and renamed into place only when complete: ``.bin`` first, then ``.idx``, so a
    reader (which needs both) never sees a new index over an old data file. An existing output
    or no documents is a ``UserError`` (an existing output unless ``overwrite``: it is then
    replaced, never modified in place).
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    check_outputs_free([output_prefix], overwrite)
    out_dir = os.path.dirname(os.path.abspath(output_prefix)) or "."
    os.makedirs(out_dir, exist_ok=True)
    dtype = DType.optimal_dtype(vocab_size)
    max_id = np.iinfo(dtype).max
    tmp_prefix = os.path.join(out_dir, f".{os.path.basename(output_prefix)}.tmp{os.getpid()}")
    tmp_bin, tmp_idx = indexed_dataset_paths(tmp_prefix)
    num_documents = num_tokens = 0
    try:
        builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        try:
            for doc in documents:
                arr = np.asarray(doc, dtype=np.int64)
                if arr.size == 0:
                    continue
                if arr.min() < 0 or arr.max() > max_id:
                    raise ValueError(
                        f"token id {int(arr.max() if arr.max() > max_id else arr.min())} does not fit "
                        f"{np.dtype(dtype).name} (vocab size {vocab_size})"
                    )
                builder.add_document(arr.astype(dtype), [arr.size])
                num_documents += 1
                num_tokens += arr.size
        finally:
            builder.data_file.close()
        if num_documents == 0:
            raise UserError(f"no documents to write to {output_prefix} (is the input empty?)")
        builder.finalize(tmp_idx)
        for path in (tmp_bin, tmp_idx):
            _fsync(path)
        final_bin, final_idx = indexed_dataset_paths(output_prefix)
        if overwrite and os.path.exists(final_idx):
            os.unlink(final_idx)  # never leave the old index next to the new data
        os.replace(tmp_bin, final_bin)
        os.replace(tmp_idx, final_idx)
    finally:
        for path in (tmp_bin, tmp_idx):
            if os.path.exists(path):
                os.unlink(path)
    return IndexedDatasetStats(output_prefix, num_documents, num_tokens, np.dtype(dtype).name)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_embedded_dataset(cache_dir: str) -> str:
    """Preprocess the shipped tiny-shakespeare corpus with the shipped BPE into ``cache_dir``
    (once) and return the ``--data-path`` prefix.

    Documents are blank-line separated blocks (speeches), each followed by ``<|endoftext|>``.
    The prefix name carries a hash of the corpus and tokenizer files, so a changed asset is
    preprocessed afresh. Under ``torch.distributed`` rank 0 writes and the others wait.
    """
    from megatron.components.tokenizer import DEFAULT_CORPUS, DEFAULT_TOKENIZER_MODEL, build_tokenizer

    digest = hashlib.sha256()
    for path in (DEFAULT_CORPUS, DEFAULT_TOKENIZER_MODEL):
        with open(path, "rb") as f:
            digest.update(f.read())
    prefix = os.path.join(cache_dir, f"tinyshakespeare-{digest.hexdigest()[:10]}_text_document")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not indexed_dataset_exists(prefix) and (not distributed or torch.distributed.get_rank() == 0):
        tokenizer = build_tokenizer("HuggingFaceTokenizer", DEFAULT_TOKENIZER_MODEL)
        docs = list(read_text_documents(DEFAULT_CORPUS, "blank-line"))
        token_docs = (ids + [tokenizer.eod] for ids in tokenizer.tokenize_batch(docs))
        # Same bytes whoever writes them, so replacing a concurrently written copy is harmless.
        write_indexed_dataset(token_docs, prefix, tokenizer.vocab_size, overwrite=True)
    if distributed:
        collectives.barrier()
    return prefix


def indexed_dataset_exists(prefix: str) -> bool:
    """Whether both files of the indexed dataset at ``prefix`` exist."""
    return all(os.path.isfile(p) for p in indexed_dataset_paths(prefix))
