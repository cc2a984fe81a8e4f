"""Aggregation and ratio math on hand-made per-rank results (exact up to float rounding, 1e-12)."""

import pytest

from tools.bench.aggregate import (
    format_table,
    ratios_vs,
    summarize,
    uncontended_comm_fraction,
    variant_stats,
)
from tools.bench.schema import RankResult, SyntheticOptions, WorkerSpec


def _result(rank, step, a2a, disp, comb, tokens=(100, 100, 100), world=2, variant="v"):
    n = len(step)
    return RankResult(
        rank=rank, world_size=world, variant=variant,
        step_time_s=list(step), fwd_time_s=[s * 0.4 for s in step], bwd_time_s=[s * 0.5 for s in step],
        a2a_time_s=list(a2a), exposed_comm_s=[a * 0.5 for a in a2a],
        a2a_bytes_dispatch=[disp] * n, a2a_bytes_combine=[comb] * n, tokens=list(tokens[:n]),
        peak_rss_mb=100.0 + rank,
    )  # fmt: skip


def test_summarize():
    assert summarize([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    with pytest.raises(ValueError):
        summarize([])


def test_variant_stats_by_hand():
    r0 = _result(0, [1.0, 2.0, 3.0], [0.5, 0.5, 1.5], 1000, 1000)
    r1 = _result(1, [1.0, 4.0, 3.0], [0.25, 1.0, 0.75], 3000, 1000)
    s = variant_stats([r0, r1])
    assert s["num_ranks"] == 2 and s["num_steps"] == 3
    # pooled step times 1, 2, 3, 1, 4, 3 -> median 2.5
    assert s["step_time_s"] == {"median": 2.5, "min": 1.0, "max": 4.0, "n": 6}
    # comm fractions .5, .25, .5, .25, .25, .25 -> median .25
    assert s["comm_fraction"]["median"] == pytest.approx(0.25)
    assert s["comm_fraction"]["max"] == pytest.approx(0.5)
    assert s["exposed_fraction"]["median"] == pytest.approx(0.125)
    # bytes per (rank, step): 2000 x3 and 4000 x3 -> median 3000
    assert s["a2a_bytes"]["median"] == 3000 and s["a2a_bytes"]["min"] == 2000
    # tokens/s per step: 200 / max(step) = 200/1, 200/4, 200/3 -> median 66.67
    assert s["tokens_per_s"]["median"] == pytest.approx(200 / 3)
    # compute = step - exposed (exposed = a2a / 2): .75, 1.75, 2.25, .875, 3.5, 2.625
    assert s["compute_s"]["min"] == pytest.approx(0.75) and s["compute_s"]["max"] == pytest.approx(3.5)
    assert s["tokens_per_s"]["n"] == 3
    assert s["peak_rss_mb"]["max"] == 101.0
    assert "a2a_bytes_backward" not in s


def test_ratios_vs_baseline():
    std = variant_stats([_result(0, [2.0] * 3, [1.0] * 3, 4000, 4000), _result(1, [2.0] * 3, [1.0] * 3, 4000, 4000)])
    fast = variant_stats([_result(0, [1.6] * 3, [0.4] * 3, 1000, 1000), _result(1, [1.6] * 3, [0.4] * 3, 1000, 1000)])
    r = ratios_vs({"standard": std, "bigmac": fast}, "standard")
    assert r["standard"]["step_time_speedup"] == pytest.approx(1.0)
    assert r["bigmac"]["step_time_speedup"] == pytest.approx(2.0 / 1.6)
    assert r["bigmac"]["bytes_ratio"] == pytest.approx(0.25)
    assert r["bigmac"]["a2a_time_ratio"] == pytest.approx(0.4)
    assert r["bigmac"]["comm_fraction"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="baseline"):
        ratios_vs({"bigmac": fast}, "standard")
    table = format_table({"standard": std, "bigmac": fast}, r)
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].startswith("variant")
    assert "1.250" in lines[3] and "0.250" in lines[3]


def test_zero_baseline_bytes_gives_no_ratio():
    zero = variant_stats([_result(0, [1.0], [0.0], 0, 0, world=1)])
    r = ratios_vs({"standard": zero, "x": zero}, "standard")
    assert r["x"]["bytes_ratio"] is None


def test_stats_reject_inconsistent_results():
    r0 = _result(0, [1.0, 2.0], [0.1, 0.1], 10, 10)
    with pytest.raises(ValueError, match="do not cover"):
        variant_stats([r0])  # rank 1 missing
    short = _result(1, [1.0], [0.1], 10, 10)
    with pytest.raises(ValueError, match="measured steps"):
        variant_stats([r0, short])


def test_rank_result_validation_and_round_trip(tmp_path):
    r = _result(0, [1.0, 2.0], [0.1, 0.2], 10, 10)
    path = tmp_path / "rank0.json"
    r.write(str(path))
    back = RankResult.read(str(path))
    assert back == r
    bad = RankResult.from_dict({**r.to_dict(), "tokens": [1.5, 2]})
    with pytest.raises(ValueError, match="tokens must hold integers"):
        bad.validate()
    bad = RankResult.from_dict({**r.to_dict(), "a2a_time_s": [0.1]})
    with pytest.raises(ValueError, match="a2a_time_s must be a list of 2"):
        bad.validate()
    with pytest.raises(ValueError, match="missing keys"):
        RankResult.from_dict({k: v for k, v in r.to_dict().items() if k != "tokens"})
    with pytest.raises(ValueError, match="unknown keys"):
        RankResult.from_dict({**r.to_dict(), "bogus": 1})


def test_worker_spec_round_trip_and_errors(tmp_path):
    spec = WorkerSpec("standard", str(tmp_path), warmup=1, steps=3, overrides={"hidden_size": 64})
    spec.write(str(tmp_path / "spec.json"))
    assert WorkerSpec.read(str(tmp_path / "spec.json")) == spec
    assert spec.result_path(1) == str(tmp_path / "rank1.json")
    with pytest.raises(ValueError, match="--steps"):
        WorkerSpec("standard", str(tmp_path), steps=0)
    with pytest.raises(ValueError, match="unknown keys"):
        WorkerSpec.from_dict({**spec.to_dict(), "nope": 1})
    with pytest.raises(ValueError, match="--synthetic-hidden"):
        SyntheticOptions(hidden=0)


def test_uncontended_fraction_uses_the_fastest_compute():
    # a2a median 0.5; compute (step - a2a/2) 0.75, 1.75, 2.75 -> minimum 0.75
    r0 = _result(0, [1.0, 2.0, 3.0], [0.5, 0.5, 0.5], 1, 1)
    s = variant_stats([r0, _result(1, [1.0, 2.0, 3.0], [0.5, 0.5, 0.5], 1, 1)])
    assert uncontended_comm_fraction(s) == pytest.approx(0.5 / (0.5 + 0.75))
    # a slower compute in some steps does not move it; the median share does move
    slow = _result(0, [1.0, 4.0, 5.0], [0.5, 0.5, 0.5], 1, 1)
    s_slow = variant_stats([slow, _result(1, [1.0, 4.0, 5.0], [0.5, 0.5, 0.5], 1, 1)])
    assert uncontended_comm_fraction(s_slow) == pytest.approx(uncontended_comm_fraction(s))
    assert s_slow["comm_fraction"]["median"] < s["comm_fraction"]["median"]


def test_dispatch_rows_dropped_and_padded_by_hand():
    """Routed/kept/sent (token, expert) rows summed over ranks and steps: rank 0 keeps 90+80 of
    100+100, rank 1 keeps 100+70 of 100+100 -> 340 of 400 kept, 15% dropped; buffers of 150 rows
    per step -> 600 sent, x1.5. Without ``buffer_rows`` no padding is claimed; nothing dropped, no
    line."""
    r0 = _result(0, [1.0, 1.0], [0.1, 0.1], 10, 10)
    r1 = _result(1, [1.0, 1.0], [0.1, 0.1], 10, 10)
    r0.extra.update(routed_rows=[100, 100], kept_rows=[90, 80], buffer_rows=[150, 150])
    r1.extra.update(routed_rows=[100, 100], kept_rows=[100, 70], buffer_rows=[150, 150])
    rows = variant_stats([r0, r1])["dispatch_rows"]
    assert rows == {"routed": 400, "kept": 340, "dropped_fraction": pytest.approx(0.15), "buffer": 600,
                    "padding_factor": 1.5}
    table = format_table({"ds": variant_stats([r0, r1])})
    assert "ds: capacity dropped 60 of 400 routed (token, expert) pairs (15.00%)" in table
    assert "ds: dispatch buffers padded to capacity: 600 rows sent for 400 routed (x1.500)" in table
    for r in (r0, r1):
        del r.extra["buffer_rows"]
        r.extra["kept_rows"] = [100, 100]
    stats = variant_stats([r0, r1])
    assert stats["dispatch_rows"] == {"routed": 400, "kept": 400, "dropped_fraction": 0.0}
    assert "capacity dropped" not in format_table({"std": stats}) and "padded" not in format_table({"std": stats})
