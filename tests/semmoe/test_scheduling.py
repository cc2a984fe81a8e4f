"""Algorithms 2 and 3 as pure functions (exact comparisons: everything is integer indexing)."""

import numpy as np
import pytest
import torch

from moe_variants.semmoe.scheduling import (
    DPRequestScheduler,
    align_to_ranks,
    assign_tokens,
    choose_dp_rank,
    inverse_permutation,
    pad_assignment,
    predict_token_devices,
    rebatch_permutation,
    rebatch_tokens,
    request_device_scores,
    resume_tokens,
    schedule_requests,
    shuffle_local,
)
from moe_variants.semmoe.tables import Tables

D = 4


def _tables(num_layers=3, vocab=20, seed=0):
    rng = np.random.default_rng(seed)
    e2d = np.stack([rng.permutation(np.arange(8) % D) for _ in range(num_layers)])
    t = rng.integers(0, D, size=(num_layers, vocab)).astype(np.int16)
    t[:, -2:] = -1  # two tokens without a prediction
    tp = rng.random((num_layers, vocab)).astype(np.float32)
    tp[:, -2:] = 0
    seq = rng.integers(0, D, size=(num_layers, D * D)).astype(np.int16)
    seq[:2] = -1
    seq_conf = rng.random((num_layers, D * D)).astype(np.float32)
    seq_conf[:2] = 0
    return Tables("semmoe", D, e2d, t, tp, seq, seq_conf, lookback=2)


def test_request_scores_are_confidence_weighted_votes():
    tab = _tables()
    toks = np.array([0, 3, 3, 19])
    expect = np.zeros(D)
    for l in range(tab.num_layers):
        for tok in toks:
            if tab.token2device[l, tok] >= 0:
                expect[tab.token2device[l, tok]] += tab.token2device_conf[l, tok]
    scores = request_device_scores(toks, tab.token2device, tab.token2device_conf, D)
    np.testing.assert_allclose(scores, expect, rtol=1e-6)
    with pytest.raises(ValueError, match="token ids"):
        request_device_scores(np.array([20]), tab.token2device, tab.token2device_conf, D)


def test_rotating_mask_covers_all_ranks_every_round():
    tab = _tables()
    rng = np.random.default_rng(1)
    requests = [rng.integers(0, 20, size=rng.integers(1, 9)) for _ in range(4 * D + 2)]
    ranks = schedule_requests(requests, tab)
    for r in range(4):
        assert sorted(ranks[r * D : (r + 1) * D].tolist()) == list(range(D))
    # the first request of a round takes its best-scoring rank
    s = request_device_scores(requests[0], tab.token2device, tab.token2device_conf, D)
    assert ranks[0] == int(np.argmax(s))
    # a masked rank is skipped even if it scores best
    dev, nxt = choose_dp_rank(np.array([5.0, 1.0, 0.0, 0.0]), np.array([False, True, True, True]))
    assert dev == 1 and nxt.tolist() == [False, False, True, True]
    dev, nxt = choose_dp_rank(np.array([5.0, 1.0, 0.0, 0.0]), np.array([False, False, False, True]))
    assert dev == 3 and nxt.all()  # round complete: mask resets


def test_scheduler_needs_token_tables():
    with pytest.raises(ValueError, match="no token table"):
        DPRequestScheduler(Tables("contiguous", D, np.zeros((1, 4), dtype=int) + np.arange(4)))


def test_prediction_picks_the_more_confident_table():
    t = torch.tensor([0, 1, 2, -1])
    tp = torch.tensor([0.9, 0.2, 0.5, 0.0])
    seq = torch.tensor([3, 3, 3, 3])
    seq_conf = torch.tensor([0.5, 0.5, 0.5, 0.5])
    toks = torch.tensor([0, 1, 2, 3])
    prev = torch.zeros(4, 1, dtype=torch.long)
    pred, conf = predict_token_devices(toks, 4, t, tp, seq, seq_conf, prev)
    assert pred.tolist() == [0, 3, 3, 3]  # Tp > Ap only for token 0; ties go to A
    assert torch.equal(conf, torch.tensor([0.9, 0.5, 0.5, 0.5]))
    pred, conf = predict_token_devices(toks, 4, t, tp)
    assert pred.tolist() == [0, 1, 2, -1]


def test_align_gives_equal_slices_keeps_confident_tokens():
    pred = torch.tensor([0, 0, 0, 1, 0, 2, 0, -1])
    conf = torch.tensor([0.1, 0.9, 0.5, 0.8, 0.7, 0.6, 0.2, 0.0])
    out = align_to_ranks(pred, conf, 4)
    assert torch.bincount(out, minlength=4).tolist() == [2, 2, 2, 2]
    # device 0 is wanted by 5 tokens; the two most confident (1: 0.9, 4: 0.7) stay
    assert sorted(torch.nonzero(out == 0).squeeze(1).tolist()) == [1, 4]
    assert out[3] == 1 and out[5] == 2
    # overflow (tokens 0, 2, 6 by position) and the unpredicted token 7 (natural slice 3) fill
    # the free slots lowest device first: 1, 2, 3
    assert out[[0, 2, 6, 7]].tolist() == [1, 2, 3, 3]


def test_align_with_segments_and_uneven_lengths():
    rng = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 8, 3, 12])
    n = int(lengths.sum())
    pred = torch.randint(-1, D, (n,), generator=rng)
    conf = torch.rand(n, generator=rng)
    out = align_to_ranks(pred, conf, D, lengths)
    start = 0
    for length in lengths.tolist():
        seg = out[start : start + length]
        cap = -(-length // D)
        assert int(torch.bincount(seg, minlength=D).max()) <= cap
        start += length
    # with everything unpredicted, a segment is split into its natural contiguous slices
    nat = align_to_ranks(torch.full((8,), -1), torch.zeros(8), D)
    assert nat.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_rebatch_round_trip_moves_metadata_with_tokens():
    tab = _tables()
    gen = torch.Generator().manual_seed(3)
    n = 16
    tokens = torch.randint(0, 20, (n,), generator=gen)
    prev = torch.randint(0, D, (n, 2), generator=gen)
    hidden = torch.randn(n, 5, generator=gen)
    positions = torch.arange(n) + 100
    perm = rebatch_tokens(tokens, tab, layer=2, prev_devices=prev)
    assert sorted(perm.tolist()) == list(range(n))
    shuffled = hidden[perm]
    # each rank's slice holds exactly the tokens aligned to it, in their original order
    layer_tables = (tab.token2device, tab.token2device_conf, tab.seq2device, tab.seq2device_conf)
    pred, conf = predict_token_devices(tokens, D, *(torch.as_tensor(x[2]) for x in layer_tables), prev)
    assigned = align_to_ranks(pred, conf, D)
    for r in range(D):
        rows = perm[r * n // D : (r + 1) * n // D]
        assert torch.all(assigned[rows] == r) and torch.all(rows[1:] > rows[:-1])
        (pos_local, tok_local) = shuffle_local(perm, r, D, positions, tokens)
        assert torch.equal(pos_local, positions[rows]) and torch.equal(tok_local, tokens[rows])
    assert torch.equal(resume_tokens(shuffled, perm), hidden)
    assert torch.equal(perm[inverse_permutation(perm)], torch.arange(n))


def test_rebatch_permutation_rejects_unaligned_assignments():
    with pytest.raises(ValueError, match="not aligned"):
        rebatch_permutation(torch.tensor([0, 0, 0, 1]), 2)
    with pytest.raises(ValueError, match="evenly"):
        rebatch_permutation(torch.tensor([0, 0, 1]), 2)


def test_pad_assignment_fills_free_slots_lowest_rank_first():
    assigned = torch.tensor([1, 1, 0, 2, 2, 1, 0])  # n = 7, W = 3 -> 3 slots per rank
    padded = pad_assignment(assigned, 3)
    assert padded[:7].tolist() == assigned.tolist() and padded[7:].tolist() == [0, 2]
    # the engine may pad further than the next multiple of W: 12 rows, 4 per rank
    padded = pad_assignment(assigned, 3, total=12)
    assert padded[:7].tolist() == assigned.tolist() and padded[7:].tolist() == [0, 0, 1, 2, 2]
    assert pad_assignment(torch.zeros(0, dtype=torch.long), 2, total=4).tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="not aligned"):
        pad_assignment(torch.tensor([0, 0, 0, 1]), 2)
    with pytest.raises(ValueError, match="equal slices"):
        pad_assignment(assigned, 3, total=10)


def test_assign_tokens_predicts_real_tokens_and_pads_the_rest():
    """Only the first ``num_real`` tokens are predicted and aligned (to ceil(num_real / W) per
    rank); the padding takes the free slots. Unscheduled tables give contiguous slices."""
    tab = _tables()
    tokens = torch.tensor([3, 5, 7, 11, 13, 2, 0, 0])  # 6 real tokens, 2 pads
    layer_tables = (tab.token2device, tab.token2device_conf)
    pred, conf = predict_token_devices(tokens[:6], D, *(torch.as_tensor(x[0]) for x in layer_tables))
    out = assign_tokens(tokens, tab, 0, num_real=6)
    assert torch.equal(out, pad_assignment(align_to_ranks(pred, conf, D), D, total=8))
    assert torch.bincount(out, minlength=D).tolist() == [2, 2, 2, 2]
    base = Tables("contiguous", D, tab.expert2device)
    assert assign_tokens(tokens, base, 0, num_real=6).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert assign_tokens(tokens, base, 0).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert assign_tokens(tokens, tab, 0, num_real=0).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
