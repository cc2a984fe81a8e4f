"""netsim.replay: the serving loop replayed on the fitted network (exact arithmetic on small cases),
and ``netsim predict`` / ``validate`` on a synthetic bench_serve run."""

from __future__ import annotations

import json

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


def test_predict_refuses_a_tensor_parallel_run():
    run = _run()
    run["config"]["tensor_model_parallel_size"] = 2
    with pytest.raises(ValueError, match="tensor parallelism 2"):
        predict_run(run, {"standard": dict(PROF.__dict__, lar=0.5)}, C)


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
