"""The serving benchmark's pure parts: requests from prompts and a corpus, arrivals for a duration,
per-rank deltas of /metrics and the figures derived from them, the rate search's measurement,
Amdahl's bounds, per-rate ratios. Exact (or 1e-12) comparisons against hand computations."""

import json

import pytest

from tools.serve_bench import analysis, workload
from tools.serve_bench.loadgen import load_prompt_pairs, report


def _tok(text):  # one id per character
    return [ord(c) for c in text]


def test_from_prompts_lengths_answers_truncation_and_order():
    pairs = [("abcdefgh", "xyz"), ("ab", None), ("abcdefghijklmnopqrst", "0123456789")]
    reqs, info = workload.from_prompts(pairs, _tok, num=6, context=16, seed=3, max_output_len=8)
    assert len(reqs) == 6 and reqs[:3] == reqs[3:]  # three prompts, cycled
    # "xyz" -> 3 tokens; no answer -> --max-output-len; "0123456789" capped at 8 and its prompt cut to 16 - 8
    assert sorted((len(r.prompt), r.max_tokens) for r in reqs[:3]) == [(2, 8), (8, 3), (8, 8)]
    assert info == {"truncated": 1, "from_answers": 2, "prompts_used": 3}
    assert all(len(r.prompt) + r.max_tokens <= 16 for r in reqs)
    assert workload.from_prompts(pairs, _tok, num=6, context=16, seed=3, max_output_len=8)[0] == reqs  # seeded
    fixed, _ = workload.from_prompts(pairs, _tok, num=3, context=16, seed=3, input_len=5, output_len=4)
    assert {len(r.prompt) for r in fixed} == {5} and {r.max_tokens for r in fixed} == {4}
    assert tuple(_tok("ababa")) in {r.prompt for r in fixed}  # a short prompt repeated to --input-len
    with pytest.raises(ValueError, match="--input-len 15"):
        workload.from_prompts(pairs, _tok, num=1, context=16, seed=3, input_len=15, output_len=4)


def test_from_corpus_windows_and_arrivals_for_a_duration():
    text = "".join(chr(65 + i % 26) for i in range(500))
    reqs = workload.from_corpus(text, _tok, num=5, input_len=10, output_len=3, context=16, seed=1)
    for r in reqs:
        start = text.index("".join(map(chr, r.prompt)))
        assert len(r.prompt) == 10 and r.max_tokens == 3 and start >= 0
    with pytest.raises(ValueError, match="context"):
        workload.from_corpus(text, _tok, num=1, input_len=10, output_len=7, context=16, seed=1)
    times = workload.arrivals_for(5.0, 7, duration_s=20.0)
    assert all(t < 20.0 for t in times) and 50 < len(times) < 150
    assert workload.arrivals_for(5.0, 7, num=4) == times[:4]  # the same seeded process
    phase = workload.phase_requests(reqs[:2], [0.5, 1.0, 1.5])
    assert [p["at"] for p in phase] == [0.5, 1.0, 1.5] and phase[2]["prompt"] == list(reqs[0].prompt)


def test_load_prompt_pairs_takes_answers(tmp_path):
    share = tmp_path / "s.json"
    share.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}]},
        {"conversations": [{"from": "human", "value": "q2"}]},
        {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q3"},
                           {"from": "human", "value": "q4"}]}]))
    assert load_prompt_pairs(str(share)) == [("q1", "a1"), ("q2", None), ("q3", None)]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"text": "a", "answer": "bb"}\n{"text": "c"}\n')
    assert load_prompt_pairs(str(jsonl)) == [("a", "bb"), ("c", None)]
    with pytest.raises(ValueError, match="is a directory"):
        load_prompt_pairs(str(tmp_path))
    with pytest.raises(ValueError, match="No such file"):
        load_prompt_pairs(str(tmp_path / "missing.json"))


def _metrics(**per_rank):
    """/metrics samples for ranks given as {counter key: [rank0, rank1, ...]}."""
    out = {}
    for key, values in per_rank.items():
        for r, v in enumerate(values):
            out[f'{analysis.RANK_COUNTERS[key]}{{rank="{r}"}}'] = float(v)
    return out


ZERO = dict(tokens=[0, 0], busy_s=[0, 0], a2a_bytes=[0, 0], a2a_s=[0, 0], exposed_s=[0, 0], steps=[0, 0],
            dummy_forwards=[0, 0], local=[0, 0], routed=[0, 0])


def _phase(before, after, requests, duration):
    return {"name": "p", "duration_s": duration, "requests": requests,
            "metrics_before": _metrics(**before), "metrics_after": _metrics(**after)}


def _req(ttft, e2e, out, prompt=4, ok=True, max_tokens=None):
    return {"ttft_s": ttft, "e2e_s": e2e, "output_tokens": out, "prompt_tokens": prompt, "ok": ok,
            "max_tokens": out if max_tokens is None else max_tokens}


def test_rank_deltas_and_comm_summary_by_hand():
    before = dict(ZERO, tokens=[10, 20], busy_s=[1.0, 1.0])
    after = dict(tokens=[110, 120], busy_s=[3.0, 5.0], a2a_bytes=[800, 1200], a2a_s=[1.0, 2.0],
                 exposed_s=[0.5, 1.5], steps=[5, 4], dummy_forwards=[0, 1], local=[30, 50], routed=[100, 100])
    deltas = analysis.rank_deltas(_metrics(**before), _metrics(**after))
    assert deltas[1] == {"tokens": 100, "busy_s": 4.0, "a2a_bytes": 1200, "a2a_s": 2.0, "exposed_s": 1.5,
                         "steps": 4, "dummy_forwards": 1, "local": 50, "routed": 100}
    s = analysis.comm_summary(deltas, output_tokens=50)
    assert s["tokens_forwarded"] == 200 and s["a2a_bytes_per_token"] == 10.0
    assert s["engine_busy_s"] == 3.0 and s["a2a_time_s"] == 1.5 and s["exposed_a2a_s"] == 1.0
    assert s["a2a_fraction"] == 0.5 and s["exposed_fraction"] == pytest.approx(1 / 3)
    assert s["overlap"] == pytest.approx(1 / 3) and s["exposed_a2a_s_per_output_token"] == 0.02
    assert s["engine_steps"] == 9 and s["dummy_forwards"] == 1
    assert s["lar"] == 0.4 and s["local_activations"] == 80 and s["routed_activations"] == 200


def test_device_load_and_imbalance_by_hand():
    name = analysis.DEVICE_LOAD
    before = {f'{name}{{layer="0",device="0"}}': 10.0, f'{name}{{layer="0",device="1"}}': 10.0}
    after = {f'{name}{{layer="0",device="0"}}': 40.0, f'{name}{{layer="0",device="1"}}': 20.0,
             f'{name}{{layer="1",device="0"}}': 5.0, f'{name}{{layer="1",device="1"}}': 5.0}
    load = analysis.device_load(before, after)
    assert load == [[30.0, 10.0], [5.0, 5.0]]
    imb = analysis.load_imbalance(load)
    assert imb["per_layer"] == [1.5, 1.0] and imb["mean"] == 1.25 and imb["max"] == 1.5
    assert analysis.load_imbalance([]) is None


def test_serve_stats_pool_phases_and_report_per_rate_ratios():
    after = dict(tokens=[30, 30], busy_s=[2, 2], a2a_bytes=[600, 600], a2a_s=[1, 1], exposed_s=[1, 1],
                 steps=[3, 3], dummy_forwards=[0, 0])
    p1 = _phase(ZERO, after, [_req(0.1, 1.1, 11), _req(0.3, 0.7, 5, max_tokens=6)], 2.0)
    p2 = _phase(ZERO, after, [_req(0.2, 0.2, 1), _req(None, 3.0, 0, ok=False)], 4.0)
    one = analysis.serve_stats([p1], slo_ttft_s=0.2)
    assert one["requests_per_s"] == 1.0 and one["output_tokens_per_s"] == 8.0 and one["goodput_requests_per_s"] == 0.5
    assert one["short_outputs"] == 1 and one["a2a_bytes_per_token"] == 20.0
    assert one["exposed_a2a_s_per_output_token"] == 1 / 16
    both = analysis.pooled_serve_stats({"1": one, "2": analysis.serve_stats([p2])}, {"rate-1": p1, "rate-2": p2})
    assert both["num_requests"] == 4 and both["duration_s"] == 6.0 and both["failed_requests"] == 1
    assert both["output_tokens_per_s"] == 17 / 6 and both["tokens_forwarded"] == 120
    assert both["ttft_s"]["p50"] == 0.2 and set(both["rates"]) == {"1", "2"}
    faster = dict(both, output_tokens_per_s=2 * both["output_tokens_per_s"],
                  rates={"1": dict(one, output_tokens_per_s=4.0)})
    out = report({"standard": both, "bigmac": faster})
    assert out["ratios"]["bigmac"]["throughput_speedup"] == 2.0
    assert out["ratios"]["bigmac"]["rates"] == {"1": {"throughput_speedup": 0.5}}
    assert out["ratios"]["standard"]["rates"]["2"]["throughput_speedup"] == 1.0


def test_prefill_stats_ratios_and_amdahl():
    after = dict(tokens=[512, 512], busy_s=[2, 2], a2a_bytes=[1024, 1024], a2a_s=[1.2, 1.2], exposed_s=[1.2, 1.2],
                 steps=[2, 2], dummy_forwards=[0, 0])
    slow = dict(after, busy_s=[4, 4])
    base = analysis.prefill_stats([_phase(ZERO, after, [_req(0.5, 0.5, 1, prompt=64)] * 16, 4.0),
                                   _phase(ZERO, slow, [_req(0.5, 0.5, 1, prompt=64)] * 16, 8.0),
                                   _phase(ZERO, after, [_req(0.5, 0.5, 1, prompt=64)] * 16, 4.0)])
    assert base["prefill_tokens_per_s"] == {"median": 256.0, "min": 128.0, "max": 256.0, "n": 3}
    assert base["forward_tokens_per_s"]["median"] == 512.0 and base["a2a_fraction"]["median"] == pytest.approx(0.6)
    assert base["a2a_fraction"]["min"] == pytest.approx(0.3) and len(base["repeats"]) == 3
    assert base["num_requests"] == 48 and base["prompt_tokens"] == 3072 and base["duration_s"] == 16.0
    assert base["a2a_bytes_per_token"] == 2.0 and base["exposed_a2a_s_per_prompt_token"] == pytest.approx(3.6 / 3072)
    after_b = dict(after, a2a_bytes=[256, 256], busy_s=[1, 1], a2a_s=[0.3, 0.3], exposed_s=[0.3, 0.3])
    fast = analysis.prefill_stats([_phase(ZERO, after_b, [_req(0.25, 0.25, 1, prompt=64)] * 16, 2.0)])
    r = analysis.prefill_ratios({"standard": base, "bigmac": fast})
    assert r["bigmac"]["throughput_speedup"] == 2.0 and r["bigmac"]["forward_speedup"] == 2.0
    assert r["bigmac"]["bytes_ratio"] == 0.25 and r["standard"]["baseline_a2a_fraction"] == pytest.approx(0.6)
    assert r["bigmac"]["amdahl_bound"] == pytest.approx(1 / 0.4)  # 60% all-to-all removed
    assert r["bigmac"]["amdahl_bound_bytes"] == pytest.approx(1 / (0.4 + 0.6 * 0.25))
    assert analysis.amdahl_bound(1.0) is None and analysis.amdahl_bound(None) is None


def test_probe_fraction_uses_median_a2a_and_fastest_compute():
    rounds = []
    for a2a, busy in ((1.0, 3.0), (2.0, 3.0), (3.0, 7.0)):
        after = dict(ZERO, a2a_s=[a2a, a2a], busy_s=[busy, busy], exposed_s=[a2a, a2a])
        rounds.append(_phase(ZERO, after, [], 1.0))
    # compute = busy - exposed: 2, 1, 4 -> minimum 1; a2a median 2 -> 2 / (2 + 1)
    assert analysis.probe_fraction(rounds) == pytest.approx(2 / 3)


def test_serve_bounds_use_the_baselines_transfer_share_and_paired_speedups():
    """Per rate: the all-hidden bound is 1 / (1 - the baseline's share), the transfer share when
    recorded (medians over runs), else the in-flight share; a variant's fraction of the bound is
    its paired speedup median over the bound."""
    med = lambda x: {"median": x}  # noqa: E731
    per_variant = {
        "standard": {"rates": {
            "4": {"over_runs": {"transfer_fraction": med(0.5), "a2a_fraction": med(0.6)},
                  "a2a_bytes_per_token": 1000.0},
            "8": {"a2a_fraction": 0.25, "transfer_fraction": None},  # one run, no split
        }},
        "bigmac+farskip": {"rates": {"4": {"a2a_bytes_per_token": 400.0}, "8": {}, "16": {}}},
    }
    ratios = {"standard": {"rates": {"4": {"over_runs": {"throughput_speedup": med(1.0)}},
                                     "8": {"throughput_speedup": 1.0}}},
              "bigmac+farskip": {"rates": {"4": {"over_runs": {"throughput_speedup": med(1.8)}},
                                           "8": {"throughput_speedup": 1.2}}}}
    out = analysis.serve_bounds(per_variant, ratios)
    four = out["bigmac+farskip"]["4"]
    assert four["all_hidden_bound"] == pytest.approx(2.0) and four["amdahl_basis"] == "transfer"
    assert four["baseline_share"] == 0.5 and four["fraction_of_bound"] == pytest.approx(0.9)
    eight = out["bigmac+farskip"]["8"]
    assert eight["all_hidden_bound"] == pytest.approx(4 / 3) and eight["amdahl_basis"] == "in flight"
    assert eight["fraction_of_bound"] == pytest.approx(1.2 * 0.75)
    assert "16" not in out["bigmac+farskip"]  # no baseline at that rate
    assert out["standard"]["4"]["fraction_of_bound"] == pytest.approx(0.5)
    # the bytes saved: 0.4 of the baseline's, so the bound is 1 / (1 - 0.5 + 0.5 x 0.4)
    assert four["bytes_ratio"] == pytest.approx(0.4) and four["bytes_bound"] == pytest.approx(1 / 0.7)
    assert four["fraction_of_bytes_bound"] == pytest.approx(1.8 * 0.7)
    assert eight["bytes_ratio"] is None and eight["bytes_bound"] is None  # no bytes recorded


def test_the_printed_bounds_name_the_bytes_saved():
    from tools.serve_bench.report import _bound_lines

    rate = {"all_hidden_bound": 1.2, "amdahl_basis": "transfer", "baseline_share": 0.17, "fraction_of_bound": 0.83,
            "bytes_ratio": 1.0, "bytes_bound": 1.0, "fraction_of_bytes_bound": 1.0}
    placed = dict(rate, fraction_of_bound=0.9, bytes_ratio=0.6, bytes_bound=1.07, fraction_of_bytes_bound=0.95)
    lines = _bound_lines({"ratios": {"standard": {"rates": {"8": rate}}, "semmoe": {"rates": {"8": placed}}}})
    assert lines == ["all-hidden bound at rate 8: 1.20x (standard's transfer share 0.17 removed); speedup / bound: "
                     "standard 0.83, semmoe 0.90",
                     "bound from the bytes saved at rate 8 (bytes ratio; bound; speedup / bound): semmoe 0.600; "
                     "1.07x; 0.95"]
