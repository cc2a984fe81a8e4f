"""netsim.replay: the serving loop replayed on the fitted network (exact arithmetic on small cases),
and ``netsim predict`` / ``validate`` on a synthetic bench_serve run."""

from __future__ import annotations

import json
import math

import pytest

from netsim.collectives import AlphaBeta
from netsim.replay import Engine, Link, Request, StepProfile, phase_figures, predict_run, simulate, validate_run

C = AlphaBeta(alpha0=0.0, alpha_round=0.0, alpha_dest=1e-4, utilization=1.0)
PROF = StepProfile(fixed_s=0.01, per_token_s=1e-4, per_request_s=1e-3, dummy_s=0.005, a2a_bytes_per_token=1000.0,
                   a2a_calls=4)
LINK = Link(ranks=2, gbit=8e-3, constants=C)  # 1 MB/s: 1 byte = 1 us


def _a2a(tokens):
    return PROF.a2a_calls * (1e-4 + tokens * PROF.a2a_bytes_per_token / PROF.a2a_calls * 1e-6)


def test_one_request_alone():
    ctrl = 4 * 1e-4
    (ttft, e2e, n), = simulate([Request(0.0, 10, 3)], Engine(2, 64, 4, token_rounder=1), PROF, LINK)
    prefill = ctrl + PROF.compute_s(10, 1) + _a2a(10)  # the other rank runs its dummy forward (cheaper)
    decode = ctrl + PROF.compute_s(1, 1) + _a2a(1)
    assert n == 3
    assert ttft == pytest.approx(prefill + ctrl)
    assert e2e == pytest.approx(prefill + 2 * decode + ctrl)


def test_lockstep_round_robin_and_the_slowest_rank():
    ctrl = 4 * 1e-4
    got = simulate([Request(0.0, 10, 1), Request(0.0, 30, 1)], Engine(2, 64, 4, token_rounder=1), PROF, LINK)
    step = ctrl + PROF.compute_s(30, 1) + _a2a(30)  # ranks 0 and 1 in one step; the 30-token rank sets it
    assert [g[0] for g in got] == pytest.approx([step + ctrl] * 2)


def test_chunked_prefill_and_request_limit():
    (ttft, _, _), = simulate([Request(0.0, 100, 1)], Engine(1, 64, 4, token_rounder=1), PROF, Link(1, 1.0, C))
    assert ttft == pytest.approx(PROF.compute_s(64, 1) + PROF.compute_s(36, 1))  # one rank: no collectives
    # max_requests 1: the second request waits for the first to finish
    got = simulate([Request(0.0, 4, 2), Request(0.0, 4, 2)], Engine(1, 64, 1, token_rounder=1), PROF, Link(1, 1.0, C))
    assert got[1][0] > got[0][1]


def test_arrivals_wait_for_the_next_iteration_and_idle_skips_ahead():
    (ttft, _, _), = simulate([Request(5.0, 10, 1)], Engine(1, 64, 4, token_rounder=1), PROF, Link(1, 1.0, C))
    assert ttft == pytest.approx(PROF.compute_s(10, 1))


def test_engine_padding():
    e = Engine(2, 512, 16)
    assert e.padded(1, decode_only=True) == 16 and e.padded(20, decode_only=True) == 16
    assert e.padded(1, decode_only=False) == 64 and e.padded(65, decode_only=False) == 128
    # a decode step of one request costs what 16 tokens cost
    (ttft_a, e2e_a, _), = simulate([Request(0.0, 10, 3)], Engine(1, 64, 16), PROF, Link(1, 1.0, C))
    assert e2e_a - ttft_a == pytest.approx(2 * PROF.compute_s(16, 1))


def test_phase_figures():
    f = phase_figures([0.1, 0.3], [1.1, 2.3], [11, 21], [0.0, 1.0])
    assert f["ttft_p50_s"] == pytest.approx(0.2)
    assert f["tpot_p50_s"] == pytest.approx((0.1 + 0.1) / 2)
    assert f["output_tokens_per_s"] == pytest.approx(32 / 3.3)


def _run(lar=0.5):
    reqs = [{"sent": 0.5 * i, "prompt_tokens": 20, "output_tokens": 5, "max_tokens": 5, "ok": True}
            for i in range(6)]
    rates = {"2": {"ttft_s": {"p50": 0.05}, "tpot_s": {"p50": 0.02}, "output_tokens_per_s": 10.0}}
    return {"schema": "bench_serve/1", "mode": "serve",
            "network": {"shaped": True, "link": {"gbit": 0.5}},
            "config": {"ranks": 2, "variants": ["standard"], "server": {"max_batch_tokens": 64, "max_requests": 4}},
            "variants": {"standard": {"lar": lar, "rates": rates}}, "requests": {"standard": {"rate-2": reqs}}}


def test_predict_scales_bytes_by_the_measured_lar_and_validate_compares():
    prof = dict(PROF.__dict__, lar=0.5)
    base = predict_run(_run(0.5), {"standard": prof}, C)["standard"]["2"]
    local = predict_run(_run(1.0), {"standard": prof}, C)["standard"]["2"]  # everything local: no bytes
    assert local["ttft_p50_s"] < base["ttft_p50_s"]
    res = validate_run(_run(), {"standard": {"2": base}})
    assert res["points"] == 3 and res["model_version"].startswith("replay/") and len(res["model_fingerprint"]) == 12
    ttft = next(r for r in res["rows"] if r["figure"] == "ttft_p50_s")
    assert ttft["relative_error"] == pytest.approx((base["ttft_p50_s"] - 0.05) / 0.05)
    assert res["mean_abs_rel_error"] == pytest.approx(sum(abs(r["relative_error"]) for r in res["rows"]) / 3)
    with pytest.raises(ValueError, match="no variant"):
        predict_run(_run(), {"bigmac": prof}, C)


def test_validate_cli(tmp_path, capsys):
    from netsim.cli import main

    run = tmp_path / "serve.json"
    run.write_text(json.dumps(_run()))
    (tmp_path / "serve.profile.json").write_text(json.dumps(
        {"schema": "serving-compute-profile/1", "variants": {"standard": dict(PROF.__dict__, lar=0.5)}}))
    assert main(["validate", "--bench-serve", str(run), "--json", str(tmp_path / "v.json")]) == 0
    out = json.loads((tmp_path / "v.json").read_text())
    assert out["points"] == 3 and out["mean_abs_rel_error"] >= 0
    assert "mean absolute relative error over 3 points" in capsys.readouterr().out
    assert main(["validate", "--bench-serve", str(tmp_path / "missing.json")]) == 2
    assert "--bench-serve" in capsys.readouterr().err


def test_validate_counts_throughput_only_above_saturation():
    """Throughput is counted only where the server fell behind the offered load (requests/s
    below 0.8 x offered); TTFT and TPOT always count; per-figure means are of their own points."""
    run = _run()
    run["variants"]["standard"]["rates"] = {
        "2": {"ttft_s": {"p50": 0.1}, "tpot_s": {"p50": 0.02}, "output_tokens_per_s": 10.0,
              "offered_rate": 2.0, "requests_per_s": 1.7},  # kept up: offered-load bound
        "8": {"ttft_s": {"p50": 0.4}, "tpot_s": {"p50": 0.04}, "output_tokens_per_s": 20.0,
              "offered_rate": 8.0, "requests_per_s": 4.0},  # saturated
    }
    pred = {"standard": {"2": {"ttft_p50_s": 0.11, "tpot_p50_s": 0.018, "output_tokens_per_s": 5.0},
                         "8": {"ttft_p50_s": 0.3, "tpot_p50_s": 0.05, "output_tokens_per_s": 22.0}}}
    res = validate_run(run, pred)
    by = res["by_figure"]
    assert by["ttft_p50_s"]["points"] == 2 and by["ttft_p50_s"]["mean_abs_rel_error"] == pytest.approx((0.1 + 0.25) / 2)
    assert by["tpot_p50_s"]["mean_abs_rel_error"] == pytest.approx((0.1 + 0.25) / 2)
    assert by["output_tokens_per_s"]["points"] == 1 and by["output_tokens_per_s"]["max_abs_rel_error"] == pytest.approx(0.1)
    assert res["points"] == 5 and res["mean_abs_rel_error"] == pytest.approx((0.1 + 0.25 + 0.1 + 0.25 + 0.1) / 5)
    assert res["all_points"] == 6 and res["mean_abs_rel_error_all_points"] == pytest.approx(1.3 / 6)
    assert res["unmodelled"] == {}
    run["variants"]["standard"]["request_scheduler"] = "semmoe-algorithm-2"
    assert "round-robin" in validate_run(run, pred)["unmodelled"]["standard"]


def test_predict_refuses_tensor_parallel_layouts_it_does_not_model(tmp_path):
    """TP needs the link table (its all-reduces) and TP = EP = the ranks; the replicated-experts
    layout and a profile taken at another TP are refused in one line."""
    run = _run()
    run["config"]["tensor_model_parallel_size"] = 2
    prof = {"standard": dict(PROF.__dict__, lar=0.5, tp=2)}
    with pytest.raises(ValueError, match="TP = EP = the ranks"):
        predict_run(run, prof, C)  # no link table
    run["config"]["expert_model_parallel_size"] = 1
    with pytest.raises(ValueError, match="TP 2 x EP 1"):
        predict_run(run, prof, C, table=_table(tmp_path))
    run["config"]["expert_model_parallel_size"] = 2
    with pytest.raises(ValueError, match="taken at TP 1"):
        predict_run(run, {"standard": dict(PROF.__dict__, lar=0.5)}, C, table=_table(tmp_path))
    run["config"]["expert_comm"] = "allreduce"
    with pytest.raises(ValueError, match="allreduce"):
        predict_run(run, prof, C, table=_table(tmp_path))


def test_recorded_assignment_is_replayed():
    """Requests that record their engine (the server's x-dp-rank) go there, not round-robin: two
    simultaneous requests recorded on rank 0 are served one after the other's prefill batch on
    rank 0 while rank 1 idles; without a record they split over the ranks."""
    engine = Engine(2, 64, 4, token_rounder=1)
    spread = simulate([Request(0.0, 10, 1), Request(0.0, 10, 1)], engine, PROF, LINK)
    stacked = simulate([Request(0.0, 10, 1, rank=0), Request(0.0, 10, 1, rank=0)], engine, PROF, LINK)
    ctrl = 4 * 1e-4
    assert spread[0][0] == pytest.approx(ctrl + PROF.compute_s(10, 1) + _a2a(10) + ctrl)
    assert stacked[0][0] == pytest.approx(ctrl + PROF.compute_s(20, 2) + _a2a(20) + ctrl)  # one batch of both
    run = _run()
    run["variants"]["standard"]["request_scheduler"] = "semmoe-algorithm-2"
    pred = predict_run(run, {"standard": dict(PROF.__dict__, lar=0.5)}, C)
    assert "standard" in validate_run(run, pred)["unmodelled"]
    for r in run["requests"]["standard"]["rate-2"]:
        r["dp_rank"] = 1
    assert validate_run(run, predict_run(run, {"standard": dict(PROF.__dict__, lar=0.5)}, C))["unmodelled"] == {}


# ------------------------------------------------------------------ replay/4: the measured link table


def _table_csv(tmp_path, name, gbit, gap_s, rows, one_way=False, ranks=2, op="all_to_all"):
    """A bench_ep.py --collectives CSV (``rows``: (input bytes, seconds)) with its sidecar JSON."""
    path = tmp_path / f"{name}.csv"
    path.write_text("op,ranks,bytes,seconds\n" + "".join(f"{op},{ranks},{b},{s}\n" for b, s in rows))
    (tmp_path / f"{name}.json").write_text(json.dumps({"link": {"gbit": gbit}, "gap_s": gap_s, "one_way": one_way}))
    return str(path)


def _table(tmp_path, gbit=0.5):
    from netsim.replay import LinkTable

    return LinkTable.from_calibrations([
        _table_csv(tmp_path, "both0", gbit, 0.0, [(2000, 0.001), (8000, 0.008)]),  # off-rank 1000 / 4000 B
        _table_csv(tmp_path, "both10", gbit, 0.01, [(2000, 0.0005), (8000, 0.004)]),
        _table_csv(tmp_path, "one0", gbit, 0.0, [(2000, 0.0008), (8000, 0.004)], one_way=True),
    ])


def test_link_table_interpolates_in_size_rest_and_direction(tmp_path):
    t = _table(tmp_path)
    assert t.ranks == 2 and t.gaps_s == (0.0, 0.01) and t.one_way_gaps_s == (0.0,)
    assert t.seconds(1000, 1000, 0.0) == pytest.approx(0.001)
    assert t.seconds(2000, 2000, 0.0) == pytest.approx(0.001 * 2 ** 1.5)  # log-log between 1000 B and 4000 B
    assert t.seconds(10, 10, 0.0) == pytest.approx(0.001)  # below the smallest size: its time
    assert t.seconds(8000, 8000, 0.0) == pytest.approx(0.016)  # above the largest: its rate
    assert t.seconds(1000, 1000, 0.005) == pytest.approx(0.00075)  # linear in the rest
    assert t.seconds(1000, 1000, 1.0) == pytest.approx(0.0005)  # clamped at the longest measured rest
    assert t.seconds(4000, 0, 0.0) == pytest.approx(0.004)  # one way
    assert t.seconds(4000, 2000, 0.0) == t.seconds(2000, 4000, 0.0) == pytest.approx(0.006)  # half-way
    assert t.seconds(0, 0, 0.0) == 0.0


def test_link_table_refuses_what_does_not_fit(tmp_path):
    from netsim.replay import LinkTable

    a = _table_csv(tmp_path, "a", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)])
    with pytest.raises(ValueError, match="Gbit/s"):
        LinkTable.from_calibrations([a, _table_csv(tmp_path, "b", 0.6, 0.01, [(2000, 0.001), (8000, 0.008)])])
    with pytest.raises(ValueError, match="4 ranks"):
        LinkTable.from_calibrations([a, _table_csv(tmp_path, "c", 0.5, 0.01, [(2000, 0.001), (8000, 0.008)], ranks=4)])
    with pytest.raises(ValueError, match="second both-ways table"):
        LinkTable.from_calibrations([a, _table_csv(tmp_path, "d", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)])])
    with pytest.raises(ValueError, match="no both-ways"):
        LinkTable.from_calibrations([_table_csv(tmp_path, "e", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)], one_way=True)])
    with pytest.raises(ValueError, match="two sizes"):
        LinkTable.from_calibrations([_table_csv(tmp_path, "f", 0.5, 0.0, [(2000, 0.001)])])
    with pytest.raises(ValueError, match="sidecar"):
        LinkTable.from_calibrations([str(tmp_path / "missing.csv")])


def test_a_lone_prefill_with_the_link_table(tmp_path):
    """One request alone on rank 0 (rank 1 runs its dummy forward), by hand. Per MoE layer: the
    dispatch (rank 0's link out, one way), the probabilities' exchange (the link's latency) and the
    combine (rank 1's link out, one way). Each direction of each rank link rests on its own; a
    rest is the shaper's bucket in seconds (at most 64 KiB + one frame at the link rate), and a
    call spends what its bytes take at the link rate. The compute lies in five equal parts around
    the four data calls; the loop costs ``iteration_s``."""
    from netsim.replay import LinkTable, step_all_to_all_s

    t = LinkTable.from_calibrations([
        _table_csv(tmp_path, "both0", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)]),
        _table_csv(tmp_path, "both10", 0.5, 0.01, [(2000, 0.0005), (8000, 0.004)]),
        _table_csv(tmp_path, "one0", 0.5, 0.0, [(2000, 0.0008), (8000, 0.004)], one_way=True),
        _table_csv(tmp_path, "one10", 0.5, 0.01, [(2000, 0.0002), (8000, 0.002)], one_way=True),
    ])
    prof = StepProfile(fixed_s=0.01, per_token_s=1e-4, per_request_s=1e-3, dummy_s=0.005, a2a_bytes_per_token=400.0,
                       a2a_calls=6, loop_s=1e-3, iteration_s=3e-3)
    compute = prof.compute_s(10, 1)  # 0.012 s; 10 tokens x 100 B per layer one way = 1000 B per call
    part = compute / 5
    full = (64 * 1024 + 1514) / 62.5e6  # the bucket at 0.5 Gbit/s: 1.07 ms of rest
    spend = 1000 / 62.5e6
    assert t.bucket_s == pytest.approx(full)

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
    (ttft, _, _), = simulate([Request(0.0, 10, 1)], Engine(2, 64, 4, token_rounder=1), prof, LINK, t)
    ctrl = 3e-3 + LINK.control_s()  # the profiled loop overhead replaces loop_s
    assert ttft == pytest.approx(ctrl + compute + expected + ctrl)
    # the profiled layout: all the compute before the first call leaves the calls back to back
    one_layer = StepProfile(**{**prof.__dict__, "a2a_calls": 3})
    laid = StepProfile(**{**one_layer.__dict__, "compute_before": 1.0, "compute_after": 0.0})
    zero = [[0.0, 0.0], [0.0, 0.0]]
    rested = t.seconds(2000, 0, math.inf)  # one layer: 2000 B per call, after 12 ms of rest
    assert step_all_to_all_s(t, laid, [10, 0], compute, [r[:] for r in zero]) == pytest.approx(meta + 2 * rested)
    assert step_all_to_all_s(t, one_layer, [10, 0], compute, [r[:] for r in zero]) > meta + 2 * rested


def test_validate_cli_with_a_link_table(tmp_path, capsys):
    from netsim.cli import main

    run = tmp_path / "serve.json"
    run.write_text(json.dumps(_run()))
    (tmp_path / "serve.profile.json").write_text(json.dumps(
        {"schema": "serving-compute-profile/1", "variants": {"standard": dict(PROF.__dict__, lar=0.5)}}))
    _table(tmp_path)
    tables = [str(tmp_path / f) for f in ("both0.csv", "both10.csv", "one0.csv")]
    assert main(["validate", "--bench-serve", str(run), "--link-table", *tables, "--json", str(tmp_path / "v.json")]) == 0
    out = json.loads((tmp_path / "v.json").read_text())
    assert out["link_table"] == tables and out["model_version"].startswith("replay/7")
    capsys.readouterr()
    _table(tmp_path, gbit=0.25)  # rewritten at another rate than the run's 0.5 Gbit/s
    assert main(["validate", "--bench-serve", str(run), "--link-table", *tables]) == 2
    err = capsys.readouterr().err
    assert "link table" in err and len(err.strip().splitlines()) == 1


def test_link_table_reads_all_reduce_calibrations(tmp_path):
    """All-reduce files (``--ops all_reduce``) are kept apart, keyed by the tensor's bytes; a run
    that needs them and a table without them is a one-line error; a file of both ops is refused."""
    from netsim.replay import LinkTable

    both = _table_csv(tmp_path, "both0", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)])
    t = LinkTable.from_calibrations([
        both,
        _table_csv(tmp_path, "ar0", 0.5, 0.0, [(1000, 0.002), (4000, 0.008)], op="all_reduce"),
        _table_csv(tmp_path, "ar10", 0.5, 0.01, [(1000, 0.001), (4000, 0.004)], op="all_reduce"),
    ])
    assert t.gaps_s == (0.0,) and t.allreduce_gaps_s == (0.0, 0.01)
    assert t.seconds(1000, 1000, 0.0) == pytest.approx(0.001)  # the all-to-all curve is unchanged
    assert t.allreduce_seconds(1000, 0.0) == pytest.approx(0.002)
    assert t.allreduce_seconds(2000, 0.005) == pytest.approx(0.5 * (0.002 * 2 + 0.001 * 2))  # linear in log-log
    assert t.allreduce_seconds(0, 0.0) == 0.0
    with pytest.raises(ValueError, match="all_reduce calibrations"):
        LinkTable.from_calibrations([both]).allreduce_seconds(1000, 0.0)
    mixed = tmp_path / "mixed.csv"
    mixed.write_text("op,ranks,bytes,seconds\nall_to_all,2,2000,0.001\nall_reduce,2,2000,0.001\n"
                     "all_to_all,2,8000,0.004\n")
    (tmp_path / "mixed.json").write_text(json.dumps({"link": {"gbit": 0.5}, "gap_s": 0.0}))
    with pytest.raises(ValueError, match="not both"):
        LinkTable.from_calibrations([both, str(mixed)])


def test_a_tensor_parallel_step_by_hand(tmp_path):
    """TP = EP = 2, one engine, one MoE layer, by hand. Both ranks hold the engine's 10 tokens and
    dispatch them all (2000 B off-rank each way per call). The embedding's all-reduce comes at the
    step's start, the attention's after the compute before the first dispatch (here all of it),
    then the dispatch, the probabilities' exchange and the combine back to back, and the logits' all-gather of
    3 requests x 50 B from each rank at the end (replay/7: the probabilities' exchange follows the
    dispatch). Each collective is timed after the rest its links
    had and spends its bytes from their buckets."""
    from netsim.replay import LinkTable, step_all_to_all_s

    t = LinkTable.from_calibrations([
        _table_csv(tmp_path, "both0", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)]),
        _table_csv(tmp_path, "both10", 0.5, 0.01, [(2000, 0.0005), (8000, 0.004)]),
        _table_csv(tmp_path, "ar0", 0.5, 0.0, [(1000, 0.002), (4000, 0.008)], op="all_reduce"),
        _table_csv(tmp_path, "ar10", 0.5, 0.01, [(1000, 0.001), (4000, 0.004)], op="all_reduce"),
    ])
    prof = StepProfile(fixed_s=0.01, per_token_s=1e-4, per_request_s=1e-3, dummy_s=0.005, a2a_bytes_per_token=400.0,
                       a2a_calls=3, iteration_s=3e-3, compute_before=1.0, compute_after=0.0, tp=2,
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
    (ttft, _, _), = simulate([Request(0.0, 10, 1)], Engine(1, 64, 4, token_rounder=1), prof,
                             Link(ranks=2, gbit=0.5, constants=C), t)
    ctrl = 3e-3 + 4 * 1e-4
    expected_step = step_all_to_all_s(t, prof, [10, 10], prof.compute_s(10, 1), [[math.inf] * 2 for _ in range(2)],
                                      requests=1)
    assert ttft == pytest.approx(ctrl + prof.compute_s(10, 1) + expected_step + ctrl)


def test_step_calls_and_compute_gaps():
    """The order ``serve --a2a-spans`` records, and where the compute goes: the profile's measured
    layout for the kind of step when it has one of the sequence's length, else replay/6's
    (``compute_before``, even parts, ``compute_after``); shares sum to one."""
    from netsim.replay import compute_gaps, step_calls

    dp = StepProfile(**{**PROF.__dict__, "a2a_calls": 6, "compute_before": 0.3, "compute_after": 0.1})
    assert step_calls(dp) == ["dispatch", "meta", "combine"] * 2
    assert compute_gaps(dp, step_calls(dp), decode=True) == pytest.approx([0.3, 0.0, 0.2, 0.2, 0.0, 0.2, 0.1])
    tp = StepProfile(**{**dp.__dict__, "tp": 2, "tp_allreduces": 3, "tp_gathers": 1})
    seq = step_calls(tp)
    assert seq == ["reduce", "reduce", "dispatch", "meta", "combine", "reduce", "dispatch", "meta", "combine", "gather"]
    assert compute_gaps(tp, seq, decode=False) == pytest.approx([0, 0.3, 0, 0, 0.2, 0.2, 0, 0, 0.2, 0.1, 0])
    measured = tuple([0.05] * 10 + [0.5])
    laid = StepProfile(**{**tp.__dict__, "layout_decode": measured})
    assert compute_gaps(laid, seq, decode=True) == list(measured)
    assert compute_gaps(laid, seq, decode=False) == compute_gaps(tp, seq, decode=False)  # no prefill layout
    short = StepProfile(**{**tp.__dict__, "layout_decode": (0.5, 0.5)})  # another model's sequence: not used
    assert compute_gaps(short, seq, decode=True) == compute_gaps(tp, seq, decode=True)
    for p in (dp, tp):
        assert sum(compute_gaps(p, step_calls(p), decode=True)) == pytest.approx(1.0)


def test_a_measured_layout_moves_the_rests(tmp_path):
    """Where the compute lies decides the rests: with all of it before the first call the calls run
    back to back; the same compute between the dispatch and the combine gives the combine's link
    that rest instead. StepProfile.from_dict reads the layouts."""
    from netsim.replay import step_all_to_all_s

    t = _table(tmp_path)
    base = dict(PROF.__dict__, a2a_calls=3, a2a_bytes_per_token=400.0)
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


def test_link_table_takes_the_mean_of_the_repeats_where_the_sidecar_has_it(tmp_path):
    """A step costs the sum of its calls, so a call costs the calibration's mean (the sidecar's
    ``rows[].mean_s``), not the CSV's median; without it, the median."""
    from netsim.replay import LinkTable

    path = _table_csv(tmp_path, "both0", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)])
    plain = LinkTable.from_calibrations([path])
    side = tmp_path / "both0.json"
    meta = json.loads(side.read_text())
    meta["rows"] = [{"op": "all_to_all", "bytes": 2000, "seconds": 0.001, "mean_s": 0.003}]  # 8000 B: no mean
    side.write_text(json.dumps(meta))
    mean = LinkTable.from_calibrations([path])
    assert plain.seconds(1000, 1000, 0.0) == pytest.approx(0.001)
    assert mean.seconds(1000, 1000, 0.0) == pytest.approx(0.003)
    assert mean.seconds(4000, 4000, 0.0) == pytest.approx(0.008)
