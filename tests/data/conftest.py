"""Fixtures for the data-layer tests: paths to the shared data and a small synthetic indexed
dataset."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = Path(os.environ.get("SHARED_DATA_DIR", REPO.parent / "shared" / "data"))

requires_shared_data = pytest.mark.skipif(
    not (SHARED_DATA / "pretrain").is_dir(),
    reason=f"shared data directory {SHARED_DATA} is absent (set SHARED_DATA_DIR to use another)",
)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from megatron.components.tokenizer import DEFAULT_TOKENIZER_MODEL, build_tokenizer

    return build_tokenizer("HuggingFaceTokenizer", DEFAULT_TOKENIZER_MODEL)


def synthetic_documents(num_documents: int, seed: int, vocab_size: int = 1000):
    """``num_documents`` lists of 5..60 random ids in [0, vocab_size), each followed by the
    ``NullTokenizer(vocab_size)`` EOD (id ``vocab_size``)."""
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, vocab_size, size=int(rng.integers(5, 61))).tolist() + [vocab_size]
        for _ in range(num_documents)
    ]


@pytest.fixture(scope="session")
def synthetic_datasets(tmp_path_factory):
    """Two indexed datasets (100 and 60 documents) in NullTokenizer(1000) ids, and their docs."""
    from megatron.training.preprocess import write_indexed_dataset
    from megatron.components.tokenizer import NullTokenizer

    tok = NullTokenizer(1000)
    root = tmp_path_factory.mktemp("synthetic")
    out = {"tokenizer": tok, "root": root}
    for name, n, seed in (("a", 100, 1), ("b", 60, 2)):
        docs = synthetic_documents(n, seed)
        prefix = str(root / f"{name}_text_document")
        write_indexed_dataset(docs, prefix, tok.vocab_size)
        out[name] = (prefix, docs)
    return out
