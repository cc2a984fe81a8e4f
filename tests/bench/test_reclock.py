"""tools/bench/reclock.py (its figures and its command, scripts/ttq_reclock.py) on hand-made curves
(figures worked out by hand)."""

import json
import os

import pytest

from tools.bench import reclock
from tools.bench.reclock import compare_pair, ppl_at_clock, reclocked_points, summarize_pairs
from tools.bench.ttq import Curve


def _curve(ppls, every=100):
    evals = {every * (i + 1): p for i, p in enumerate(ppls)}
    return Curve(step_time_s={s: 9.9 for s in range(1, every * len(ppls) + 1)}, evals=evals, done=True)


def test_reclocked_points_ignore_the_runs_own_clock():
    pts = reclocked_points(_curve([400, 300]), 0.5)
    assert pts == [(100, 50.0, 400), (200, 100.0, 300)]
    with pytest.raises(ValueError, match="positive"):
        reclocked_points(_curve([400]), 0.0)


def test_ppl_at_clock_interpolates_inside_and_refuses_outside():
    pts = [(100, 10.0, 400.0), (200, 20.0, 300.0)]
    assert ppl_at_clock(pts, 15.0) == pytest.approx(350.0)
    assert ppl_at_clock(pts, 20.0) == 300.0
    assert ppl_at_clock(pts, 5.0) is None and ppl_at_clock(pts, 25.0) is None


def test_a_variant_with_cheaper_steps_reaches_the_target_sooner():
    # baseline: 1 s/step, ends at 200 (step 400, 400 s); variant: 0.5 s/step, reaches 200 at step 300
    base = reclocked_points(_curve([400, 300, 250, 200]), 1.0)
    var = reclocked_points(_curve([420, 320, 200, 180]), 0.5)
    r = compare_pair(base, var)
    assert r["target_ppl"] == 200 and r["final_vs_baseline"] == pytest.approx(0.9)
    assert r["to_target_step"] == 300 and r["to_target_clock_s"] == 150.0
    assert r["speedup_to_target"] == pytest.approx(400 / 150)
    assert r["speedup_to_own_final"] is None  # the baseline never gets to 180
    # the variant's clock ends at 200 s, where the baseline is at step 200: 300
    assert r["baseline_ppl_at_variant_end"] == pytest.approx(300.0)


def test_a_variant_worse_per_step_misses_the_target_but_is_ahead_at_its_own_final():
    base = reclocked_points(_curve([400, 300, 250, 200]), 1.0)
    var = reclocked_points(_curve([420, 320, 260, 230]), 0.5)  # ends at 230 after 200 s
    r = compare_pair(base, var)
    assert r["to_target_step"] is None and r["speedup_to_target"] is None
    # the baseline reaches 230 between step 300 (250) and 400 (200): 300 + 100 x 20/50 = 340 steps, 340 s
    assert r["speedup_to_own_final"] == pytest.approx(340 / 200)
    assert r["final_vs_baseline"] == pytest.approx(1.15)


def test_summary_counts_the_seeds_that_reached_and_brackets_the_median():
    per_seed = {
        "1": {"final_ppl": 210.0, "final_vs_baseline": 1.05, "to_target_step": None, "to_target_clock_s": None,
              "speedup_to_target": None, "speedup_to_own_final": 1.5, "baseline_ppl_at_variant_end": 260.0},
        "2": {"final_ppl": 190.0, "final_vs_baseline": 0.95, "to_target_step": 300.0, "to_target_clock_s": 150.0,
              "speedup_to_target": 2.0, "speedup_to_own_final": None, "baseline_ppl_at_variant_end": 250.0},
        "3": {"final_ppl": 200.0, "final_vs_baseline": 1.00, "to_target_step": 400.0, "to_target_clock_s": 200.0,
              "speedup_to_target": 1.6, "speedup_to_own_final": 1.7, "baseline_ppl_at_variant_end": 255.0},
    }
    s = summarize_pairs(per_seed)
    assert s["reached_target"] == "2/3"
    assert s["speedup_to_target"]["n"] == 2 and s["speedup_to_target"]["median"] == pytest.approx(1.8)
    assert s["final_vs_baseline"]["median"] == 1.00
    assert 0.95 <= s["final_vs_baseline"]["ci_low"] <= 1.0 <= s["final_vs_baseline"]["ci_high"] <= 1.05


def _metrics(path, ppls, every=100):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for i, p in enumerate(ppls):
            step = every * (i + 1)
            for k in range(step - every + 1, step + 1):
                f.write(json.dumps({"step": k, "step_time_s": 9.9}) + "\n")
            f.write(json.dumps({"event": "valid", "step": step, "ppl": p}) + "\n")


def test_cli_uses_the_link_clock_and_clock_of(tmp_path, capsys):
    clock = tmp_path / "ttq.json"
    clock.write_text(json.dumps({"variants": {"standard": {"mean_step_s": 1.0}, "bigmac": {"mean_step_s": 0.5}},
                                 "over_runs": {"standard": {"mean_step_s": {"median": 1.0, "ci_low": 0.9, "ci_high": 1.1, "n": 3}},
                                               "bigmac": {"mean_step_s": {"median": 0.5, "ci_low": 0.5, "ci_high": 0.6, "n": 3}}}}))  # fmt: skip
    pattern = str(tmp_path / "s{seed}" / "{variant}" / "metrics.jsonl")
    for seed in (1, 2):
        _metrics(pattern.format(seed=seed, variant="standard"), [400, 300, 250, 200])
        _metrics(pattern.format(seed=seed, variant="bigmac"), [420, 320, 200, 180])
        _metrics(pattern.format(seed=seed, variant="plain"), [420, 320, 260, 230])
    out = tmp_path / "r.json"
    assert reclock.main(["--clock", str(clock), "--pattern", pattern, "--seeds", "1,2",
                             "--variants", "standard,bigmac,plain", "--clock-of", "plain=bigmac", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    bm = res["variants"]["bigmac"]["summary"]
    assert bm["speedup_to_target"]["median"] == pytest.approx(400 / 150)
    # at the clock intervals' ends: baseline 1.1 s and variant 0.5 s; baseline 0.9 s and variant 0.6 s
    ends = bm["speedup_to_target_at_clock_bounds"]
    assert ends["variant_fast"]["median"] == pytest.approx(440 / 150)
    assert ends["variant_slow"]["median"] == pytest.approx(360 / 180)
    assert res["variants"]["plain"]["summary"]["reached_target"] == "0/2"
    assert res["curves"]["standard"]["1"] == [[100, 400], [200, 300], [300, 250], [400, 200]]
    assert "2/2" in capsys.readouterr().out
    # a variant found elsewhere (a longer schedule) on another variant's clock, and the plot
    longer = str(tmp_path / "long" / "s{seed}.jsonl")
    for seed in (1, 2):
        _metrics(longer.format(seed=seed), [420, 320, 260, 230, 210, 195])  # 200 at step 566.7: 283.3 s
    png = tmp_path / "p.png"
    assert reclock.main(["--clock", str(clock), "--pattern", pattern, "--seeds", "1,2", "--variants", "standard,long",
                             "--clock-of", "long=bigmac", "--pattern-of", f"long={longer}", "--json", str(out),
                             "--plot", str(png)]) == 0
    long = json.loads(out.read_text())["variants"]["long"]["summary"]
    assert long["to_target_step"]["median"] == pytest.approx(500 + 100 * 10 / 15)
    assert long["speedup_to_target"]["median"] == pytest.approx(400 / ((500 + 100 * 10 / 15) * 0.5))
    assert png.stat().st_size > 0


def test_cli_names_a_missing_clock_or_run(tmp_path, capsys):
    clock = tmp_path / "ttq.json"
    clock.write_text(json.dumps({"variants": {"standard": {"mean_step_s": 1.0}}}))
    with pytest.raises(SystemExit):
        reclock.main(["--clock", str(clock), "--pattern", str(tmp_path / "{seed}{variant}"), "--seeds", "1",
                          "--variants", "standard,bigmac"])
    assert "no step time for 'bigmac'" in capsys.readouterr().err
    clock.write_text(json.dumps({"variants": {"standard": {"mean_step_s": 1.0}, "bigmac": {"mean_step_s": 0.5}}}))
    with pytest.raises(SystemExit):
        reclock.main(["--clock", str(clock), "--pattern", str(tmp_path / "{seed}{variant}"), "--seeds", "1",
                          "--variants", "standard,bigmac"])
    assert "no metrics for standard seed 1" in capsys.readouterr().err
    bad = tmp_path / "1standard"
    bad.write_text("{not json\n")
    (tmp_path / "1bigmac").write_text("")
    with pytest.raises(SystemExit):
        reclock.main(["--clock", str(clock), "--pattern", str(tmp_path / "{seed}{variant}"), "--seeds", "1",
                          "--variants", "standard,bigmac"])
    assert "unreadable metrics" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        reclock.main(["--clock", str(clock), "--pattern", str(tmp_path / "{seed}{variant}"), "--seeds", ",",
                          "--variants", "standard,bigmac"])
    assert "--seeds: comma-separated integers" in capsys.readouterr().err
