"""Benchmark discipline (``tools.bench.discipline``) and the transfer/skew split, on synthetic data.

The bootstrap interval is checked against the generating distribution, not recomputed: over 200
seeded samples of 25 draws, a 95% interval must contain the true median at least 90% of the time
(nominal 95%; 200 trials give a binomial standard deviation of 1.5 points, so 90% is 3 below).
The other answers are exact by hand (1e-12: float sums)."""

import math

import numpy as np
import pytest

from tools.bench import discipline
from tools.bench.discipline import (
    DEFAULT_RUNS,
    LoadGate,
    LoadRefused,
    format_ci,
    interval_name,
    median_ci,
    paired_ratios,
    rotations,
)
from tools.bench.overlap import transfer_skew, transfer_skew_steps


@pytest.mark.parametrize("draw,true_median", [
    (lambda rng, n: rng.normal(5.0, 2.0, n), 5.0),
    (lambda rng, n: rng.exponential(1.0, n), math.log(2.0)),  # skewed: median ln 2
])
def test_bootstrap_interval_covers_the_true_median(draw, true_median):
    hits, widths = 0, {25: [], 100: []}
    for trial in range(200):
        for n in widths:
            x = draw(np.random.default_rng(1000 + trial), n)
            ci = median_ci(x, reps=1000, seed=trial)
            assert ci["ci_low"] <= ci["median"] <= ci["ci_high"]
            widths[n].append(ci["ci_high"] - ci["ci_low"])
            if n == 25:
                hits += ci["ci_low"] <= true_median <= ci["ci_high"]
    assert 0.90 <= hits / 200 <= 1.0
    # four times the runs: about half the width (1/sqrt(n)); 0.7 leaves room for the discreteness
    assert np.median(widths[100]) < 0.7 * np.median(widths[25])


def test_bootstrap_exact_cases():
    # {1, 2, 3}: a resample's median is 1 with probability 7/27 (two or three 1s), 3 likewise, so a
    # 95% bootstrap gives the extremes: below 5 runs the interval is the range, named so
    assert (median_ci([3.0, 1.0, 2.0])["ci_low"], median_ci([3.0, 1.0, 2.0])["ci_high"]) == (1.0, 3.0)
    assert median_ci([3.0, 1.0, 2.0])["interval_kind"] == "range"
    # {1, ..., 5}: the resample median is <= 2 with probability 0.317 and <= 3 with 0.683, so the 40%
    # and 60% quantiles are the middle value
    narrow = median_ci([5.0, 1.0, 4.0, 2.0, 3.0], level=0.2)
    assert (narrow["ci_low"], narrow["ci_high"], narrow["interval_kind"]) == (3.0, 3.0, "bootstrap")
    one = median_ci([7.5])
    assert one == {"median": 7.5, "ci_low": 7.5, "ci_high": 7.5, "level": None, "n": 1, "values": [7.5],
                   "interval_kind": "range"}
    assert median_ci([4.0] * 6)["ci_low"] == median_ci([4.0] * 6)["ci_high"] == 4.0
    assert median_ci([1.0, 2.0, 3.0, 4.0])["median"] == 2.5
    a, b = median_ci([1.0, 5.0, 2.0, 8.0, 3.0], seed=3), median_ci([1.0, 5.0, 2.0, 8.0, 3.0], seed=3)
    assert a == b  # deterministic given the seed
    with pytest.raises(ValueError):
        median_ci([])


def test_intervals_are_named_for_what_they_are():
    """At the default 3 runs the interval is the range of the runs, never "95%"; from 5 runs on the
    95% bootstrap interval of the median with its n. Tables say so; the JSON says ``interval_kind``,
    and a file written before that field (no ``interval_kind``) still formats."""
    from tools.bench.aggregate import format_table
    from tools.serve_bench.report import _footer

    assert (DEFAULT_RUNS, interval_name(3), interval_name(1, unit="seed")) == (3, "range of 3 runs", "range of 1 seed")
    assert interval_name(7) == "95% bootstrap interval of the median, n = 7"
    assert [median_ci(range(n))["interval_kind"] for n in (1, 4, 5, 9)] == ["range", "range", "bootstrap", "bootstrap"]
    assert _footer({"config": {"runs": 3}}, None, "tok/s") == [
        "tok/s: medians over 3 runs [range of 3 runs]; the rest pooled over the runs"]
    old = {"median": 2.0, "ci_low": 1.0, "ci_high": 3.0, "level": 0.95, "n": 3, "values": [1.0, 2.0, 3.0]}
    assert format_ci(old) == "2.0 [1.0-3.0]"
    seven = median_ci([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    stats = {"standard": {key: {"median": 0.5, "min": 0.4, "max": 0.6, "pooled": 0.5}
                          for key in ("step_time_s", "fwd_time_s", "bwd_time_s", "a2a_time_s", "exposed_comm_s",
                                      "a2a_bytes", "tokens_per_s", "peak_rss_mb")}}
    over = {"standard": {"step_time_s": seven, "comm_fraction": seven, "transfer_fraction": None,
                         "skew_fraction": None, "step_time_speedup": seven}}
    text = format_table(stats, over_runs=over)
    assert "medians over 7 runs [95% bootstrap interval of the median, n = 7]" in text and "range" not in text
    over["standard"] = {k: v and median_ci([1.0, 2.0, 3.0]) for k, v in over["standard"].items()}
    text = format_table(stats, over_runs=over)
    assert "medians over 3 runs [range of 3 runs]" in text and "95%" not in text


def test_rotations_put_every_variant_in_every_position():
    orders = rotations(["a", "b", "c"], 3)
    assert orders[0] == ["a", "b", "c"] and orders[1] == ["b", "c", "a"] and orders[2] == ["c", "a", "b"]
    for pos in range(3):
        assert sorted(o[pos] for o in orders) == ["a", "b", "c"]
    assert rotations(["a", "b"], 5) == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"], ["a", "b"]]
    assert rotations(["x"], 2) == [["x"], ["x"]]
    assert rotations(["a", "b", "c"], 2, start=1) == [["b", "c", "a"], ["c", "a", "b"]]
    with pytest.raises(ValueError):
        rotations(["a"], 0)


def test_paired_ratios_and_format():
    assert paired_ratios([2.0, 4.0, None], [1.0, 2.0, 3.0]) == [2.0, 2.0]
    assert format_ci({"median": 0.0125, "ci_low": 0.01, "ci_high": 0.015, "n": 3}, 1e3) == "12.5 [10.0-15.0]"
    assert format_ci({"median": 0.0125, "ci_low": 0.0125, "ci_high": 0.0125, "n": 1}, 1e3) == "12.5"
    assert format_ci(None) == "-"


def _fake_proc(root, busy, loadavg, procs):
    """A /proc with ``cpu`` busy jiffies (idle and iowait fixed) and ``procs``: pid -> (ppid, name,
    utime, stime, cutime, cstime)."""
    root.mkdir(exist_ok=True)
    (root / "stat").write_text(f"cpu  {busy - 30} 10 20 5000 7 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    (root / "loadavg").write_text(" ".join(str(x) for x in loadavg) + " 2/300 12345\n")
    for pid, (ppid, name, *times) in procs.items():
        d = root / str(pid)
        d.mkdir(exist_ok=True)
        fields = ["S", str(ppid)] + ["0"] * 9 + [str(t) for t in times] + ["20", "0", "1"]
        (d / "stat").write_text(f"{pid} ({name}) " + " ".join(fields) + "\n")


def test_machine_load_from_a_fake_proc(tmp_path):
    """Between the samples the CPUs did 300 busy jiffies; our tree (100 and its child 101) 100 of them
    (100: 10 of its own and 10 of reaped children; 101: 80); the other 200 jiffies in a 0.5 s window
    are 4 CPUs at 100 ticks/s."""
    proc = tmp_path / "proc"
    _fake_proc(proc, 1000, [0.5, 0.4, 0.3], {100: (1, "bench", 10, 5, 0, 0), 101: (100, "rank (0) x", 40, 0, 0, 0),
                                             200: (1, "other", 500, 0, 0, 0)})

    def sleep(_):
        _fake_proc(proc, 1300, [3.5, 1.0, 0.5], {100: (1, "bench", 20, 5, 10, 0), 101: (100, "rank (0) x", 120, 0, 0, 0),
                                                 200: (1, "other", 700, 0, 0, 0)})

    load = discipline.machine_load(0.5, proc=str(proc), root_pid=100, sleep=sleep, num_cpus=8)
    ticks = discipline.os.sysconf("SC_CLK_TCK")
    assert load["other_cpus"] == pytest.approx(200 / ticks / 0.5, abs=1e-12)
    assert load["other_share"] == pytest.approx(load["other_cpus"] / 8, abs=1e-12)
    assert load["loadavg_1_5_15"] == [3.5, 1.0, 0.5]
    # this process's own /proc answers too (values vary; only the shape is checked)
    real = discipline.machine_load(0.05)
    assert real["other_cpus"] >= 0 and len(real["loadavg_1_5_15"]) == 3


def _load(avg, other):
    return {"loadavg_1_5_15": [avg, avg, avg], "other_cpus": other, "other_share": other / 2, "window_s": 0.5}


def test_load_gate_marks_and_strict_refuses():
    gate = LoadGate(1.3, expected=2.0)
    assert gate.reasons(_load(3.2, 1.0)) == []
    assert gate.reasons(_load(3.4, 0.0)) == ["load average 3.40 > 2 + 1.3"]
    assert gate.reasons(_load(0.1, 1.5)) == ["other processes kept 1.50 CPUs busy > 1.3"]
    samples = iter([_load(3.4, 0.0), _load(0.5, 0.0)])
    gate = LoadGate(1.3, expected=2.0, sample=lambda: next(samples))
    mark = gate.after(gate.before("run 0"), "run 0")
    assert mark["loaded"] and mark["reasons"] == ["before: load average 3.40 > 2 + 1.3"]
    strict = LoadGate(1.3, expected=2.0, strict=True, sample=lambda: _load(4.0, 0.0))
    with pytest.raises(LoadRefused, match="--strict: not starting run 0"):
        strict.before("run 0")
    with pytest.raises(LoadRefused, match="--strict: run 1 ran on a loaded machine"):
        strict.after(_load(0.0, 0.0), "run 1")
    quiet = LoadGate(1.3, expected=2.0, strict=True, sample=lambda: _load(1.0, 0.2))
    assert quiet.after(quiet.before("r"), "r")["loaded"] is False
    with pytest.raises(ValueError, match="--load-threshold"):
        LoadGate(-1.0)


def test_transfer_skew_by_hand():
    """Rank 0 launched the dispatch 0.3 s before rank 1; both left at 0.5: transfer 0.2, rank 0's
    first 0.3 s is skew. The combines started together (no skew)."""
    r0 = [("dispatch", 0.0, 0.5), ("combine", 1.0, 1.2)]
    r1 = [("combine", 1.0, 1.2), ("dispatch", 0.3, 0.5)]  # any order: matched by launch order
    s0, s1 = transfer_skew([r0, r1])
    assert s0["transfer_s"] == pytest.approx(0.4, abs=1e-12) and s0["skew_s"] == pytest.approx(0.3, abs=1e-12)
    assert s1["transfer_s"] == pytest.approx(0.4, abs=1e-12) and s1["skew_s"] == pytest.approx(0.0, abs=1e-12)
    # the ranks' clocks need not agree: shifting rank 1's clock changes nothing
    shifted = [(n, s + 100.0, e + 100.0) for n, s, e in r1]
    assert transfer_skew([r0, shifted])[0] == pytest.approx(s0)
    # overlapping collectives: rank 0 has A [0, 1] and B [0.5, 1.5], rank 1 A [0.4, 1] and B [0.5, 1.5];
    # A's transfer 0.6, B's 1.0: rank 0's transfer parts [0.4, 1] and [0.5, 1.5] -> 1.1 of 1.5 in flight
    o0, o1 = transfer_skew([[("A", 0.0, 1.0), ("B", 0.5, 1.5)], [("A", 0.4, 1.0), ("B", 0.5, 1.5)]])
    assert (o0["in_flight_s"], o0["transfer_s"], o0["skew_s"]) == pytest.approx((1.5, 1.1, 0.4), abs=1e-12)
    assert (o1["in_flight_s"], o1["transfer_s"], o1["skew_s"]) == pytest.approx((1.1, 1.1, 0.0), abs=1e-12)
    assert transfer_skew([r0, [("dispatch", 0.3, 0.5)]]) is None  # different collectives
    steps = transfer_skew_steps([[r0, r0], [r1, r1]])
    assert steps[0]["skew_s"] == pytest.approx([0.3, 0.3], abs=1e-12)
    assert transfer_skew_steps([[r0], [r1, r1]]) is None
