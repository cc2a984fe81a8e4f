"""Metrics on a hand-built profile whose LAR, imbalance and bytes are worked out by hand (exact)."""

import numpy as np
import pytest

from moe_variants.semmoe.metrics import evaluate, rank_traffic, tp_batches
from moe_variants.semmoe.profile import profile_from_traces
from moe_variants.semmoe.tables import Tables


def _profile():
    # 1 layer, 4 experts, top-2, 2 requests of 4 tokens.
    r0 = (np.array([0, 1, 2, 3]), np.array([[[0, 1], [0, 2], [2, 3], [3, 1]]]))
    r1 = (np.array([4, 5, 6, 7]), np.array([[[2, 3], [0, 1], [2, 3], [2, 3]]]))
    return profile_from_traces([r0, r1], vocab_size=8, num_experts=4, meta={"hidden_size": 10})


def test_contiguous_dp_and_tp_by_hand():
    p = _profile()
    e2d = np.array([[0, 0, 1, 1]])  # experts 0, 1 on device 0
    t = Tables("contiguous", 2, e2d)
    # DP: request 0 -> rank 0, request 1 -> rank 1 (round robin).
    # r0 on device 0: local activations 2 + 1 + 0 + 1 = 4 of 8; r1 on device 1: 2 + 0 + 2 + 2 = 6 of 8.
    dp = evaluate(t, p, "dp", hidden_size=10, bytes_per_element=2)
    assert dp.lar == pytest.approx(10 / 16)
    assert (dp.lar_p25, dp.lar_p50, dp.lar_p75) == pytest.approx((0.5625, 0.625, 0.6875))
    assert dp.remote_activations == 6 and dp.a2a_bytes == 6 * 10 * 2
    # expert loads 3, 3, 5, 5 -> device loads 6 and 10 -> max / median = 10 / 8
    assert dp.imbalance_mean == pytest.approx(10 / 8)
    # TP, one request per batch: tokens 0, 1 -> rank 0, tokens 2, 3 -> rank 1 in each request.
    # r0: 2 + 1 + 2 + 1 = 6; r1: 0 + 2 + 2 + 2 = 6 -> 12 of 16.
    tp = evaluate(t, p, "tp", hidden_size=10)
    assert tp.lar == pytest.approx(12 / 16)


def test_per_device_sends_peak_to_mean_and_rank_traffic_by_hand():
    p = _profile()
    t = Tables("contiguous", 2, np.array([[0, 0, 1, 1]]))
    dp = evaluate(t, p, "dp", hidden_size=10, bytes_per_element=2)
    # expert devices per token: r0 (on rank 0) [0,0] [0,1] [1,1] [1,0] -> other devices 0 + 1 + 1 + 1;
    # r1 (on rank 1) [1,1] [0,0] [1,1] [1,1] -> 0 + 1 + 0 + 0: 4 sends against 6 remote activations
    assert dp.remote_sends == 4 and dp.a2a_bytes_per_device == 4 * 10 * 2
    assert dp.peak_to_mean == pytest.approx(10 / 8) and dp.peak_to_mean_max == pytest.approx(10 / 8)
    pairs, source_expert = rank_traffic(t, p, "dp")
    # rank 0's tokens: 4 activations on rank 0, 4 on rank 1; rank 1's: 2 on rank 0, 6 local
    assert pairs.tolist() == [[[4, 4], [2, 6]]]
    assert pairs[0].sum() - np.trace(pairs[0]) == dp.remote_activations
    assert source_expert.tolist() == [[[2, 2, 2, 2], [1, 1, 3, 3]]]


def test_groups_report_their_own_requests_served_together():
    p = _profile()
    t = Tables("contiguous", 2, np.array([[0, 0, 1, 1]]))
    dp = evaluate(t, p, "dp", hidden_size=10, groups={"a": np.array([0]), "b": np.array([1])})
    # the devices are the whole profile's (round robin): r0 on device 0 keeps 4 of 8, r1 on 1 keeps 6 of 8
    a, b = dp.by_group["a"], dp.by_group["b"]
    assert (a["lar"], b["lar"]) == pytest.approx((0.5, 0.75)) and a["requests"] == 1 and a["tokens"] == 4
    # r0's activations: experts 0,1,0,2,2,3,3,1 -> devices 0: 4, 1: 4 -> 1.0; r1's: 2,3,0,1,2,3,2,3 -> 2 / 6
    assert a["imbalance_max"] == pytest.approx(1.0)
    assert b["imbalance_mean"] == pytest.approx(6 / 4)  # median of [2, 6] is 4
    assert evaluate(t, p, "dp", hidden_size=10).by_group is None
    with pytest.raises(ValueError, match="no requests"):
        evaluate(t, p, "dp", hidden_size=10, groups={"empty": np.array([], dtype=np.int64)})


def test_scheduled_tp_uses_token_table():
    p = _profile()
    e2d = np.array([[0, 0, 1, 1]])
    t2d = np.array([[0, 0, 1, 1, 1, 0, 1, 1]], dtype=np.int16)  # each token's majority device
    conf = np.ones((1, 8), dtype=np.float32)
    seq = np.full((1, 4), -1, dtype=np.int16)
    t = Tables("semmoe", 2, e2d, t2d, conf, seq, np.zeros((1, 4), dtype=np.float32), lookback=2)
    tp = evaluate(t, p, "tp", hidden_size=10)
    # r0 aligned as predicted (2 + 2 per rank): 2 + 1 + 2 + 1 = 6. r1 wants 1, 0, 1, 1: rank 1 is over
    # capacity; equal confidence keeps the earlier tokens 4 and 6, token 7 moves to rank 0 (0 local)
    # -> 2 + 2 + 2 + 0 = 6.
    assert tp.lar == pytest.approx(12 / 16)
    tp_batched = evaluate(t, p, "tp", hidden_size=10, tp_batch_tokens=8)
    # one batch of 8 tokens, 4 per rank: predictions 0,0,1,1,1,0,1,1 want rank 1 five times; token 7
    # (last) overflows to rank 0 -> 2+1+2+1 + 2+2+2+0 = 12
    assert tp_batched.lar == pytest.approx(12 / 16)


def test_tp_batches_pack_whole_requests():
    assert tp_batches(np.array([3, 4, 5, 9, 1]), 8).tolist() == [7, 5, 9, 1]
    assert tp_batches(np.array([3, 4]), 0).tolist() == [3, 4]


def test_incompatible_tables_rejected():
    p = _profile()
    with pytest.raises(ValueError, match="layers x"):
        evaluate(Tables("contiguous", 2, np.array([[0, 0, 1, 1], [0, 0, 1, 1]])), p, "dp")
