"""Profile builder, on-disk format and vocabulary extension.

All comparisons are exact (integer counts, index arrays) except the cosine nearest neighbour,
which is checked against a float64 brute force on a table with well-separated similarities.
"""

import os

import numpy as np
import pytest

from moe_variants.semmoe.profile import (
    extend_vocabulary,
    load_profile,
    profile_from_traces,
    save_profile,
    split_profile,
)
from moe_variants.semmoe.synthetic import SyntheticConfig, synthetic_profile

V, N, L, K = 50, 8, 3, 2


def _traces(seed=0, num_requests=6):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_requests):
        s = int(rng.integers(3, 9))
        tok = rng.integers(0, V // 2, size=s)  # the upper half of the vocabulary is never seen
        topk = np.stack([np.stack([rng.choice(N, K, replace=False) for _ in range(s)]) for _ in range(L)])
        out.append((tok, topk))
    return out


def test_counts_match_traces():
    traces = _traces()
    p = profile_from_traces(traces, V, N, meta={"hidden_size": 16})
    expect = np.zeros((L, V, N), dtype=np.int64)
    for tok, topk in traces:
        for l in range(L):
            for s, t in enumerate(tok):
                for e in topk[l, s]:
                    expect[l, t, e] += 1
    for l in range(L):
        np.testing.assert_array_equal(p.counts[l].toarray(), expect[l])
    np.testing.assert_array_equal(p.token_freq, np.bincount(np.concatenate([t for t, _ in traces]), minlength=V))
    assert p.num_requests == len(traces)
    assert p.routes.dtype == np.uint8
    np.testing.assert_array_equal(p.request_lengths(), [len(t) for t, _ in traces])
    cp = p.confidence(0)
    seen = p.token_freq > 0
    np.testing.assert_allclose(np.asarray(cp.sum(1)).ravel()[seen], 1.0)


def test_save_load_roundtrip(tmp_path):
    p = profile_from_traces(_traces(), V, N, meta={"hidden_size": 16, "model": "toy"})
    path = tmp_path / "p.npz"
    save_profile(p, path)
    assert os.listdir(tmp_path) == ["p.npz"]  # no temporary file left behind
    q = load_profile(path)
    assert (q.vocab_size, q.num_experts, q.top_k, q.meta) == (p.vocab_size, p.num_experts, p.top_k, p.meta)
    for name in ("token_ids", "request_offsets", "routes", "token_freq", "nn_source"):
        np.testing.assert_array_equal(getattr(q, name), getattr(p, name))
    for a, b in zip(p.counts, q.counts):
        assert (a != b).nnz == 0


def test_missing_and_corrupt_files_give_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="no such semmoe-profile file"):
        load_profile(tmp_path / "absent.npz")
    p = profile_from_traces(_traces(), V, N)
    good = tmp_path / "good.npz"
    save_profile(p, good)
    data = good.read_bytes()
    for name, payload in [("trunc.npz", data[: len(data) // 2]), ("junk.npz", b"not a profile")]:
        (tmp_path / name).write_bytes(payload)
        with pytest.raises(ValueError) as e:
            load_profile(tmp_path / name)
        assert name in str(e.value) and "\n" not in str(e.value)
    np.savez(tmp_path / "other.npz", x=np.zeros(2))
    with pytest.raises(ValueError, match="not a semmoe-profile file"):
        load_profile(tmp_path / "other.npz")


def test_failed_write_keeps_previous_file(tmp_path):
    p = profile_from_traces(_traces(), V, N)
    path = tmp_path / "p.npz"
    save_profile(p, path)
    before = path.read_bytes()
    p.token_ids = p.token_ids[:-1]  # now inconsistent: validate() raises before anything is written
    with pytest.raises(ValueError, match="invalid profile"):
        save_profile(p, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["p.npz"]


def test_trace_validation():
    tok = np.array([1, 2, 3])
    with pytest.raises(ValueError, match="trace 0"):
        profile_from_traces([(tok, np.zeros((L, 2, K), dtype=int))], V, N)
    with pytest.raises(ValueError, match="expert ids"):
        profile_from_traces([(tok, np.full((L, 3, K), N))], V, N)
    with pytest.raises(ValueError, match="token ids"):
        profile_from_traces([(np.array([V]), np.zeros((L, 1, K), dtype=int))], V, N)


def test_extend_vocabulary_is_cosine_nearest_seen_token():
    p = profile_from_traces(_traces(), V, N)
    rng = np.random.default_rng(1)
    emb = rng.normal(size=(V, 12))
    emb[V - 1] = 0.0  # a zero row has no direction: stays uncovered
    q = extend_vocabulary(p, emb, chunk_size=7)
    seen = np.flatnonzero(p.token_freq > 0)
    unit = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-30)
    for t in range(V):
        if p.token_freq[t] > 0:
            assert q.nn_source[t] == t
        elif t == V - 1:
            assert q.nn_source[t] == -1
        else:
            assert q.nn_source[t] == seen[np.argmax(unit[seen] @ unit[t])]
    assert q.meta["vocab_extended"] == int((p.token_freq == 0).sum()) - 1


def test_split_partitions_requests():
    p = synthetic_profile(SyntheticConfig(num_requests=50, num_layers=2), seed=3)
    a, b = split_profile(p, 0.2, seed=0)
    assert (a.num_requests, b.num_requests) == (10, 40)
    assert a.num_tokens + b.num_tokens == p.num_tokens
    for l in range(p.num_layers):
        assert ((a.counts[l] + b.counts[l]) != p.counts[l]).nnz == 0
    with pytest.raises(ValueError, match="fraction"):
        split_profile(p, 1.5)


def test_a_subset_records_its_own_request_ids():
    """``split`` (and ``lar --limit``'s prediction) keep each request's id with it: a part that kept
    the whole set's ids would be taken for a profile of every prompt (``lar --profile``) and give
    ``evaluate --split-ids`` domains of other requests."""
    p = synthetic_profile(SyntheticConfig(num_requests=20, num_layers=2), seed=3)
    p.meta["request_ids"] = [f"d{i % 3}:{i}" for i in range(p.num_requests)]
    a, b = split_profile(p, 0.25, seed=0)
    for part in (a, b):
        ids = part.meta["request_ids"]
        assert len(ids) == part.num_requests
        for j, rid in enumerate(ids):
            i = int(rid.split(":")[1])
            assert np.array_equal(part.token_ids[part.request_offsets[j]:part.request_offsets[j + 1]],
                                  p.token_ids[p.request_offsets[i]:p.request_offsets[i + 1]])
    assert sorted(a.meta["request_ids"] + b.meta["request_ids"]) == sorted(p.meta["request_ids"])
    assert p.select_requests(np.array([4, 1])).meta["request_ids"] == ["d1:4", "d1:1"]
