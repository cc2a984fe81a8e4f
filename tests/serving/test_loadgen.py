"""The serving benchmark's load generator, statistics and report shape (pure; exact or 1e-9)."""

import json
import math

import pytest

from tools.serve_bench.loadgen import RequestTiming, load_prompts, percentile, poisson_arrivals, report, summarize


def test_poisson_arrivals_are_seeded_increasing_and_have_the_rate():
    a = poisson_arrivals(4.0, 4000, seed=1)
    assert a == poisson_arrivals(4.0, 4000, seed=1) and a != poisson_arrivals(4.0, 4000, seed=2)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert abs(len(a) / a[-1] - 4.0) < 0.3  # 4000 exponential gaps: the mean is within a few %
    assert poisson_arrivals(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request-rates"):
        poisson_arrivals(0, 3, seed=0)


def test_load_prompts_jsonl_and_sharegpt(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    assert load_prompts(str(jsonl)) == ["a", "b"]
    share = tmp_path / "s.json"
    share.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},
                                 {"conversations": [{"from": "gpt", "value": "only"}]}]))
    assert load_prompts(str(share)) == ["hi"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_prompts(str(bad))


def test_percentile_matches_linear_interpolation():
    assert percentile([3, 1, 2, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    assert percentile([], 50) is None


def test_summarize_goodput_and_report_shape():
    timings = [RequestTiming(0.1, 1.1, 11), RequestTiming(0.5, 0.9, 5), RequestTiming(None, 2.0, 0, ok=False)]
    s = summarize(timings, 2.0, slo_ttft_s=0.2, slo_tpot_s=0.2)
    assert s["requests_per_s"] == 1.0 and s["output_tokens_per_s"] == 8.0 and s["failed_requests"] == 1
    assert s["goodput_requests_per_s"] == 0.5  # the second misses the TTFT SLO
    assert s["tpot_s"]["p50"] == pytest.approx((0.1 + 0.1) / 2)
    out = report({"standard": s, "bigmac": dict(s, output_tokens_per_s=16.0)})
    assert out["ratios"]["bigmac"]["throughput_speedup"] == 2.0 and out["ratios"]["standard"]["throughput_speedup"] == 1.0
    assert set(out["variants"]["bigmac"]["ttft_s"]) == {"p50", "p90", "p99", "n"}
    assert s["ttft_s"]["n"] == 2 and s["tpot_s"]["n"] == 2  # the failed request has none


def test_samples_needed_for_one_sample_beyond_the_percentile():
    from tools.serve_bench.loadgen import samples_needed

    assert (samples_needed(50), samples_needed(90), samples_needed(99), samples_needed(99.9)) == (2, 10, 100, 1000)
    for q in (50, 90, 99, 99.9):  # the smallest n with n (1 - q/100) >= 1: one sample expected beyond
        n = samples_needed(q)
        assert n * (1 - q / 100) >= 1 - 1e-9 > (n - 1) * (1 - q / 100)
