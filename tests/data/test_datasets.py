"""GPT datasets through megatron-core's builder: split ranges, sample counts, blends, order,
exact resume, the distributed build, held-out windows and bad input.

Sample counts are checked against hand computations of megatron-core's rules; token contents
are compared exactly.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from megatron.common.cli import UserError
from megatron.training import data, preprocess
from tools.spawn import run_distributed
from megatron.components.tokenizer import DEFAULT_CORPUS

from .conftest import SHARED_DATA, requires_shared_data

SEQ = 32


def build(prefixes, tokenizer, cache, split="80,15,5", num_samples=(40, 10, 5), seed=1234, **kw):
    return data.build_pretraining_datasets(prefixes, split, SEQ, seed, num_samples, tokenizer, str(cache), **kw)


def first_tokens(dataset, n):
    return torch.stack([dataset[i]["tokens"] for i in range(n)])


def test_compiled_helpers_are_present():
    """megatron-core's C++ index builders import (shipped compiled in the wheel) and work."""
    data.ensure_dataset_helpers()
    from megatron.core.datasets import helpers

    sizes = np.array([3, 4, 5], dtype=np.int32)
    sample_idx = helpers.build_sample_idx(sizes, np.arange(3, dtype=np.int32), 4, 1, 12, True, True)
    # 12 tokens, samples of 4 (+1 overlap): (12 - 1) // 4 = 2 samples, so 3 bookends at global
    # tokens 0, 4, 8 = (doc 0, offset 0), (doc 1, offset 1), (doc 2, offset 1)
    assert sample_idx.tolist() == [[0, 0], [1, 1], [2, 1]]


def test_split_ranges_and_sample_counts(synthetic_datasets, tmp_path):
    prefix, docs = synthetic_datasets["a"]
    tok = synthetic_datasets["tokenizer"]
    train, valid, test = build(prefix, tok, tmp_path)
    # contiguous document ranges: 80/15/5 of 100 documents
    assert train.indices.tolist() == list(range(0, 80))
    assert valid.indices.tolist() == list(range(80, 95))
    assert test.indices.tolist() == list(range(95, 100))
    for ds, (beg, end), wanted in ((train, (0, 80), 40), (valid, (80, 95), 10), (test, (95, 100), 5)):
        tokens = sum(len(d) for d in docs[beg:end])
        epochs = math.ceil((wanted * SEQ + 1) / tokens)  # whole epochs until enough tokens
        assert len(ds) == (epochs * tokens - 1) // SEQ >= wanted
    # a sample is seq+1 consecutive tokens of the shuffled document stream, shifted for labels
    stream = np.concatenate([docs[d] for d in train.document_index])
    for i in (0, 7, len(train) - 1):
        item = train[i]
        j = int(train.shuffle_index[i])
        beg = int(sum(len(docs[d]) for d in train.document_index[: train.sample_index[j][0]]) + train.sample_index[j][1])
        assert item["tokens"].tolist() == stream[beg : beg + SEQ].tolist()
        assert item["labels"].tolist() == stream[beg + 1 : beg + SEQ + 1].tolist()
        assert item["loss_mask"].tolist() == [1.0] * SEQ
        assert item["position_ids"].tolist() == list(range(SEQ))
    assert "attention_mask" not in train[0]
    assert build(prefix, tok, tmp_path, split="90,10,0")[2] is None
    masked = build(prefix, tok, tmp_path, eod_mask_loss=True, create_attention_mask=True)[0][0]
    assert masked["attention_mask"].shape == (1, SEQ, SEQ)
    assert torch.equal(masked["loss_mask"] == 0, masked["tokens"] == tok.eod)


def test_weighted_and_unweighted_blends(synthetic_datasets, tmp_path):
    (a, docs_a), (b, docs_b) = synthetic_datasets["a"], synthetic_datasets["b"]
    tok = synthetic_datasets["tokenizer"]
    sizes = (200, 20, 8)
    train, valid, test = build(["1", a, "3", b], tok, tmp_path, num_samples=sizes)
    for ds, n in zip((train, valid, test), sizes):
        counts = np.bincount(ds.dataset_index, minlength=2).tolist()
        assert counts == [math.ceil(n * 0.25), math.ceil(n * 0.75)]  # per-dataset ceil(n * w)
        assert len(ds) == sum(counts)
    assert {int(train[i]["dataset_id"]) for i in range(8)} == {0, 1}
    # without weights: blended by token counts, and the requested count is still met
    tokens = [sum(map(len, docs_a)), sum(map(len, docs_b))]
    train_u = build([a, b], tok, tmp_path, num_samples=sizes)[0]
    assert len(train_u) == sum(math.ceil(200 * t / sum(tokens)) for t in tokens) >= 200


def test_order_is_deterministic_and_seeded(synthetic_datasets, tmp_path):
    prefix, _ = synthetic_datasets["a"]
    tok = synthetic_datasets["tokenizer"]
    one = first_tokens(build(prefix, tok, tmp_path / "c1")[0], 16)
    two = first_tokens(build(prefix, tok, tmp_path / "c2")[0], 16)  # rebuilt, not a cache hit
    cached = first_tokens(build(prefix, tok, tmp_path / "c1")[0], 16)
    other_seed = first_tokens(build(prefix, tok, tmp_path / "c1", seed=99)[0], 16)
    assert torch.equal(one, two) and torch.equal(one, cached)
    assert not torch.equal(one, other_seed)


def test_resume_at_consumed_samples(synthetic_datasets, tmp_path):
    """Iterating from consumed = k * global batch gives exactly batches k, k+1, ... of the
    uninterrupted iterator; two data-parallel ranks together see the dp=1 global batches."""
    prefix, _ = synthetic_datasets["a"]
    train = build(prefix, synthetic_datasets["tokenizer"], tmp_path)[0]
    mbs = 3
    full = [b["tokens"] for _, b in zip(range(8), data.build_data_iterator(train, mbs))]
    resumed = [b["tokens"] for _, b in zip(range(5), data.build_data_iterator(train, mbs, consumed_samples=3 * mbs))]
    assert all(torch.equal(x, y) for x, y in zip(full[3:], resumed))
    ranks = [list(zip(range(4), data.build_data_iterator(train, mbs, 0, r, 2))) for r in range(2)]
    wide = [b["tokens"] for _, b in zip(range(4), data.build_data_iterator(train, 2 * mbs))]
    for step in range(4):
        assert torch.equal(torch.cat([ranks[0][step][1]["tokens"], ranks[1][step][1]["tokens"]]), wide[step])
    # workers prefetch without changing the order; cyclic restarts where it began
    with_workers = [b["tokens"] for _, b in zip(range(4), data.build_data_iterator(train, mbs, num_workers=1))]
    assert all(torch.equal(x, y) for x, y in zip(full, with_workers))
    n = len(train) // mbs
    cyc = [b["tokens"] for _, b in zip(range(n + 2), data.build_data_iterator(train, mbs, cyclic=True))]
    assert torch.equal(cyc[n], full[0]) and torch.equal(cyc[n + 1], full[1])
    assert len(list(data.build_data_iterator(train, mbs, consumed_samples=len(train) - mbs))) == 1


def test_train_valid_test_num_samples():
    # Megatron-LM: valid = (train_iters // eval_interval + 1) * eval_iters * gbs, test = eval_iters * gbs
    assert data.get_train_valid_test_num_samples(100, 8, 25, 2) == (800, 5 * 2 * 8, 16)


def _build_on_rank(rank, world_size, prefix_a, prefix_b, cache):
    from megatron.components.tokenizer import NullTokenizer

    tok = NullTokenizer(1000)
    single = data.build_pretraining_datasets(prefix_a, "80,15,5", SEQ, 7, (40, 10, 5), tok, cache)
    blend = data.build_pretraining_datasets(["1", prefix_a, "3", prefix_b], "80,15,5", SEQ, 7, (40, 10, 5), tok, cache)
    it = data.build_data_iterator(single[0], 2, 0, rank, world_size)
    return {
        "single": [first_tokens(ds, 4) for ds in single],
        "blend": [first_tokens(ds, 4) for ds in blend],
        "batch": next(it)["tokens"],
    }


def test_distributed_build_two_ranks(synthetic_datasets, tmp_path):
    """2 gloo ranks: rank 0 builds and caches the indices, rank 1 loads them; both see the same
    samples as a single-process build, and their micro-batches are disjoint slices."""
    (a, _), (b, _) = synthetic_datasets["a"], synthetic_datasets["b"]
    cache = str(tmp_path / "cache")
    out = run_distributed(_build_on_rank, 2, a, b, cache, timeout_s=120)
    local = _build_on_rank(0, 1, a, b, str(tmp_path / "local"))
    for key in ("single", "blend"):
        for r in range(2):
            assert all(torch.equal(x, y) for x, y in zip(out[r][key], local[key]))
    assert torch.equal(torch.cat([out[0]["batch"], out[1]["batch"]]), first_tokens(data.build_pretraining_datasets(
        a, "80,15,5", SEQ, 7, (40, 10, 5), synthetic_datasets["tokenizer"], cache)[0], 4))
    names = os.listdir(cache)
    assert sum(n.endswith("GPTDataset-train-shuffle_index.npy") for n in names) == 3  # a, a in blend, b
    assert sum(n.endswith("BlendedDataset-train-dataset_index.npy") for n in names) == 1  # cached under dist


def test_embedded_dataset(tmp_path, tiny_tokenizer):
    prefix = preprocess.ensure_embedded_dataset(str(tmp_path))
    mtime = os.path.getmtime(prefix + ".bin")
    assert preprocess.ensure_embedded_dataset(str(tmp_path)) == prefix and os.path.getmtime(prefix + ".bin") == mtime
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    with open(DEFAULT_CORPUS, encoding="utf-8") as f:
        first_block = f.read().split("\n\n")[0]
    assert ds[0].tolist() == tiny_tokenizer.tokenize(first_block) + [tiny_tokenizer.eod]
    assert len(ds) == 7222
    train, valid, test = data.build_pretraining_datasets(prefix, "969,30,1", 128, 1, (64, 16, 16), tiny_tokenizer, str(tmp_path / "c"))
    assert len(train) >= 64 and len(valid) >= 16 and len(test) >= 16


def test_heldout_windows(tmp_path, tiny_tokenizer):
    text = open(DEFAULT_CORPUS, encoding="utf-8").read()[:5000]
    path = tmp_path / "heldout.txt"
    path.write_text(text, encoding="utf-8")
    ids = tiny_tokenizer.tokenize(text)
    windows = data.build_heldout_windows(str(path), tiny_tokenizer, 64)
    n = (len(ids) - 1) // 64
    assert windows.shape == (n, 65) and windows.dtype == torch.long
    # labels windows[:, 1:] tile ids[1 : n*64 + 1] exactly once
    assert windows[:, 1:].reshape(-1).tolist() == ids[1 : n * 64 + 1]
    assert windows[:, :-1].reshape(-1).tolist() == ids[: n * 64]
    # user errors (one line in every command that reads held-out text: pretrain_gpt, distill.fcsd, distill.report)
    with pytest.raises(UserError, match="fewer than one window"):
        data.build_heldout_windows(str(path), tiny_tokenizer, len(ids))
    with pytest.raises(UserError, match="no such file"):
        data.build_heldout_windows(str(tmp_path / "none.txt"), tiny_tokenizer, 64)


@requires_shared_data
def test_heldout_windows_wikitext2_test():
    from megatron.components.tokenizer import build_tokenizer

    gpt2 = SHARED_DATA / "tokenizers" / "gpt2"
    tok = build_tokenizer("HuggingFaceTokenizer", str(gpt2 / "tokenizer.json"))
    path = SHARED_DATA / "pretrain/wikitext-2/test.txt"
    windows = data.build_heldout_windows(str(path), tok, 1024)
    # GPT-2 tokens of WikiText-2 test: 295,877 (the ids themselves are checked on the small file above)
    assert windows.shape == ((295877 - 1) // 1024, 1025)
    assert tok.detokenize(windows[0].tolist()) == path.read_text(encoding="utf-8")[: len(tok.detokenize(windows[0].tolist()))]


def test_bad_data_arguments(synthetic_datasets, tmp_path):
    prefix, _ = synthetic_datasets["a"]
    tok = synthetic_datasets["tokenizer"]
    cases = [
        (dict(prefixes=str(tmp_path / "missing")), "--data-path: no indexed dataset at"),
        (dict(prefixes=["0.5", prefix, prefix]), "--data-path: expected"),
        (dict(prefixes=["-1", prefix]), "weights must be positive"),
        (dict(prefixes=prefix, split="a,b"), "--split: expected"),
        (dict(prefixes=prefix, split="0,0,0"), "--split: expected"),
        (dict(prefixes=prefix, split="998,1,1"), "leaves the valid split"),  # 100 docs: 0.1 of one
    ]
    from megatron.common.cli import UserError

    for kwargs, message in cases:  # UserError: one line from the commands, with no user_input() around the build
        with pytest.raises(UserError, match=message.replace("(", r"\(")) as info:
            build(kwargs.pop("prefixes"), tok, tmp_path, **kwargs)
        assert "\n" not in str(info.value)
    train = build(prefix, tok, tmp_path)[0]
    with pytest.raises(ValueError, match="consumed samples"):
        data.build_data_iterator(train, 2, consumed_samples=len(train) + 1)
