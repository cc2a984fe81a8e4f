"""netsim.replay: the serving loop and its steps' collectives replayed on the calibrated link
(exact arithmetic on small cases worked out by hand)."""

from __future__ import annotations

import math

import pytest

from netsim.collectives import AlphaBeta
from netsim.replay import (Engine, Link, Request, StepProfile, loop_control_s, model, simulate, step_all_to_all_s,
                           step_calls)
from tests.netsim.conftest import flat_table, link_table, table_csv

C = AlphaBeta(alpha0=0.0, alpha_round=0.0, alpha_dest=1e-4, utilization=1.0)
# two MoE layers without the probabilities' exchange: dispatch, combine, dispatch, combine
PROF = StepProfile(fixed_s=0.01, per_token_s=1e-4, per_request_s=1e-3, dummy_s=0.005, a2a_bytes_per_token=1000.0,
                   a2a_calls=4, iteration_s=1e-3, layout_decode=(0.2,) * 5, layout_prefill=(0.2,) * 5)
LINK = Link(ranks=2, constants=C)
CTRL = 1e-3 + 4 * 1e-4  # replay/7: the profiled loop overhead and four latencies of the link
V7 = model("replay/7")  # the hand-worked steps below are the same in every version; the loop's exchange is replay/7's


def _a2a(tokens):
    """The flat table's collectives of a step whose busiest rank holds ``tokens``: four calls of
    250 B per token (1000 B per token over 2 layers, both ways), at least 1 ms each."""
    return 4 * max(1e-3, 250 * tokens * 1e-6)


def test_one_request_alone(tmp_path):
    (ttft, e2e, n), = simulate([Request(0.0, 10, 3)], Engine(2, 64, 4, token_rounder=1), PROF, LINK,
                               flat_table(tmp_path), V7)
    prefill = CTRL + PROF.compute_s(10, 1) + _a2a(10)  # the other rank runs its dummy forward (cheaper)
    decode = CTRL + PROF.compute_s(1, 1) + _a2a(1)
    assert n == 3
    assert ttft == pytest.approx(prefill + CTRL)
    assert e2e == pytest.approx(prefill + 2 * decode + CTRL)


def test_lockstep_round_robin_and_the_slowest_rank(tmp_path):
    got = simulate([Request(0.0, 10, 1), Request(0.0, 30, 1)], Engine(2, 64, 4, token_rounder=1), PROF, LINK,
                   flat_table(tmp_path), V7)
    step = CTRL + PROF.compute_s(30, 1) + _a2a(30)  # ranks 0 and 1 in one step; the 30-token rank sets it
    assert [g[0] for g in got] == pytest.approx([step + CTRL] * 2)


def test_chunked_prefill_and_request_limit(tmp_path):
    one, t = Link(1, C), flat_table(tmp_path)
    (ttft, _, _), = simulate([Request(0.0, 100, 1)], Engine(1, 64, 4, token_rounder=1), PROF, one, t)
    assert ttft == pytest.approx(2e-3 + PROF.compute_s(64, 1) + PROF.compute_s(36, 1) + 1e-3)  # one rank: no collectives
    # max_requests 1: the second request waits for the first to finish
    got = simulate([Request(0.0, 4, 2), Request(0.0, 4, 2)], Engine(1, 64, 1, token_rounder=1), PROF, one, t)
    assert got[1][0] > got[0][1]


def test_arrivals_wait_for_the_next_iteration_and_idle_skips_ahead(tmp_path):
    (ttft, _, _), = simulate([Request(5.0, 10, 1)], Engine(1, 64, 4, token_rounder=1), PROF, Link(1, C),
                             flat_table(tmp_path))
    assert ttft == pytest.approx(1e-3 + PROF.compute_s(10, 1) + 1e-3)


def test_engine_padding(tmp_path):
    e = Engine(2, 512, 16)
    assert e.padded(1, decode_only=True) == 16 and e.padded(20, decode_only=True) == 16
    assert e.padded(1, decode_only=False) == 64 and e.padded(65, decode_only=False) == 128
    # a decode step of one request costs what 16 tokens cost
    (ttft_a, e2e_a, _), = simulate([Request(0.0, 10, 3)], Engine(1, 64, 16), PROF, Link(1, C), flat_table(tmp_path))
    assert e2e_a - ttft_a == pytest.approx(2 * (1e-3 + PROF.compute_s(16, 1)))


def test_recorded_assignment_is_replayed(tmp_path):
    """Requests that record their engine (the server's x-dp-rank) go there, not round-robin: two
    simultaneous requests recorded on rank 0 are served in one prefill batch on rank 0 while rank
    1 idles; without a record they split over the ranks."""
    engine, t = Engine(2, 64, 4, token_rounder=1), flat_table(tmp_path)
    spread = simulate([Request(0.0, 10, 1), Request(0.0, 10, 1)], engine, PROF, LINK, t, V7)
    stacked = simulate([Request(0.0, 10, 1, rank=0), Request(0.0, 10, 1, rank=0)], engine, PROF, LINK, t, V7)
    assert spread[0][0] == pytest.approx(CTRL + PROF.compute_s(10, 1) + _a2a(10) + CTRL)
    assert stacked[0][0] == pytest.approx(CTRL + PROF.compute_s(20, 2) + _a2a(20) + CTRL)  # one batch of both


def test_a_lone_prefill_with_the_link_table(tmp_path):
    """One request alone on rank 0 (rank 1 runs its dummy forward), by hand. Per MoE layer: the
    dispatch (rank 0's link out, one way), the probabilities' exchange (the link's latency) and the
    combine (rank 1's link out, one way). Each direction of each rank link rests on its own; a
    rest is the shaper's bucket in seconds (at most 64 KiB + one frame at the link rate), and a
    call spends what its bytes take at the link rate. The layout puts a fifth of the compute
    before each dispatch and combine and after the last; the loop costs ``iteration_s``."""
    from netsim.link_table import LinkTable

    t = LinkTable.from_calibrations([
        table_csv(tmp_path, "both0", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)]),
        table_csv(tmp_path, "both10", 0.5, 0.01, [(2000, 0.0005), (8000, 0.004)]),
        table_csv(tmp_path, "one0", 0.5, 0.0, [(2000, 0.0008), (8000, 0.004)], one_way=True),
        table_csv(tmp_path, "one10", 0.5, 0.01, [(2000, 0.0002), (8000, 0.002)], one_way=True),
    ])
    fifths = (0.2, 0.0, 0.2, 0.2, 0.0, 0.2, 0.2)
    prof = StepProfile(fixed_s=0.01, per_token_s=1e-4, per_request_s=1e-3, dummy_s=0.005, a2a_bytes_per_token=400.0,
                       a2a_calls=6, iteration_s=3e-3, layout_decode=fifths, layout_prefill=fifths)
    compute = prof.compute_s(10, 1)  # 0.012 s; 10 tokens x 100 B per layer one way = 1000 B per call
    part = compute / 5
    full = (64 * 1024 + 1514) / 62.5e6  # the bucket at 0.5 Gbit/s: 1.07 ms of rest
    spend = 1000 / 62.5e6

    def one_way(rest):  # 1000 B one way: 0.8 ms back to back, 0.2 ms after 10 ms or more
        return 0.0008 + (0.0002 - 0.0008) * min(rest, 0.01) / 0.01

    meta = 0.0005  # 1000 B both ways after a long rest
    first = one_way(math.inf)  # both links rested since forever
    d2 = one_way(full - spend + first + part + first + part + meta)  # rank 0 out: since the first dispatch
    c2 = one_way(full - spend + first + part + meta + d2 + part)  # rank 1 out: since the first combine
    expected = 2 * meta + 2 * first + d2 + c2
    rest = [[math.inf, math.inf], [math.inf, math.inf]]
    assert step_all_to_all_s(t, prof, [10, 0], compute, rest) == pytest.approx(expected)
    assert rest[0][0] == pytest.approx(full - spend + d2 + meta + part + c2 + part)  # the probabilities follow the dispatch
    (ttft, _, _), = simulate([Request(0.0, 10, 1)], Engine(2, 64, 4, token_rounder=1), prof, LINK, t, V7)
    ctrl = 3e-3 + LINK.control_s()
    assert ttft == pytest.approx(ctrl + compute + expected + ctrl)
    # all the compute before the first call leaves the calls back to back
    first, even = (1.0, 0.0, 0.0, 0.0), (1 / 3, 0.0, 1 / 3, 1 / 3)
    ahead = StepProfile(**{**prof.__dict__, "a2a_calls": 3, "layout_decode": first, "layout_prefill": first})
    between = StepProfile(**{**ahead.__dict__, "layout_decode": even, "layout_prefill": even})
    zero = [[0.0, 0.0], [0.0, 0.0]]
    rested = t.seconds(2000, 0, math.inf)  # one layer: 2000 B per call, after 12 ms of rest
    assert step_all_to_all_s(t, ahead, [10, 0], compute, [r[:] for r in zero]) == pytest.approx(meta + 2 * rested)
    assert step_all_to_all_s(t, between, [10, 0], compute, [r[:] for r in zero]) > meta + 2 * rested


def test_a_tensor_parallel_step_by_hand(tmp_path):
    """TP = EP = 2, one engine, one MoE layer, by hand. Both ranks hold the engine's 10 tokens and
    dispatch them all (2000 B off-rank each way per call). The embedding's all-reduce comes at the
    step's start, the attention's after the compute before the first dispatch (here all of it),
    then the dispatch, the probabilities' exchange and the combine back to back, and the logits'
    all-gather of 3 requests x 50 B from each rank at the end. Each collective is timed after the
    rest its links had and spends its bytes from their buckets."""
    from netsim.link_table import LinkTable

    t = LinkTable.from_calibrations([
        table_csv(tmp_path, "both0", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)]),
        table_csv(tmp_path, "both10", 0.5, 0.01, [(2000, 0.0005), (8000, 0.004)]),
        table_csv(tmp_path, "one0", 0.5, 0.0, [(2000, 0.0001), (8000, 0.0001)], one_way=True),  # never used
        table_csv(tmp_path, "ar0", 0.5, 0.0, [(1000, 0.002), (4000, 0.008)], op="all_reduce"),
        table_csv(tmp_path, "ar10", 0.5, 0.01, [(1000, 0.001), (4000, 0.004)], op="all_reduce"),
    ])
    ahead = (0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # reduce, reduce, dispatch, meta, combine, gather, after
    prof = StepProfile(fixed_s=0.01, per_token_s=1e-4, per_request_s=1e-3, dummy_s=0.005, a2a_bytes_per_token=400.0,
                       a2a_calls=3, iteration_s=3e-3, layout_decode=ahead, layout_prefill=ahead, tp=2,
                       tp_allreduces=2, tp_allreduce_bytes_per_token=100.0, tp_gathers=1,
                       tp_gather_bytes_per_request=50.0)
    compute = prof.compute_s(10, 3)  # 0.014 s
    full = (64 * 1024 + 1514) / 62.5e6  # the bucket at 0.5 Gbit/s
    rate = 62.5e6

    def both(off_rank, rest):  # the both-ways curve: log-log in bytes, linear in the rest up to 10 ms
        def at(c0, c1):
            x = min(max(off_rank, 1000), 4000)
            return c0 * (c1 / c0) ** (math.log(x / 1000) / math.log(4))
        return at(0.001, 0.008) + (at(0.0005, 0.004) - at(0.001, 0.008)) * min(rest, 0.01) / 0.01

    embed = 0.001  # 1000 B tensor after a long rest
    rest = full - 1000 / rate + embed + compute  # every direction: the embedding spent 1000 B of its bucket
    attn = 0.002 + (0.001 - 0.002) * min(rest, 0.01) / 0.01
    rest = min(rest, full) - 1000 / rate + attn
    meta = 0.0005  # the smallest message after a long rest, right after the dispatch
    dispatch = both(2000, rest)
    rest = max(0.0, min(rest, full) - 2000 / rate) + dispatch if min(rest, full) >= 2000 / rate else 0.0
    rest += meta
    combine = both(2000, rest)
    rest = min(rest, full) - 2000 / rate + combine if min(rest, full) >= 2000 / rate else 0.0
    gather = both(150, rest)  # 3 x 50 B in from the other rank: below the smallest size
    links = [[math.inf, math.inf], [math.inf, math.inf]]
    got = step_all_to_all_s(t, prof, [10, 10], compute, links, requests=3)
    assert got == pytest.approx(embed + attn + meta + dispatch + combine + gather)
    # simulate: one engine whose two ranks both hold the request
    (ttft, _, _), = simulate([Request(0.0, 10, 1)], Engine(1, 64, 4, token_rounder=1), prof, LINK, t, V7)
    ctrl = 3e-3 + 4 * 1e-4
    expected_step = step_all_to_all_s(t, prof, [10, 10], prof.compute_s(10, 1), [[math.inf] * 2 for _ in range(2)],
                                      requests=1)
    assert ttft == pytest.approx(ctrl + prof.compute_s(10, 1) + expected_step + ctrl)


def test_the_loop_exchange_by_version(tmp_path):
    """replay/7 charges the profiled overhead and four fitted latencies every iteration; replay/8
    the loop's collectives as it makes them (the header every iteration, the broadcast when requests
    arrived, the gather after a step that produced tokens), each the link table's smallest message."""
    t = flat_table(tmp_path)
    small = t.seconds(t.smallest_bytes, t.smallest_bytes, math.inf)
    assert small == pytest.approx(1e-3)
    v8 = model("replay/8")
    for arrived in (False, True):
        for produced in (False, True):
            assert loop_control_s(V7, PROF, LINK, t, arrived, produced) == pytest.approx(CTRL)
            assert loop_control_s(v8, PROF, LINK, t, arrived, produced) == pytest.approx(
                PROF.iteration_s + small * (1 + arrived + produced))
            assert loop_control_s(v8, PROF, Link(1, C), t, arrived, produced) == PROF.iteration_s  # no peers
    assert model() is model("replay/8") and model(v8.version) is v8
    with pytest.raises(ValueError, match="no replay model 'replay/0' .known: replay/7, replay/8"):
        model("replay/0")


def test_one_request_alone_in_replay_8(tmp_path):
    """The first iteration brings the request (header and broadcast), each later one gathers the
    last step's token (header and gather); a token reaches the client one such exchange later."""
    t = flat_table(tmp_path)
    (ttft, e2e, n), = simulate([Request(0.0, 10, 3)], Engine(2, 64, 4, token_rounder=1), PROF, LINK, t)
    two = PROF.iteration_s + 2 * 1e-3
    prefill = two + PROF.compute_s(10, 1) + _a2a(10)
    decode = two + PROF.compute_s(1, 1) + _a2a(1)
    assert n == 3
    assert ttft == pytest.approx(prefill + two)
    assert e2e == pytest.approx(prefill + 2 * decode + two)
    # a request arriving while another decodes (during the second iteration) joins the third, with
    # that iteration's broadcast: three messages
    got = simulate([Request(0.0, 10, 3), Request(prefill + 1e-6, 10, 1)], Engine(2, 64, 4, token_rounder=1), PROF,
                   LINK, t)
    three = PROF.iteration_s + 3 * 1e-3
    step = three + PROF.compute_s(10, 1) + _a2a(10)  # the newcomer's 10 tokens on rank 1 set the step
    assert got[1][0] == pytest.approx(prefill + decode + step + two - (prefill + 1e-6))


def test_step_calls_in_the_order_the_spans_record():
    dp = StepProfile(**{**PROF.__dict__, "a2a_calls": 6, "layout_decode": (0.0,) * 7, "layout_prefill": (0.0,) * 7})
    assert step_calls(dp) == ["dispatch", "meta", "combine"] * 2
    tp = StepProfile(**{**dp.__dict__, "tp": 2, "tp_allreduces": 3, "tp_gathers": 1, "layout_decode": (0.0,) * 11,
                        "layout_prefill": (0.0,) * 11})
    assert step_calls(tp) == ["reduce", "reduce", "dispatch", "meta", "combine", "reduce", "dispatch", "meta", "combine",
                              "gather"]
    assert step_calls(PROF) == ["dispatch", "combine"] * 2


def test_a_profile_needs_its_measured_layouts_and_loop_overhead():
    """The layouts (one share before each collective of the step and one after) and the loop's
    measured overhead are inputs of the model: a profile without them, or with a layout of another
    model's step, is a one-line error naming what is missing."""
    d = {k: v for k, v in PROF.__dict__.items()}
    assert StepProfile.from_dict(d) == PROF
    for key in ("layout_decode", "layout_prefill", "iteration_s"):
        with pytest.raises(ValueError, match=f"no {key} .*profile_serving_compute"):
            StepProfile.from_dict({**d, key: None})
    with pytest.raises(ValueError, match="layout_prefill has 3 shares; .* 4 collectives, so it needs 5"):
        StepProfile.from_dict({**d, "layout_prefill": [0.5, 0.0, 0.5]})


def test_a_measured_layout_moves_the_rests(tmp_path):
    """Where the compute lies decides the rests: with all of it before the first call the calls run
    back to back; the same compute between the dispatch and the combine gives the combine's link
    that rest instead. StepProfile.from_dict reads the layouts."""
    t = link_table(tmp_path)
    base = dict(PROF.__dict__, a2a_calls=3, a2a_bytes_per_token=400.0, layout_prefill=[0.25] * 4)
    ahead = StepProfile.from_dict(dict(base, layout_decode=[1.0, 0.0, 0.0, 0.0]))
    inside = StepProfile.from_dict(dict(base, layout_decode=[0.0, 0.0, 1.0, 0.0]))
    assert ahead.layout_decode == (1.0, 0.0, 0.0, 0.0)
    zero = [[0.0, 0.0], [0.0, 0.0]]
    fast = step_all_to_all_s(t, ahead, [10, 10], 0.012, [r[:] for r in zero], decode=True)
    rested = step_all_to_all_s(t, inside, [10, 10], 0.012, [r[:] for r in zero], decode=True)
    meta = t.seconds(t.smallest_bytes, t.smallest_bytes, math.inf)

    def both(rest):  # 2000 B each way per call (200 B per token one way)
        return t.seconds(2000, 2000, rest)

    full, spend = t.bucket_s, 2000 / t.bytes_per_s
    first = both(0.012)  # the dispatch after 12 ms of rest; the combine right after it and the probabilities
    assert fast == pytest.approx(first + meta + both(full - spend + first + meta))
    assert rested == pytest.approx(both(0.0) + meta + both(meta + 0.012))  # the dispatch found an empty bucket
    assert rested > fast
    prefill = step_all_to_all_s(t, inside, [10, 10], 0.012, [r[:] for r in zero], decode=False)
    assert prefill != rested  # a prefill step takes the prefill layout
